"""`ringtrain sweep run` and `ringtrain sweep status`: hyperparameter search with Optuna, its
trials packed into groups of ranks inside one launch (see run.py)."""

from __future__ import annotations

import argparse

from ringtrain.config import positive_whole_number

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "halving", "none")
DIRECTIONS = ("minimize", "maximize")


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    run = sub.add_parser(
        "run",
        prog="ringtrain sweep run",
        allow_abbrev=False,  # a train flag passed on must never read as one of these
        help="run a study's trials, packed in groups of ranks; every other flag is train's",
        description="Run an Optuna study's trials, --group-size ranks per trial, every group "
        "taking the next trial as soon as its last ends. The flags after these are "
        "`ringtrain train`'s, shared by every trial.",
    )
    run.add_argument("space", metavar="SPACE", help="the search space, a YAML or JSON file")
    _study_arguments(run)
    run.add_argument(
        "--trials",
        type=positive_whole_number,
        required=True,
        help="the study's total: a study continued runs only the remainder",
    )
    run.add_argument(
        "--objective",
        required=True,
        help="loss (the final training loss) or val_METRIC, a held-out metric such as val_accuracy",
    )
    run.add_argument("--direction", choices=DIRECTIONS, required=True)
    run.add_argument(
        "--group-size",
        type=positive_whole_number,
        default=1,
        help="ranks per trial (data parallel, or a pipeline, within the group)",
    )
    run.add_argument("--sampler", choices=SAMPLERS, default="tpe")
    run.add_argument(
        "--pruner",
        choices=PRUNERS,
        default="median",
        help="stops a trial whose per-epoch objective trails the others'",
    )
    run.add_argument(
        "--startup-trials",
        type=positive_whole_number,
        default=5,
        help="finished trials before TPE models the space and the median pruner judges",
    )
    run.add_argument(
        "--out",
        metavar="DIR",
        help="each trial's folder, DIR/trial-NNNNN: weights.npz, metrics.json, "
        "checkpoints (default: sweeps/STUDY)",
    )
    run.add_argument(
        "--trial-heartbeat",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how often a running trial says it is alive; one silent for three "
        "beats is failed and retried by the next launch that asks",
    )
    run.set_defaults(passes_on="train_argv", train_argv=[], prog=run.prog)
    status = sub.add_parser(
        "status",
        prog="ringtrain sweep status",
        help="a study's trials, sorted by the objective; the best trial's train line",
    )
    status.add_argument("study_name", metavar="STUDY")
    status.add_argument("--storage", required=True, metavar="URL")
    status.add_argument("--json", action="store_true", help="the table as JSON on stdout")
    status.add_argument(
        "--plots",
        metavar="DIR",
        help="write history.png and importances.png here (default: beside a file storage)",
    )
    status.set_defaults(prog=status.prog)


def _study_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--study",
        required=True,
        metavar="NAME",
        help="the study's name: started again, a sweep continues it",
    )
    p.add_argument(
        "--storage",
        required=True,
        metavar="URL",
        help="sqlite:///PATH (one host), journal:PATH (a shared path, several "
        "nodes) or a database URL (postgresql://...)",
    )


def run_sweep_command(args: argparse.Namespace) -> int:
    if args.action == "run":
        from ringtrain.sweep.run import run_sweep

        return run_sweep(args)
    from ringtrain.sweep.status import run_status

    return run_status(args)
