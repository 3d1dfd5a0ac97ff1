"""Rehearse the faults that burn allocations: a node cut off the network (a partition), a
node that loses power, and the node coming back.

Seen from the other nodes a power loss is a link that goes quiet without a FIN or a RST, so
`power-off` takes the link down first and only then kills every process of the node (its
ranks, orted, slurmstepd, sshd and slurmd): nothing it ran gets to say goodbye. `heal` brings
the link up and restarts the node's sshd and slurmd; Slurm returns the node to service when
its slurmd registers again.
"""

from __future__ import annotations

import time

from ringtrain.cluster import control, ssh
from ringtrain.cluster.layout import Node
from ringtrain.cluster.system import (
    ClusterError,
    end_processes,
    netns_pids,
    pid_from_file,
    require_root,
    run,
)

FAULTS = ("partition", "power-off", "heal")
SERVING = ("idle", "alloc", "mix", "comp")  # sinfo's short states of a node that takes jobs


def inject(name: str, fault: str) -> str:
    """Apply `fault` to node `name`; a line saying what was done."""
    require_root("fault")
    spec = control.read_spec()
    layout = spec.layout()
    node = layout.node(name)
    if fault == "partition":
        _set_link(node, "down")
        return f"{name}: link down; its processes run on, unreachable"
    if fault == "power-off":
        _set_link(node, "down")
        pids = netns_pids(node.netns)
        end_processes(pids, grace=0)
        return f"{name}: link down, then its {len(pids)} processes killed"
    _set_link(node, "up")
    restarted = []
    if pid_from_file(ssh.sshd_pid_path(node), "sshd") is None:
        control.start_sshd(node)
        restarted.append("sshd")
    control.wait_for_ssh(node, timeout=60)  # its ranks may still spin on its cores
    if spec.slurm:
        cluster = control.slurm_cluster(layout)
        slurm_node = next(n for n in control.slurm_nodes(layout) if n.name == name)
        alive = cluster.slurmd_pid(slurm_node)
        if alive is not None:  # partitioned: register now, not at slurmctld's next ping
            end_processes([alive], grace=5)  # (every SlurmdTimeout/3; 100 s by default)
        cluster.start_slurmd(slurm_node)
        restarted.append("slurmd")
        _wait_until_serving(cluster, name)
    return f"{name}: link up" + (f", {' and '.join(restarted)} restarted" if restarted else "")


def _set_link(node: Node, state: str) -> None:
    run(["ip", "link", "set", node.veth, state])


def _wait_until_serving(cluster, name: str, timeout: float = 60) -> None:
    """A node an operator set DOWN stays down after it registers unless resumed."""
    deadline = time.monotonic() + timeout
    state = "missing"
    while time.monotonic() < deadline:
        state = cluster.node_states().get(name, "missing")
        if state in SERVING:
            return
        if state.startswith("down") and not state.endswith("*"):  # registered, held down
            update = ["scontrol", "update", f"NodeName={name}", "State=RESUME"]
            cluster.client(update, check=False, timeout=10)
        time.sleep(0.5)
    raise ClusterError(f"{name} did not return to service in {timeout:.0f} s (sinfo: {state})")
