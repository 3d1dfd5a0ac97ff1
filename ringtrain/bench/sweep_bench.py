"""`ringtrain bench sweep`: a study's trials packed into groups of one rank against the same
trials trained data parallel on all the ranks.

On 2 ranks, one `ringtrain sweep run` launch per contender runs the same 8 trials (8 learning
rates, queued in the study in one order before the launch, every other flag alike, no pruning):

- packed: `--group-size 1 --strategy single`, two groups each taking the next trial;
- wide: `--group-size 2 --strategy data`, one group of 2 ranks taking the trials in turn.

A launch is timed whole, from mpirun's start to its end (start-up included: a user pays it
too), and the study records each trial's own seconds. Contenders alternate round by round, in
the other order each round, for the built-in mlp (small: data parallelism scales poorly) and
CNN; each packed/wide ratio is taken against the wide launch of the same round and model.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import textwrap
import time
from pathlib import Path
from statistics import median

from ringtrain.bench.common import deadline, round_ratios, spread, summarise_contenders
from ringtrain.bounded import RunFailed, run_bounded
from ringtrain.launch.mpirun import binding_flags, mpi_env, mpirun_command
from ringtrain.sweep import ledger

RANKS, SEED, BATCH, OBJECTIVE, STUDY = 2, 0, 64, "loss", "bench"
LRS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15)  # one trial each
QUICK_TRIALS = 2  # one per packed group
QUICK_ROUNDS = 1  # read by bench/common: a quick run proves the launches, it measures nothing
MODELS = {  # name -> (its train flags, optimizer steps per trial, what it is)
    "mlp": (
        ["--model", "mlp", "--dataset", "digits"],
        1000,
        "the built-in mlp (Dense 128, 128, 64, 10) on the embedded 8x8 digits",
    ),
    "cnn": (
        ["--model", "cnn", "--dataset", "synthetic", "--synthetic-shape", "32,32,3"],
        100,
        "the built-in CNN (Conv2D 16, Conv2D 32 stride 2, Dense 64, 10) on synthetic 32x32x3",
    ),
}
QUICK_STEPS = 5
CONTENDERS = {  # name -> (ranks per group, the trials' strategy)
    "packed": (1, "single"),
    "wide": (RANKS, "data"),
}
BINDING = "core"
LAUNCH_SECONDS = 900  # one launch: start-up and every trial, on a loaded machine


def space_file(folder: Path, lrs: tuple[float, ...]) -> Path:
    """The search space: the listed learning rates, the only parameter."""
    path = folder / "space.json"
    path.write_text(json.dumps({"lr": {"type": "categorical", "choices": list(lrs)}}))
    return path


def queued_study(url: str, name: str, lrs: tuple[float, ...]) -> None:
    """The study made before the launch, its trials queued in order: every contender trains
    the same trials, whatever its sampler would have drawn."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=url, study_name=name, direction="minimize")
    for lr in lrs:
        study.enqueue_trial({"lr": lr})


def sweep_command(
    model: str, contender: str, space: Path, url: str, trials: int, steps: int, out: Path
) -> list[str]:
    """The contender's `mpirun ... ringtrain sweep run`: only the group size and the
    strategy within a group differ."""
    group_size, strategy = CONTENDERS[contender]
    sweep = ["sweep", "run", str(space), "--study", STUDY, "--storage", url]
    sweep += ["--trials", str(trials), "--objective", OBJECTIVE, "--direction", "minimize"]
    # The queued trials fix every parameter, so the sampler draws nothing: the cheapest one.
    sweep += ["--group-size", str(group_size), "--sampler", "random", "--pruner", "none"]
    sweep += ["--out", str(out)]
    train = [*MODELS[model][0], "--batch-size", str(BATCH), "--optimizer", "sgd"]
    train += ["--steps", str(steps)]
    train += ["--seed", str(SEED), "--strategy", strategy]
    return mpirun_command(RANKS, "ringtrain.cli", *sweep, *train, binding=BINDING)


def launch(
    model: str, contender: str, lrs: tuple[float, ...], steps: int, folder: Path, budget: float
) -> dict:
    """One sweep in a fresh folder and storage: its wall time and what the study recorded of
    each trial, in trial order."""
    import optuna

    folder.mkdir()
    url = f"sqlite:///{folder / 'study.db'}"
    queued_study(url, STUDY, lrs)
    command = sweep_command(
        model, contender, space_file(folder, lrs), url, len(lrs), steps, folder / "out"
    )
    load = os.getloadavg()[0]
    started = time.perf_counter()
    run_bounded(command, mpi_env(1), budget, folder / "launch.log", quiet=True)
    wall = time.perf_counter() - started
    trials = optuna.load_study(study_name=STUDY, storage=url).get_trials(deepcopy=False)
    unfinished = [t.number for t in trials if t.state.name != "COMPLETE"]
    if len(trials) != len(lrs) or unfinished:
        raise RunFailed(
            f"{model} {contender}: {len(trials)} trials, not complete: {unfinished} (see the "
            "launch's log)"
        )
    seconds = [t.user_attrs[ledger.SECONDS] for t in trials]
    busy: dict[int, float] = {}
    for t in trials:
        group = t.user_attrs[ledger.GROUP]
        busy[group] = busy.get(group, 0.0) + t.user_attrs[ledger.SECONDS]
    speeds = [
        json.loads((folder / "out" / f"trial-{t.number:05d}" / "metrics.json").read_text())[
            "samples_per_sec"
        ]
        for t in trials
    ]
    return {
        "group_size": CONTENDERS[contender][0],
        "trials": len(trials),
        "wall_seconds": wall,
        "trials_per_hour": len(trials) * 3600 / wall,
        "trial_lrs": [t.params["lr"] for t in trials],
        "trial_steps": [t.user_attrs[ledger.STEPS] for t in trials],
        "trial_groups": [t.user_attrs[ledger.GROUP] for t in trials],
        "trial_seconds": seconds,
        "trial_seconds_sum": sum(seconds),
        "trial_seconds_median": median(seconds),
        "group_busy_seconds": [busy[g] for g in sorted(busy)],
        "outside_trials_seconds": wall - max(busy.values()),
        "trial_samples_per_sec_median": median(speeds),
        "load_1min_before": load,
    }


def measure(args: argparse.Namespace) -> dict:
    """Every model's two launches, round after round, in the other order each round."""
    lrs = LRS[:QUICK_TRIALS] if args.quick else LRS
    steps = {m: QUICK_STEPS if args.quick else s for m, (_, s, _) in MODELS.items()}
    limit = time.monotonic() + deadline(args.quick)
    load_start = os.getloadavg()
    names = list(CONTENDERS)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for model in MODELS:
                for order, contender in enumerate(names[shift:] + names[:shift]):
                    budget = min(LAUNCH_SECONDS, max(1.0, limit - time.monotonic()))
                    folder = Path(tmp) / f"{round_index}-{model}-{contender}"
                    found = launch(model, contender, lrs, steps[model], folder, budget)
                    rows.append(
                        {
                            "round": round_index,
                            "model": model,
                            "contender": contender,
                            "order": order,
                            **found,
                        }
                    )
    return summarise(rows) | {
        "rounds": args.rounds,
        "ranks": RANKS,
        "global_batch": BATCH,
        "trial_lrs": list(lrs),
        "steps_per_trial": steps,
        "models": {m: what for m, (_, _, what) in MODELS.items()},
        "contenders": {
            name: {"group_size": size, "groups": RANKS // size, "strategy": strategy}
            for name, (size, strategy) in CONTENDERS.items()
        },
        "sweep_flags": "--objective loss --direction minimize --sampler random --pruner none "
        "--optimizer sgd; the trials queued in the study before the launch",
        "pinning": {
            "rule": f"both contenders alike: {RANKS} ranks, each bound to a core, one compute "
            "thread (RINGTRAIN_THREADS=1)",
            "mpirun_flags": binding_flags(BINDING),
        },
        "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
    }


def summarise(rows: list[dict]) -> dict:
    """Per model: each contender's trials per hour against that round's wide launch, its
    trials' seconds; the packed/wide ratio, and how much faster a trial ran on 2 ranks, whole
    and in its training steps alone (its fixed costs left out)."""
    summary, ratios = [], {}
    for model in MODELS:
        mine = [r for r in rows if r["model"] == model]
        entries = summarise_contenders(mine, "trials_per_hour", "wide", "vs_wide")
        for entry in entries:
            runs = [r for r in mine if r["contender"] == entry["contender"]]
            entry |= {
                "model": model,
                "group_size": runs[0]["group_size"],
                "wall_seconds_median": median(r["wall_seconds"] for r in runs),
                "trial_seconds_median": median(r["trial_seconds_median"] for r in runs),
                "outside_trials_seconds_median": median(r["outside_trials_seconds"] for r in runs),
                "trial_samples_per_sec_median": median(
                    r["trial_samples_per_sec_median"] for r in runs
                ),
            }
        summary += entries
        per_round = round_ratios(mine, "trials_per_hour", "packed", "wide")
        faster = round_ratios(mine, "trial_seconds_median", "packed", "wide")
        steps = round_ratios(mine, "trial_samples_per_sec_median", "wide", "packed")
        ratios[model] = {
            "packed_over_wide": {"per_round": per_round, **spread(per_round)},
            "wide_trial_speedup": {"per_round": faster, **spread(faster)},
            "wide_steps_speedup": {"per_round": steps, **spread(steps)},
            "packed_won_rounds": sum(r > 1 for r in per_round),
        }
    return {"raw": rows, "summary": summary, "ratios": ratios}


def describe(report: dict) -> list[str]:
    lines = []
    for e in report["summary"]:
        lines.append(
            f"{e['model']:>4} {e['contender']:>6}: {e['trials_per_hour_median']:7.0f} trials/h "
            f"({e['trials_per_hour_min']:.0f}-{e['trials_per_hour_max']:.0f}), a trial "
            f"{e['trial_seconds_median']:.1f} s, launch {e['wall_seconds_median']:.0f} s"
        )
    for model, r in report["ratios"].items():
        ratio, faster = r["packed_over_wide"], r["wide_trial_speedup"]
        lines.append(
            f"{model}: packed / wide {ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})"
            f", packed won {r['packed_won_rounds']} of {len(ratio['per_round'])} rounds; a trial "
            f"on {report['ranks']} ranks ran {faster['median']:.2f}x as fast as on one, its "
            f"steps {r['wide_steps_speedup']['median']:.2f}x"
        )
    start, end = report["load_average"]["start"][0], report["load_average"]["end"][0]
    lines.append(f"load average (1 min): {start:.1f} at the start, {end:.1f} at the end")
    return lines


def draw(report: dict, path: str) -> None:
    """Trials per hour per model and contender; the packed/wide ratio round by round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rates, rounds) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(report["contenders"])
    models = list(report["ratios"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        entries = [
            next(e for e in report["summary"] if (e["model"], e["contender"]) == (m, name))
            for m in models
        ]
        medians = [e["trials_per_hour_median"] for e in entries]
        spans = [
            [m - e["trials_per_hour_min"] for m, e in zip(medians, entries, strict=True)],
            [e["trials_per_hour_max"] - m for m, e in zip(medians, entries, strict=True)],
        ]
        size = report["contenders"][name]["group_size"]
        groups = report["ranks"] // size
        label = f"{name}: {groups} group{'s' * (groups > 1)} of {size} rank{'s' * (size > 1)}"
        places = [j + (i - (len(names) - 1) / 2) * width for j in range(len(models))]
        rates.bar(places, medians, width, yerr=spans, capsize=4, label=label)
    rates.set_xticks(range(len(models)), models)
    rates.set(ylabel="trials per hour (median, min-max)", title="trials per hour, 2 ranks")
    rates.legend(fontsize=8)
    for model in models:
        per_round = report["ratios"][model]["packed_over_wide"]["per_round"]
        rounds.plot(range(len(per_round)), per_round, "o-", label=model)
    rounds.axhline(1.0, color="grey", lw=0.8)
    rounds.set_xticks(range(report["rounds"]))
    rounds.set(xlabel="round", ylabel="packed / wide, trials per hour", title="ratio per round")
    rounds.legend(fontsize=8)
    title = f"{len(report['trial_lrs'])} sweep trials per launch: packed groups against one wide"
    fig.suptitle(textwrap.fill(title, 110), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
