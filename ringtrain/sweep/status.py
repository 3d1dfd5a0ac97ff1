"""`ringtrain sweep status`: a study read back from its storage, for a person or a script.

The table lists the trials best first: the complete ones by their final objective, then the
pruned ones by the last value they reported (a value from before the end, so never ranked
above a finished trial), then the rest by number. With `--json` the same goes to stdout as one
object:

    {"study": NAME, "direction": "minimize" | "maximize", "objective": "loss" | "val_METRIC",
     "trials": [{"number", "state", "value", "params": {NAME: VALUE}, "steps", "seconds",
                 "group", "reason", "retry_of"}, ...],   # the table's order; null when unknown
     "best": {"number", "value", "params", "ranks", "train"} | null,   # best complete trial
     "plots": {"history": PATH | null, "importances": PATH | null, "skipped": [WHY, ...]}}

`train` is the `ringtrain train` line that trains the best trial alone: the sweep's shared
flags, then the trial's parameters as flags; `ranks` is how many ranks it ran on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex

import optuna
from optuna.trial import FrozenTrial, TrialState

from ringtrain.errors import UserError
from ringtrain.sweep import ledger
from ringtrain.sweep.flags import WITH_CHECKPOINTS, without
from ringtrain.sweep.space import Param, parse_space
from ringtrain.sweep.storage import (
    OBJECTIVE_ATTR,
    SPACE_ATTR,
    TRAIN_ARGV_ATTR,
    StorageURL,
    load_study,
    parse_storage,
)

PLOT_DPI = 120


def run_status(args: argparse.Namespace) -> int:
    """Read the study only: a status asked while a sweep runs changes nothing of it."""
    storage = parse_storage(args.storage)
    study = load_study(storage, args.study_name)
    if SPACE_ATTR not in study.user_attrs:
        raise UserError(f"study {args.study_name!r} was not made by `ringtrain sweep run`")
    space = parse_space(json.loads(study.user_attrs[SPACE_ATTR]), f"study {args.study_name}")
    objective = study.user_attrs[OBJECTIVE_ATTR]
    trials = sorted_trials(study)
    best = next((t for t in trials if t.state == TrialState.COMPLETE), None)
    shared = list(study.user_attrs[TRAIN_ARGV_ATTR])
    report = {
        "study": study.study_name,
        "direction": study.direction.name.lower(),
        "objective": objective,
        "trials": [_row(t) for t in trials],
        "best": None if best is None else _best_record(best, space, shared),
        "plots": write_plots(study, objective, args.plots or _default_plot_folder(storage)),
    }
    print(json.dumps(report, indent=2) if args.json else _text(report, [p.name for p in space]))
    return 0


def sorted_trials(study: optuna.Study) -> list[FrozenTrial]:
    """Best first: complete, then pruned (by value, as the study's direction ranks it), then
    the trials without a value, by number."""
    sign = -1.0 if study.direction == optuna.study.StudyDirection.MAXIMIZE else 1.0

    def key(t: FrozenTrial) -> tuple:
        if t.value is None:
            return (2, 0.0, t.number)
        return (0 if t.state == TrialState.COMPLETE else 1, sign * t.value, t.number)

    return sorted(study.get_trials(deepcopy=False), key=key)


def retrain_argv(
    trial: FrozenTrial, space: list[Param], shared: list[str], ranks: int | None
) -> list[str]:
    """The command that trains `trial` alone, as the sweep trained it: on as many ranks (a
    trial's parameter flags come after the shared ones there too, so they win the same way).
    Checkpoint settings go: the sweep gave them a folder per trial, which this run has not."""
    flags = [flag for p in space for flag in p.flags(trial.params[p.name])]
    launch = ["mpirun", "-np", str(ranks)] if ranks and ranks > 1 else []
    return [*launch, "ringtrain", "train", *without(shared, WITH_CHECKPOINTS), *flags]


def _best_record(trial: FrozenTrial, space: list[Param], shared: list[str]) -> dict:
    ranks = trial.user_attrs.get(ledger.RANKS)
    return {
        "number": trial.number,
        "value": trial.value,
        "params": dict(trial.params),
        "ranks": len(ranks) if ranks else None,
        "train": shlex.join(retrain_argv(trial, space, shared, len(ranks) if ranks else None)),
    }


def _row(trial: FrozenTrial) -> dict:
    attrs = trial.user_attrs
    return {
        "number": trial.number,
        "state": trial.state.name.lower(),
        "value": trial.value,
        "params": dict(trial.params),
        "steps": attrs.get(ledger.STEPS),
        "seconds": attrs.get(ledger.SECONDS),
        "group": attrs.get(ledger.GROUP),
        "reason": attrs.get(ledger.REASON),
        "retry_of": attrs.get(ledger.RETRY_OF),
    }


def _text(report: dict, names: list[str]) -> str:
    """The report as an aligned table, then the best trial's line and where the plots went."""
    head = ["#", "state", report["objective"], *names, "steps", "time s", "group", "note"]
    rows = [head] + [_cells(row, names) for row in report["trials"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(map(str.ljust, row, widths)).rstrip() for row in rows]
    best = report["best"]
    if best is None:
        lines.append("no complete trial yet, so no best trial to train")
    else:
        said = f"{report['objective']} {_shown(best['value'])}"
        lines.append(f"best: trial {best['number']}, {said}; to train it alone:")
        lines.append(f"  {best['train']}")
    plots = report["plots"]
    written = [plots[kind] for kind in ("history", "importances") if plots[kind]]
    if written:
        lines.append(f"plots: {', '.join(written)}")
    return "\n".join(lines + [f"no plot: {why}" for why in plots["skipped"]])


def _cells(row: dict, names: list[str]) -> list[str]:
    notes = [] if row["retry_of"] is None else [f"retry of {row['retry_of']}"]
    if row["state"] == "fail" and row["reason"]:
        notes.append(row["reason"])
    return [
        str(row["number"]),
        row["state"],
        _shown(row["value"]),
        *(_shown(row["params"].get(name)) for name in names),
        _shown(row["steps"]),
        "-" if row["seconds"] is None else f"{row['seconds']:.1f}",
        _shown(row["group"]),
        "; ".join(notes),
    ]


def _shown(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}"
    return str(value)


def _default_plot_folder(storage: StorageURL) -> str:
    """Beside a file storage, where the study already is; a server's study has no folder."""
    return os.path.dirname(os.path.abspath(storage.path)) if storage.path else os.getcwd()


def write_plots(study: optuna.Study, objective: str, folder: str) -> dict:
    """history.png and importances.png in `folder`, Optuna's matplotlib plots; a plot the study
    cannot make yet is skipped, and why is said instead."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    written = {"history": None, "importances": None, "skipped": []}
    if not done:
        written["skipped"].append("no complete trial yet")
        return written
    varying = sum(len({json.dumps(t.params.get(n)) for t in done}) > 1 for n in done[0].params)
    try:
        os.makedirs(folder, exist_ok=True)
        written["history"] = _save_plot("history", study, objective, folder)
        if len(done) >= 2 and varying >= 2:
            written["importances"] = _save_plot("importances", study, objective, folder)
        else:
            written["skipped"].append(
                "importances need 2 complete trials and 2 parameters that vary among them "
                f"(the study has {len(done)} and {varying})"
            )
    except OSError as exc:
        raise UserError(f"--plots {folder}: {exc.strerror or exc}") from None
    return written


def _save_plot(kind: str, study: optuna.Study, objective: str, folder: str) -> str:
    """One plot, drawn off-screen (Agg: a cluster's login node has no display)."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    with warnings.catch_warnings():  # Optuna marks these plots experimental, at every call
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if kind == "history":
            ax = plots.plot_optimization_history(study, target_name=objective)
        else:
            evaluator = optuna.importance.FanovaImportanceEvaluator(seed=0)  # the same bars
            ax = plots.plot_param_importances(study, evaluator=evaluator, target_name=objective)
    path = os.path.join(folder, f"{kind}.png")
    ax.figure.savefig(path, dpi=PLOT_DPI, bbox_inches="tight")
    plt.close(ax.figure)
    return path
