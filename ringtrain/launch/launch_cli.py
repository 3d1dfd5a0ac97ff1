"""`ringtrain hostfile convert|check` and `ringtrain slurm render`, for the main CLI to mount.

Exit codes: 0 done; 1 `hostfile check` found problems (printed as `line K: ...` on stdout);
bad input raises UserError, which the main CLI reports as one line and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from ringtrain.errors import EXIT_PROBLEMS, UserError
from ringtrain.launch.hostfile import (
    TOOLS,
    expand_nodelist,
    expand_tasks_per_node,
    parse_hostfile,
    to_horovod,
    to_mpirun,
)
from ringtrain.launch.network import unresolved_hosts
from ringtrain.launch.slurm_render import STRATEGIES, node_range, render

_FORMATS: dict[str, Callable[[list[tuple[str, int]]], str]] = {
    "mpirun": to_mpirun,
    "horovod": lambda pairs: to_horovod(pairs) + "\n",
}


def add_hostfile_arguments(subparser: argparse.ArgumentParser) -> None:
    """Mount `convert` and `check` under the main CLI's `hostfile` parser; they inherit its
    parser class, so a bad flag costs one line there too."""
    commands = subparser.add_subparsers(
        dest="hostfile_command", required=True, metavar="{convert,check}"
    )
    convert = commands.add_parser(
        "convert",
        help="Slurm node list -> mpirun hostfile or horovodrun -H list",
        description="Print the hosts of a Slurm node list with their slot counts.",
    )
    convert.add_argument(
        "nodelist",
        nargs="?",
        metavar="NODELIST",
        help="e.g. node[01-04,07]; default $SLURM_JOB_NODELIST",
    )
    counts = convert.add_mutually_exclusive_group()
    counts.add_argument(
        "--tasks-per-node",
        metavar="SPEC",
        help="Slurm syntax, e.g. 4(x2),2; default $SLURM_TASKS_PER_NODE",
    )
    counts.add_argument("--slots", type=int, metavar="N", help="the same slot count everywhere")
    convert.add_argument(
        "--format",
        required=True,
        choices=sorted(_FORMATS),
        help="mpirun: 'host slots=N' lines; horovod: one host:N,host:N list",
    )
    convert.set_defaults(launch_run=_convert, prog=convert.prog)

    check = commands.add_parser(
        "check",
        help="find the lines mpirun or horovodrun would misread",
        description="Exit 0 if the tool reads the hostfile as written, else 1 with each problem.",
    )
    check.add_argument("file", metavar="FILE")
    check.add_argument(
        "--for",
        dest="for_tool",
        choices=TOOLS,
        default="mpirun",
        help="the tool that will read FILE (default mpirun)",
    )
    check.set_defaults(launch_run=_check, prog=check.prog)


def run_hostfile_command(args: argparse.Namespace) -> int:
    """Run the parsed `hostfile` sub-command and return its exit code."""
    return _run(args)


def add_slurm_arguments(subparser: argparse.ArgumentParser) -> None:
    """Mount `render` under the main CLI's `slurm` parser."""
    commands = subparser.add_subparsers(dest="slurm_command", required=True, metavar="{render}")
    parser = commands.add_parser(
        "render",
        help="write a batch script from slurm/<template>.sbatch",
        description="Print (or write) a checked Slurm batch script; arguments after -- go to "
        "`ringtrain train` (to `ringtrain sweep run` for --strategy sweep).",
    )
    parser.add_argument("--strategy", required=True, choices=STRATEGIES)
    parser.add_argument(
        "--nodes",
        required=True,
        type=node_range,
        metavar="N|MIN-MAX",
        help="a range lets a requeued job start on the nodes that are left",
    )
    parser.add_argument("--ntasks-per-node", required=True, type=int, metavar="K")
    parser.add_argument(
        "--time", required=True, metavar="HH:MM:SS", help="or MM, MM:SS, D-HH, D-HH:MM, D-HH:MM:SS"
    )
    parser.add_argument("--pp-size", type=int, metavar="P", help="stages per replica (hybrid)")
    parser.add_argument("--job-name", metavar="NAME")
    parser.add_argument("--output", metavar="FILE", help="write here instead of stdout")
    parser.add_argument(
        "train_args",
        nargs="*",
        metavar="-- TRAIN_ARGS",
        help="default arguments of `ringtrain train` (of `ringtrain sweep run`) in the script",
    )
    parser.set_defaults(launch_run=_render, prog=parser.prog)


def run_slurm_command(args: argparse.Namespace) -> int:
    """Run the parsed `slurm` sub-command and return its exit code."""
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return args.launch_run(args)
    except OSError as problem:
        raise UserError(f"{problem.filename}: {problem.strerror}") from None
    except ValueError as problem:  # the parsers say what is wrong
        raise UserError(str(problem)) from None


def _convert(args: argparse.Namespace) -> int:
    hosts = expand_nodelist(_given_or_env(args.nodelist, "SLURM_JOB_NODELIST", "NODELIST"))
    if args.slots is not None:
        slots = [args.slots] * len(hosts)
    else:
        spec = _given_or_env(args.tasks_per_node, "SLURM_TASKS_PER_NODE", "--tasks-per-node")
        slots = expand_tasks_per_node(spec, len(hosts))
    sys.stdout.write(_FORMATS[args.format](list(zip(hosts, slots, strict=True))))
    return 0


def _given_or_env(value: str | None, variable: str, option: str) -> str:
    if value is not None:
        return value
    if variable not in os.environ:
        raise ValueError(f"give {option}, or run inside a Slurm job that sets ${variable}")
    return os.environ[variable]


def _check(args: argparse.Namespace) -> int:
    hosts, problems = parse_hostfile(Path(args.file).read_text(), args.for_tool)
    problems += unresolved_hosts([host for host, _ in hosts])  # a launcher cannot reach these
    if problems:
        print("\n".join(problems))
        return EXIT_PROBLEMS  # like a linter: the check ran and found problems
    print(f"ok: {len(hosts)} hosts, {sum(slots for _, slots in hosts)} slots")
    return 0


def _render(args: argparse.Namespace) -> int:
    script = render(
        args.strategy,
        args.nodes,
        args.ntasks_per_node,
        args.time,
        pp_size=args.pp_size,
        job_name=args.job_name,
        train_args=args.train_args,
        network=os.environ.get("RINGTRAIN_NETWORK") or None,
    )
    if args.output is None:
        sys.stdout.write(script)
        return 0
    Path(args.output).write_text(script)
    print(f"wrote {args.output}; submit it with: sbatch {shlex.quote(args.output)}")
    return 0
