"""`ringtrain bench zoo`: a user's own Keras models under ringtrain, against its built-in ones
and against one process.

Two questions, in one run of 2 long-lived mpirun ranks (1 intra-op and 1 inter-op thread
each, unbound, every rank's Cpus_allowed_list recorded), contenders alternating round by round
as in `bench strategies`, on its synthetic data, global batch and SGD(0.01):

- no penalty for bringing your own: the built-in `cnn` under data parallelism against the same
  layers written as a user's functional keras.Model, run by the engine `ringtrain.fit` uses;
- the zoo: keras.applications.ResNet50 under data parallelism and under an interleaved
  pipeline of 4 stages (2 per rank), against rank 0 alone; then, after the timed rounds, how
  far S steps of each land from one-process Keras `model.fit` from the same initial weights.
"""

from __future__ import annotations

import argparse
import tempfile
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ringtrain.bench.common import (
    UNBOUND,
    Process,
    deadline,
    pinning,
    round_ratios,
    spread,
    summarise_contenders,
)
from ringtrain.bench.strategies import BATCH, LR, SHAPE
from ringtrain.bounded import end_session
from ringtrain.launch.mpirun import mpi_env, mpirun_command

if TYPE_CHECKING:
    import keras

CNN_BUILTIN, CNN_KERAS = "built-in cnn, data", "your keras.Model cnn, data"
RESNET_SINGLE, RESNET_DATA = "ResNet50 single", "ResNet50 data"
MICROBATCHES, VIRTUAL_STAGES = 4, 2  # 2 ranks x 2 stages each: 4 stages
RESNET_PIPELINE = f"ResNet50 pipeline interleaved 4 stages M={MICROBATCHES}"
GROUPS = {  # reference contender -> the contenders compared with it, round by round
    CNN_BUILTIN: [CNN_BUILTIN, CNN_KERAS],
    RESNET_SINGLE: [RESNET_SINGLE, RESNET_DATA, RESNET_PIPELINE],
}
# Also compared with one-process model.fit after S steps: the CNN, which has no
# BatchNormalization, shows what is left of the ResNet50s' gaps without it.
COMPARED = [CNN_KERAS, RESNET_SINGLE, RESNET_DATA, RESNET_PIPELINE]
# Batch-statistics shares per global batch: the replicas, or the microbatches. Compared also
# with fit on batches of B/K accumulated over K (gradient_accumulation_steps), which normalises
# as the contender does; what is left of the gap is then not BatchNormalization's.
SHARES = {RESNET_DATA: 2, RESNET_PIPELINE: MICROBATCHES}
WEIGHTS = "weights: "  # the worker's name for S steps from the initial weights, then compared
TARGETS = {"your_keras_model_at_least_0.95_of_builtin": (f"{CNN_KERAS} / {CNN_BUILTIN}", 0.95)}
NOTES = {
    CNN_BUILTIN: "ringtrain.models.cnn (a keras.Sequential) compiled with --optimizer sgd, in "
    "DataParallelEngine, as `ringtrain train --model cnn` runs it",
    CNN_KERAS: "the same layers as a functional keras.Model compiled with SGD(0.01) and "
    "SparseCategoricalCrossentropy(from_logits=True), in DataParallelEngine, as "
    "ringtrain.fit runs it",
    RESNET_SINGLE: "DataParallelEngine in rank 0 alone (COMM_SELF), no Horovod",
    RESNET_DATA: "DataParallelEngine on 2 ranks, a Horovod allreduce per step",
    RESNET_PIPELINE: f"PipelineEngine on the model's graph, schedule interleaved, "
    f"{VIRTUAL_STAGES} stages per rank, {MICROBATCHES} microbatches, time partition",
}


QUICK_BATCH = 16  # 2 replicas of 8, 4 microbatches of 4; the full run's is BATCH


def steps_for(quick: bool) -> dict[str, int]:
    """Steps per turn for each model, and S, the steps compared with model.fit. A quick run
    proves that the bench runs end to end and fills its report, not how fast anything is: one
    timed ResNet50 step per turn, on global batches of QUICK_BATCH."""
    if quick:
        return {"cnn": 10, "resnet": 1, "compared": 3}
    return {"cnn": 200, "resnet": 20, "compared": 5}


# ---- the models (these import TensorFlow: call them in the ranks) -------------------------


def functional_cnn(input_shape: tuple[int, ...], n_classes: int) -> keras.Model:
    """ringtrain.models.cnn's layers as a user would write them, compiled as a user would."""
    from ringtrain.tensorflow_loader import tf  # noqa: F401  (before Keras)

    # isort: split
    import keras

    inputs = keras.Input(input_shape)
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(n_classes)(x), name="user_cnn")
    model.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def resnet50(n_classes: int) -> keras.Model:
    """keras.applications' ResNet50, untrained; its head ends in a softmax
    (classifier_activation's default), so the loss takes probabilities, not logits."""
    from ringtrain.tensorflow_loader import tf  # noqa: F401  (before Keras)

    # isort: split
    import keras

    model = keras.applications.ResNet50(weights=None, input_shape=SHAPE, classes=n_classes)
    model.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=False),
    )
    return model


# ---- the parent ---------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict:
    """Start the ranks once, alternate the contenders round by round, then compare weights."""
    steps, batch = steps_for(args.quick), QUICK_BATCH if args.quick else BATCH
    started = time.monotonic()
    limit, ready_by = started + deadline(args.quick), started + deadline(args.quick) / 2
    rows: list[dict] = []
    distances: dict[str, dict] = {}
    per_share: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        command = mpirun_command(2, "ringtrain.bench.zoo_worker", str(batch), binding=UNBOUND)
        ranks = Process("zoo ranks", command, mpi_env(1), Path(tmp))
        try:
            ready = ranks.receive(ready_by)
            for round_index in range(args.rounds):
                for contender in (c for group in GROUPS.values() for c in group):
                    n = steps["resnet" if contender.startswith("ResNet") else "cnn"]
                    ranks.send({"cmd": "run", "contender": contender, "steps": n})
                    seconds = ranks.receive(limit)["seconds"]
                    rows.append(
                        {
                            "round": round_index,
                            "contender": contender,
                            "steps": n,
                            "seconds": seconds,
                            "samples_per_sec": batch * n / seconds,
                        }
                    )
            for contender in COMPARED:
                message = {"cmd": "run", "contender": WEIGHTS + contender}
                ranks.send(message | {"steps": steps["compared"]})
                answer = ranks.receive(limit)
                distances[contender] = answer["distance"]
                if "distance_per_share" in answer:
                    shares = {"shares": SHARES[contender]}
                    per_share[contender] = answer["distance_per_share"] | shares
            ranks.send({"cmd": "quit"})
        finally:
            end_session(ranks.popen)
    return summarise(rows) | {
        "weight_distance": distances,
        "weight_distance_per_share": per_share,
        "rounds": args.rounds,
        "steps_per_measurement": {k: v for k, v in steps.items() if k != "compared"},
        "compared_steps": steps["compared"],
        "pinning": pinning(),
        "cpus_allowed_list": ready["cpus_allowed_list"],
        "threads": ready["threads"],
        "environment": ready["environment"],
        "partition": ready["partition"],
        "workload": {
            "input": list(SHAPE),
            "samples": ready["samples"],
            "global_batch": batch,
            "optimizer": f"SGD(learning_rate={LR})",
            "resnet50_parameters": ready["resnet50_parameters"],
        },
        "notes": NOTES,
    }


def summarise(rows: list[dict]) -> dict:
    """Medians and ranges per contender, each against its group's reference round by round."""
    summary = []
    for reference, members in GROUPS.items():
        mine = [r for r in rows if r["contender"] in members]
        for entry in summarise_contenders(mine, "samples_per_sec", reference, "vs_reference"):
            summary.append({**entry, "reference": reference})
    ratios = {}
    for reference, members in GROUPS.items():
        for contender in members[1:]:
            per_round = round_ratios(rows, "samples_per_sec", contender, reference)
            ratios[f"{contender} / {reference}"] = {"per_round": per_round, **spread(per_round)}
    targets = {}
    for name, (ratio, threshold) in TARGETS.items():
        value = ratios[ratio]["median"]
        targets[name] = {
            "ratio": ratio,
            "threshold": threshold,
            "value": value,
            "met": value >= threshold,
        }
    return {"raw": rows, "summary": summary, "ratios": ratios, "targets": targets}


def describe(report: dict) -> list[str]:
    """A line per contender with its median ratio to its group's first; targets; distances."""
    lines = []
    for e in report["summary"]:
        low, high = e["samples_per_sec_min"], e["samples_per_sec_max"]
        against = "" if e["contender"] == e["reference"] else f" of {e['reference']}"
        lines.append(
            f"{e['contender']}: {e['samples_per_sec_median']:.1f} samples/s ({low:.0f}-{high:.0f})"
            f", x{e['vs_reference_median']:.3f}{against}"
        )
    for name, t in report["targets"].items():
        verdict = "met" if t["met"] else "NOT met"
        lines.append(f"target {name} (>= {t['threshold']}): {t['value']:.3f}, {verdict}")
    lines += [
        f"{contender} after {report['compared_steps']} steps, ||dw - dw_fit|| / ||dw_fit|| per "
        f"tensor: median {d['median']:.3g}, max {d['max']:.3g} ({d['worst_tensor']})"
        for contender, d in report["weight_distance"].items()
    ]
    lines += [
        f"{contender} against fit on B/{d['shares']} accumulated {d['shares']} times: median "
        f"{d['median']:.3g}, max {d['max']:.3g} ({d['worst_tensor']})"
        for contender, d in report["weight_distance_per_share"].items()
    ]
    cpus = sorted(set(report["cpus_allowed_list"]))
    lines.append(
        f"pinning: {' '.join(report['pinning']['mpirun_flags'])}; Cpus_allowed_list {cpus}"
    )
    return lines


def _label(name: str) -> str:
    return textwrap.fill(name, 26)


def draw(report: dict, path: str) -> None:
    """Throughput per contender (median, min-max) per model, the ratios, the weight distances."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    titles = ["CNN, 2 ranks", "ResNet50, against rank 0 alone"]
    for ax, title, members in zip(axes[0], titles, GROUPS.values(), strict=True):
        entries = [e for e in report["summary"] if e["contender"] in members]
        medians = [e["samples_per_sec_median"] for e in entries]
        spans = [
            [m - e["samples_per_sec_min"] for m, e in zip(medians, entries, strict=True)],
            [e["samples_per_sec_max"] - m for m, e in zip(medians, entries, strict=True)],
        ]
        ax.barh([_label(e["contender"]) for e in entries], medians, xerr=spans, capsize=3)
        for y, e in enumerate(entries):
            ratio = f"  x{e['vs_reference_median']:.2f}"
            ax.annotate(ratio, (e["samples_per_sec_max"], y), va="center", fontsize=9)
        ax.set_xlim(0, 1.2 * max(e["samples_per_sec_max"] for e in entries))
        ax.invert_yaxis()
        ax.set(xlabel="samples/s (median, min-max; x: median ratio to the top bar)", title=title)
    ratios, names = report["ratios"], list(report["ratios"])
    right = axes[1][0]
    right.barh([_label(n) for n in names], [ratios[n]["median"] for n in names], color="grey")
    for y, name in enumerate(names):
        right.plot(ratios[name]["per_round"], [y] * len(ratios[name]["per_round"]), "k.", ms=4)
    for ratio, threshold in TARGETS.values():
        y = names.index(ratio)
        right.plot([threshold] * 2, [y - 0.4, y + 0.4], "r-", lw=2)
    right.axvline(1.0, color="grey", lw=0.8)
    right.invert_yaxis()
    right.set(xlabel="ratio (bars: median, dots: rounds, red: target)", title="ratios")
    far, runs = axes[1][1], list(report["weight_distance"])
    floor = 1e-9  # a distance of 0 (bitwise alike) still gets a visible stub on the log axis
    for offset, key in ((-0.2, "median"), (0.2, "max")):
        values = [report["weight_distance"][r][key] for r in runs]
        ys = [y + offset for y in range(len(runs))]
        far.barh(ys, [max(v, floor) for v in values], height=0.4, label=key)
        for y, v in zip(ys, values, strict=True):
            far.annotate(f" {v:.2g}", (max(v, floor), y), va="center", fontsize=8)
    far.set_yticks(range(len(runs)), [_label(r) for r in runs])
    far.set_xscale("log")
    far.set_xlim(floor / 10, 100)
    far.invert_yaxis()
    far.legend(loc="center right")
    far.set(
        xlabel="||dw - dw_fit|| / ||dw_fit|| per tensor",
        title=f"weights after {report['compared_steps']} steps against one-process model.fit",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
