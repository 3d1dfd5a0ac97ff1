"""`ringtrain cluster up|status|down|exec|fault`, for the main CLI to mount.

Exit codes: 0 done; 1 the system refused a step (ClusterError: the line says which, and `up`
removed what it had created), or `status` found a node or daemon missing; 2 bad input,
including not being root and a second `up`. The exit code of `exec` is the command's.
Errors go up to the main CLI, which prints the one line.
"""

from __future__ import annotations

import argparse
import sys

from ringtrain.cluster import control, faults
from ringtrain.cluster.layout import DEFAULT_SUBNET
from ringtrain.config import byte_size
from ringtrain.errors import EXIT_PROBLEMS


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(
        dest="cluster_command", required=True, metavar="{up,status,down,exec,fault}"
    )
    up = commands.add_parser(
        "up",
        help="create N nodes (namespaces on a bridge, each with sshd; Slurm with --slurm)",
        description="Create a rehearsal cluster of N nodes on this machine (root only).",
    )
    up.add_argument("--nodes", type=int, required=True, metavar="N")
    up.add_argument("--link", metavar="RATE", help="cap each node's link, e.g. 1gbit, 500mbit")
    up.add_argument(
        "--cpus-per-node",
        type=int,
        default=1,
        metavar="K",
        help="cores each node is pinned to (default 1: a distinct core per node, cycling)",
    )
    up.add_argument(
        "--mem-per-node",
        type=byte_size("a node's memory"),
        metavar="SIZE",
        help="cap each node's memory, e.g. 2G or 300M (K, M, G, T: powers of 1024): a memory "
        "cgroup holds all it runs, so the kernel kills what goes over; Slurm gets it as "
        "RealMemory",
    )
    up.add_argument("--slurm", action="store_true", help="slurmctld here, one slurmd per node")
    up.add_argument("--subnet", default=DEFAULT_SUBNET, metavar="CIDR")
    up.set_defaults(cluster_run=_up)
    commands.add_parser("status", help="the nodes and their daemons").set_defaults(
        cluster_run=_status
    )
    commands.add_parser("down", help="remove everything `up` created").set_defaults(
        cluster_run=_down
    )
    run = commands.add_parser(
        "exec",
        help="run a command on a node: ringtrain cluster exec node1 -- hostname",
        description="Run CMD inside NODE's namespaces, pinned to its cores.",
    )
    run.add_argument("node", metavar="NODE")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD")
    run.set_defaults(cluster_run=_exec)
    fault = commands.add_parser(
        "fault",
        help="rehearse a node fault: ringtrain cluster fault node2 power-off, then heal",
        description="partition: take the node's link down. power-off: the link down, then "
        "every process of the node killed. heal: the link up, sshd and slurmd restarted.",
    )
    fault.add_argument("node", metavar="NODE")
    fault.add_argument("fault", choices=faults.FAULTS)
    fault.set_defaults(cluster_run=_fault)


def run_cluster_command(args: argparse.Namespace) -> int:
    """Run the parsed sub-command."""
    return args.cluster_run(args)


def _up(args: argparse.Namespace) -> int:
    spec = control.up(
        args.nodes, args.subnet, args.link, args.cpus_per_node, args.slurm, args.mem_per_node
    )
    print(control.summary(spec), flush=True)
    return 0


def _status(args: argparse.Namespace) -> int:
    text, healthy = control.status()
    print(text)
    return 0 if healthy else EXIT_PROBLEMS


def _down(args: argparse.Namespace) -> int:
    removed = control.down()
    print("removed: " + "; ".join(removed) if removed else "no cluster was up; nothing to remove")
    return 0


def _fault(args: argparse.Namespace) -> int:
    print(faults.inject(args.node, args.fault), flush=True)
    return 0


def _exec(args: argparse.Namespace) -> int:
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    sys.stdout.flush()
    control.exec_on_node(args.node, command)
    return 0  # not reached: exec replaced this process
