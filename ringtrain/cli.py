"""`ringtrain` command line: a thin layer over the Python API and the tools beside it."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ringtrain.errors import (
    EXIT_INTERRUPTED,
    InternalError,
    UserError,
    report,
)
from ringtrain.one_line import OneLineParser, bad_argv, rank_or_none
from ringtrain.train_command import add_train_command_arguments, run_train

PROG = "ringtrain"
QUIET_RANK_GRACE_S = 10  # ample for rank 0 to print its line, even on a loaded node


def run_doctor(args: argparse.Namespace) -> int:
    from ringtrain.doctor import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    from ringtrain.bench import common as bench
    from ringtrain.cluster import cli as cluster_cli
    from ringtrain.doctor import add_doctor_arguments
    from ringtrain.launch import launch_cli
    from ringtrain.pipeline import schedule_cli
    from ringtrain.plan import cli as plan_cli
    from ringtrain.sweep import cli as sweep_cli
    from ringtrain.synthetic_files import add_data_arguments, run_data_command

    parser = OneLineParser(prog=PROG, description="Distributed training of Keras models on MPI.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    commands = [
        (
            "train",
            "train a model with one strategy (single, data, model, pipeline, hybrid)",
            add_train_command_arguments,
            run_train,
        ),
        (
            "schedule",
            "print, check or draw a pipeline schedule (GPipe, 1F1B, interleaved, ZB-H1, a file)",
            schedule_cli.add_schedule_arguments,
            schedule_cli.run_schedule_command,
        ),
        (
            "doctor",
            "check the MPI/Horovod/TensorFlow stack and a 2-rank allreduce (--hosts: across hosts)",
            add_doctor_arguments,
            run_doctor,
        ),
        (
            "hostfile",
            "check or convert hostfiles and Slurm nodelists",
            launch_cli.add_hostfile_arguments,
            launch_cli.run_hostfile_command,
        ),
        (
            "slurm",
            "render a Slurm batch script from the templates in slurm/",
            launch_cli.add_slurm_arguments,
            launch_cli.run_slurm_command,
        ),
        (
            "bench",
            "benchmarks: pipeline, pipeline-sizes, strategies, allreduce, dp, plan, zoo, input, "
            "shard-optimizer, sweep, too-big (JSON, PNG: benchmarks/results)",
            bench.add_bench_arguments,
            bench.run_bench_command,
        ),
        (
            "plan",
            "rank strategies and grids by predicted step time and memory (calibrate: measure)",
            plan_cli.add_plan_arguments,
            plan_cli.run_plan_command,
        ),
        (
            "data",
            "make data here for tests and benchmarks: make-synthetic (TFRecord or .npy shards)",
            add_data_arguments,
            run_data_command,
        ),
        (
            "sweep",
            "hyperparameter sweeps with Optuna: trials packed in groups of ranks (run, status)",
            sweep_cli.add_sweep_arguments,
            sweep_cli.run_sweep_command,
        ),
        (
            "cluster",
            "a rehearsal cluster of namespaces on this machine (root): up, status, down, exec",
            cluster_cli.add_cluster_arguments,
            cluster_cli.run_cluster_command,
        ),
    ]
    for name, purpose, add_arguments, run in commands:
        p = sub.add_parser(name, help=purpose, description=purpose, prog=f"{PROG} {name}")
        add_arguments(p)
        p.set_defaults(run=run, prog=p.prog)  # a nested subcommand sets its own prog
    return parser


def main(argv: list[str] | None = None) -> int:
    """The one place where errors become a line on stderr and an exit code (see
    docs/reference/exit-codes.md)."""
    prog = PROG
    try:
        args, extra = build_parser().parse_known_args(argv)
        prog = getattr(args, "prog", PROG)
        if extra and getattr(args, "passes_on", None):  # a command that hands flags on
            setattr(args, args.passes_on, extra)
        elif extra:  # said by the subcommand, not by the top-level parser
            raise bad_argv(f"unrecognized arguments: {' '.join(extra)}", prog)
        return args.run(args)
    except UserError as exc:
        problem = exc
    except KeyboardInterrupt:
        problem = UserError("interrupted")
        problem.exit_code = EXIT_INTERRUPTED
    except Exception as exc:
        if os.environ.get("RINGTRAIN_TRACEBACK"):
            raise
        problem = InternalError.from_exception(exc)
    return _fail(problem.prog or prog, problem)


def _fail(prog: str, problem: UserError) -> int:
    """Say the problem unless another rank does; a problem this rank may be alone with ends
    the whole job once MPI runs, so no other rank waits for this one."""
    me = rank_or_none()
    if not problem.said_elsewhere:
        report(prog, str(problem), me)
    # mpirun and srun --kill-on-bad-exit end the job at the first non-zero exit; a quiet rank
    # that left first would take rank 0's line with it. Ranks that stop together and share MPI
    # leave once all have arrived (and said their lines); before MPI, rank 0's exit ends the wait.
    if problem.together and _mpi_job_running():
        _meet_every_rank(QUIET_RANK_GRACE_S)
    elif problem.said_elsewhere and me:
        time.sleep(QUIET_RANK_GRACE_S)
    if not problem.together and _mpi_job_running():
        from ringtrain.guard import end_job

        end_job(problem.exit_code)
    return problem.exit_code


def _meet_every_rank(timeout: float) -> None:
    """A barrier that gives up after `timeout` seconds rather than hang a failing job."""
    from mpi4py import MPI

    arrived, deadline = MPI.COMM_WORLD.Ibarrier(), time.monotonic() + timeout
    while not arrived.Test() and time.monotonic() < deadline:
        time.sleep(0.01)


def _mpi_job_running() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    return bool(
        mpi and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1
    )


if __name__ == "__main__":
    sys.exit(main())
