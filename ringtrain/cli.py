"""`ringtrain` command line: a thin layer over the Python API and the tools beside it."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from ringtrain.config import (
    CLI_EPOCHS,
    PIPELINE_MICROBATCHES,
    TrainConfig,
    add_train_arguments,
    check_paths,
    is_model_function,
    is_schedule_file,
    options,
    shape_from_text,
    uses_horovod,
)
from ringtrain.errors import (
    EXIT_CHECKPOINTED,
    EXIT_INTERRUPTED,
    EXIT_PROBLEMS,
    InternalError,
    UserError,
    alike_on_every_rank,
    report,
)
from ringtrain.keras_model.source import (
    add_file_arguments,
    add_source_arguments,
    build_user_model,
    check_file_flags,
    check_source_flags,
    load_user_data,
)

PROG = "ringtrain"
QUIET_RANK_GRACE_S = 10  # ample for rank 0 to print its line, even on a loaded node


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is a UserError, which main() turns into one line."""

    def error(self, message: str):
        raise _bad_argv(message, self.prog)


def _bad_argv(message: str, prog: str) -> UserError:
    """Every rank has the same argv and finds the same fault: rank 0 speaks for the job."""
    problem = UserError(message).on_every_rank(_rank_or_none() or 0)
    problem.prog = prog
    return problem


def _who_am_i():
    from ringtrain.launch.env import who_am_i

    try:
        return who_am_i()
    except ValueError as exc:  # launcher variables that contradict each other
        raise UserError(str(exc)) from None


def _rank_or_none() -> int | None:
    try:
        return _who_am_i().rank
    except UserError:
        return None


USER_MODEL_REFUSES = ("optimizer", "lr", "clip_norm", "loop")


def add_train_command_arguments(p: argparse.ArgumentParser) -> None:
    """train's flags, and the ones that name a user's own model and data."""
    add_train_arguments(p)
    # Absent unless typed, so a compiled model can refuse them even at their default value.
    p.set_defaults(**dict.fromkeys(USER_MODEL_REFUSES))
    add_source_arguments(p)
    add_file_arguments(p)


def typed_flags(args: argparse.Namespace) -> set[str]:
    """The refusable flags given on the command line (the others default on the parser)."""
    return {name for name in USER_MODEL_REFUSES if getattr(args, name) is not None}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {}
    for o in options():
        given = getattr(args, o.name)
        if given is None and o.name in USER_MODEL_REFUSES:
            given = o.default
        values[o.name] = shape_from_text(o.option, given) if o.kind is tuple else given
    if values["epochs"] is None and values["steps"] is None:
        values["epochs"] = CLI_EPOCHS
    if values["microbatches"] is None:
        values["microbatches"] = _microbatches(values["strategy"], values["schedule"])
    return TrainConfig(**values)


def _microbatches(strategy: str, schedule: str) -> int:
    """A schedule file's own count (it fixes M); else the pipeline default; else one."""
    if strategy not in ("pipeline", "hybrid"):
        return TrainConfig.microbatches
    if is_schedule_file(schedule):
        from ringtrain.pipeline.schedule import load_schedule_file

        return load_schedule_file(schedule).microbatches
    return PIPELINE_MICROBATCHES


def run_train(args: argparse.Namespace) -> int:
    """Every check that needs no model runs before TensorFlow loads (5 s of CPU per rank)."""
    from ringtrain.validation import validate_flags

    me = _who_am_i()
    with alike_on_every_rank(me.rank):  # flags first: the same verdict on every rank
        cfg = config_from_args(args)
        validate_flags(cfg, me.world_size, typed_flags(args))
        _check_user_flags(args, cfg)
    if me.source == "single" and shutil.which("mpirun") is None:
        # Without a launcher Open MPI starts a singleton, which still needs its runtime.
        raise UserError(
            "MPI not found: mpirun is not on PATH; install openmpi-bin or load your "
            "site's MPI module"
        )
    # Start-up: ranks reach this agreement as fast as ssh, Python and the libraries load them,
    # seconds apart on a loaded node, so it is bounded like the rest of start-up.
    wait_for = max(cfg.comm_timeout, cfg.startup_timeout)
    if is_model_function(cfg.model):
        return _finished(cfg, _train_user_model(args, cfg, me, wait_for))
    data = _agreed(lambda: _outputs_and_data(cfg), me, wait_for)
    from ringtrain import runtime
    from ringtrain.api import train  # TensorFlow loads here, once the inputs are known good
    from ringtrain.models import builtin

    runtime.init(uses_horovod(cfg))  # before the first TensorFlow op: pools are set once
    with alike_on_every_rank(me.rank):
        model = builtin(cfg, data.input_shape, data.n_classes)
    return _finished(cfg, train(model, data, cfg))


def _check_user_flags(args: argparse.Namespace, cfg: TrainConfig) -> None:
    check_source_flags(cfg.model, args.model_arg, args.data, cfg.dataset)
    check_file_flags(args, cfg.dataset)


def _train_user_model(args: argparse.Namespace, cfg: TrainConfig, me, wait_for: float):
    """Load the user's data on every rank (agreed), then build their model after seeding."""
    from ringtrain import runtime

    if args.data or args.validation_data:  # a user's function may run TensorFlow ops first
        runtime.init(uses_horovod(cfg))
    data = _agreed(
        lambda: load_user_data(
            args.data, cfg, args.data_files, args.validation_files, args.validation_data
        ),
        me,
        wait_for,
    )
    from ringtrain.api import train

    runtime.init(uses_horovod(cfg))  # before the user's model runs a TensorFlow op
    with alike_on_every_rank(me.rank):  # the same files on every node: the same verdict
        model = build_user_model(cfg.model, args.model_arg, cfg.seed)
    return train(model, data, cfg, typed_flags(args))


def _finished(cfg: TrainConfig, result) -> int:
    if result.metrics.get("finished", True):
        return 0
    # Not finished: 75 means "checkpointed, resume me"; without a checkpoint it is a failure.
    return EXIT_CHECKPOINTED if cfg.checkpoint_dir else EXIT_PROBLEMS


def _outputs_and_data(cfg: TrainConfig):
    """The output paths, the dataset and the checkpoint to resume: what only each node's files
    can tell."""
    from ringtrain.checkpoint import check_resumable
    from ringtrain.data import load_dataset, step_plan

    check_paths(cfg)
    data = load_dataset(cfg.dataset, cfg.seed, cfg.synthetic_size, cfg.synthetic_shape)
    step_plan(len(data.x), cfg.batch_size, cfg.epochs, cfg.steps)
    if cfg.resume:
        check_resumable(cfg)
    return data


def _agreed(attempt, me, timeout: float):
    """What only files can tell (an output folder, a dataset missing or bad on some node) is
    agreed on by every rank before training, so the job stops whole and says it once."""
    if me.world_size == 1:
        return attempt()
    from ringtrain import runtime
    from ringtrain.comm import Link
    from ringtrain.guard import agree

    comm = runtime.start_mpi(me.local_size)
    return agree(comm, Link(comm, timeout).wait, attempt)


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
            "benchmarks: pipeline, pipeline-sizes, strategies, allreduce, dp, plan, zoo, input "
            "(JSON, PNG: benchmarks/results)",
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
        if extra:  # said by the subcommand, not by the top-level parser
            raise _bad_argv(f"unrecognized arguments: {' '.join(extra)}", prog)
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
    me = _rank_or_none()
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
