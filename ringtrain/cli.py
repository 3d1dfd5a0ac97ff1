"""`ringtrain` command line: a thin layer over the Python API and the tools beside it."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from ringtrain.errors import (
    EXIT_CHECKPOINTED,
    EXIT_INTERRUPTED,
    EXIT_PROBLEMS,
    InternalError,
    UserError,
    alike_on_every_rank,
    report,
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


def _whole_number(text: str) -> int:
    """Any integer: ranges are checked by config.validate, so every rank says the same line."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    from ringtrain.config import (
        LOOPS,
        MODELS,
        MPI_PROGRESS,
        OPTIMIZERS,
        PARTITIONS,
        PROGRESS,
        SCHEDULE_KINDS,
        STRATEGIES,
    )

    # Choices are checked by config.validate, so every bad value gets the same one-line message.
    p.add_argument("--strategy", default="data", help=f"one of {', '.join(STRATEGIES)}")
    p.add_argument("--model", default="mlp", help=f"one of {', '.join(MODELS)}")
    p.add_argument("--dataset", default="digits", help="digits, synthetic or npz:PATH")
    p.add_argument("--batch-size", type=_whole_number, default=64, help="the global batch")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=_whole_number, help="default 15 when --steps is absent")
    length.add_argument("--steps", type=_whole_number, help="optimizer updates to run")
    p.add_argument("--optimizer", default="adam", help=f"one of {', '.join(OPTIMIZERS)}")
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--seed", type=_whole_number, default=0)
    p.add_argument("--loop", default="custom", help=f"one of {', '.join(LOOPS)}")
    p.add_argument(
        "--accumulate",
        type=_whole_number,
        default=1,
        help="split each rank's slice into K sequential parts (same update)",
    )
    p.add_argument("--fp16-allreduce", action="store_true", help="Horovod fp16 compression")
    p.add_argument(
        "--bucket-mb",
        type=float,
        help="allreduce gradients in buckets of this many MiB as the backward makes them "
        "(default: one fused allreduce after the backward)",
    )
    p.add_argument("--scale-lr", action="store_true", help="multiply --lr by the replica count")
    p.add_argument("--warmup-epochs", type=float, default=0.0, help="linear LR warm-up")
    p.add_argument("--clip-norm", type=float, help="clip by the global gradient norm")
    p.add_argument(
        "--schedule",
        default="1f1b",
        help=f"one of {', '.join(SCHEDULE_KINDS)}, or FILE.json as `ringtrain schedule --json` "
        "prints it",
    )
    p.add_argument(
        "--virtual-stages",
        type=_whole_number,
        default=1,
        help="stages per pipeline rank (--schedule interleaved); the model splits into P*V",
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="redo each stage's forward in its backward: less activation memory, more compute",
    )
    p.add_argument(
        "--microbatches",
        type=_whole_number,
        default=None,
        help="microbatches per replica batch (pipeline default 4, or a schedule file's)",
    )
    p.add_argument(
        "--partition",
        help=f"one of {', '.join(PARTITIONS)} (default: time where the model has more "
        "elements than stages, else uniform; a resumed run keeps its checkpoint's)",
    )
    p.add_argument("--pp-size", type=_whole_number, help="stages per pipeline (hybrid)")
    p.add_argument(
        "--comm-timeout",
        type=float,
        default=120.0,
        help="seconds a stage may stay silent before the job is aborted",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds start-up and the first step (graph tracing) may take; only a peer whose "
        "connection is torn down ends the job sooner, after --comm-timeout",
    )
    p.add_argument(
        "--min-link-rate",
        type=float,
        default=1.0,
        help="MB/s: a wait for B bytes lasts up to --comm-timeout + B at this rate",
    )
    p.add_argument(
        "--sync-sends",
        action="store_true",
        help="synchronous sends (Ssend): proves the schedule needs no MPI buffering",
    )
    p.add_argument(
        "--mpi-progress",
        default="auto",
        help=f"one of {', '.join(MPI_PROGRESS)}: a thread that keeps a stage's transfers "
        "moving while it computes (auto: when the pipeline spans hosts)",
    )
    p.add_argument("--checkpoint-dir", help="write checkpoints here (atomic, with a manifest)")
    p.add_argument(
        "--checkpoint-every",
        type=_whole_number,
        default=0,
        help="steps between checkpoints (default: only at a stop and at the end)",
    )
    p.add_argument("--keep", type=_whole_number, default=3, help="complete checkpoints kept")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint (none: start afresh)",
    )
    p.add_argument(
        "--stop-after",
        type=_whole_number,
        help="checkpoint and stop after step N (exit 75), --steps unchanged",
    )
    p.add_argument("--synthetic-size", type=_whole_number, default=2048)
    p.add_argument("--synthetic-shape", default="8,8,1", help="e.g. 32,32,3")
    p.add_argument("--metrics-out", help="rank 0 writes metrics JSON here")
    p.add_argument("--weights-out", help="rank 0 writes every trainable weight (.npz) here")
    p.add_argument("--trace", help="Chrome-trace JSON of the pipeline run")
    p.add_argument("--gantt", help="Gantt chart PNG of the measured pipeline run")
    p.add_argument(
        "--progress",
        default="auto",
        help=f"one of {', '.join(PROGRESS)}: per-epoch progress on rank 0 "
        "(auto: a live bar on a terminal, lines under a launcher or into a file)",
    )
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="rank 0 writes TensorBoard scalars here (view: tensorboard --logdir DIR)",
    )


def config_from_args(args: argparse.Namespace):
    from ringtrain.config import TrainConfig

    try:
        shape = tuple(int(d) for d in args.synthetic_shape.split(","))
    except ValueError:
        raise UserError(f"--synthetic-shape {args.synthetic_shape!r} is not like 32,32,3") from None
    return TrainConfig(
        strategy=args.strategy,
        model=args.model,
        dataset=args.dataset,
        batch_size=args.batch_size,
        epochs=15 if args.epochs is None and args.steps is None else args.epochs,
        steps=args.steps,
        optimizer=args.optimizer,
        lr=args.lr,
        seed=args.seed,
        loop=args.loop,
        accumulate=args.accumulate,
        fp16_allreduce=args.fp16_allreduce,
        bucket_mb=args.bucket_mb,
        scale_lr=args.scale_lr,
        warmup_epochs=args.warmup_epochs,
        clip_norm=args.clip_norm,
        schedule=args.schedule,
        microbatches=_microbatches(args),
        virtual_stages=args.virtual_stages,
        recompute=args.recompute,
        partition=args.partition,
        pp_size=args.pp_size,
        comm_timeout=args.comm_timeout,
        startup_timeout=args.startup_timeout,
        min_link_rate=args.min_link_rate,
        sync_sends=args.sync_sends,
        mpi_progress=args.mpi_progress,
        metrics_out=args.metrics_out,
        weights_out=args.weights_out,
        trace=args.trace,
        gantt=args.gantt,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep=args.keep,
        resume=args.resume,
        stop_after=args.stop_after,
        synthetic_size=args.synthetic_size,
        synthetic_shape=shape,
        progress=args.progress,
        tensorboard=args.tensorboard,
    )


def _microbatches(args: argparse.Namespace) -> int:
    """--microbatches; else a schedule file's own count (it fixes M); else 4 for a pipeline."""
    from ringtrain.config import is_schedule_file

    if args.microbatches is not None:
        return args.microbatches
    if args.strategy not in ("pipeline", "hybrid"):
        return 1
    if is_schedule_file(args.schedule):
        from ringtrain.pipeline.schedule import load_schedule_file

        return load_schedule_file(args.schedule).microbatches
    return 4


def run_train(args: argparse.Namespace) -> int:
    from ringtrain.config import validate_flags

    me = _who_am_i()
    with alike_on_every_rank(me.rank):  # flags first: cheap, before TensorFlow loads
        cfg = config_from_args(args)
        validate_flags(cfg, me.world_size)
    if me.source == "single" and shutil.which("mpirun") is None:
        # Without a launcher Open MPI starts a singleton, which still needs its runtime.
        raise UserError(
            "MPI not found: mpirun is not on PATH; install openmpi-bin or load your "
            "site's MPI module"
        )
    # Start-up: ranks reach this agreement as fast as ssh, Python and the libraries load them,
    # seconds apart on a loaded node, so it is bounded like the rest of start-up.
    wait_for = max(cfg.comm_timeout, cfg.startup_timeout)
    data = _agreed(lambda: _outputs_and_data(cfg), me, wait_for)
    from ringtrain.api import train  # TensorFlow loads here, once the inputs are known good
    from ringtrain.models import BUILTIN

    result = train(BUILTIN[cfg.model](data.input_shape, data.n_classes), data, cfg)
    if result.metrics.get("finished", True):
        return 0
    # Not finished: 75 means "checkpointed, resume me"; without a checkpoint it is a failure.
    return EXIT_CHECKPOINTED if cfg.checkpoint_dir else EXIT_PROBLEMS


def _outputs_and_data(cfg):
    """The output paths, then the dataset: what only each node's files can tell."""
    from ringtrain.config import check_paths
    from ringtrain.data import load_dataset

    check_paths(cfg)
    return load_dataset(cfg.dataset, cfg.seed, cfg.synthetic_size, cfg.synthetic_shape)


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

    parser = OneLineParser(prog=PROG, description="Distributed training of Keras models on MPI.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    commands = [
        (
            "train",
            "train a model with one strategy (single, data, model, pipeline, hybrid)",
            add_train_arguments,
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
            "benchmarks: pipeline, strategies, allreduce, dp, plan (JSON, PNG: benchmarks/results)",
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
    """The one place where errors become a line on stderr and an exit code (README table)."""
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
    elif me:
        # mpirun and srun --kill-on-bad-exit end the job at the first non-zero exit; a quiet
        # rank that left first would take rank 0's line with it. Rank 0's exit ends this wait.
        time.sleep(QUIET_RANK_GRACE_S)
    if not problem.together and _mpi_job_running():
        from ringtrain.guard import end_job

        end_job(problem.exit_code)
    return problem.exit_code


def _mpi_job_running() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    return bool(
        mpi and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1
    )


if __name__ == "__main__":
    sys.exit(main())
