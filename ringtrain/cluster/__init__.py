"""`ringtrain cluster`: a rehearsal cluster of Linux namespaces on one machine (root only).

Each node is a network namespace plus a UTS namespace (hostname node1..nodeN) on the shared
filesystem, joined to the launching host by a veth pair on one bridge, running its own sshd
(and, with --slurm, its own slurmd), all inside the node's memory cgroup with --mem-per-node.
Nothing in the training core imports this package.
"""
