"""`ringtrain bench pipeline-sizes`: 2-stage pipelines through the CLI, as a user runs them,
against one process, at the sizes users run.

The workloads: the built-in transformer on the embedded digits with SGD, at global batches
256 and 1024; and a user's BERT-shaped keras-hub classifier (examples/bert_classifier.py),
with Adam, at 256. Each measurement is one `ringtrain train` launch, timed by its own metrics
(samples/s over its steps after the first, which traces):

- one process on one core with one thread (`mpirun -np 1 --bind-to core`);
- `mpirun -np 2 --bind-to core`: 1F1B at M = 4 and 8, and ZB-H1 at M = 8, with the default
  backward (from the activations the compiled forward kept), and at M = 8 with `--recompute`
  (only the input kept, the forward redone inside the compiled backward).

Contenders alternate, round after round, in a shifted order. Every ratio is taken against the
one process of the same round and batch, so drift over the run cancels.

A microbatch's fixed cost is measured as the issue of it defines it: 1F1B at M = 4 and 8 and
ZB-H1 at M = 8 also launch at a global batch of M, one example per microbatch, and each of a
stage's actions per microbatch (F, B or BI and BW, its send and receive) is taken at its own
work there (its wait left out), less one example's compute: how much the action's own work
grows per example up to the timed launch's microbatch.
"""

from __future__ import annotations

import argparse
import tempfile
import textwrap
import time
from pathlib import Path
from statistics import median

from ringtrain.bench.common import deadline, summarise_contenders, train_metrics
from ringtrain.launch.mpirun import mpirun_command

LR = 0.05
BERT = Path(__file__).resolve().parents[2] / "examples" / "bert_classifier.py"
WORKLOADS = {  # name -> (its train flags, {global batch: steps per launch}, what it is)
    "transformer": (
        ["--model", "transformer", "--optimizer", "sgd", "--lr", str(LR)],
        {256: 60, 1024: 30},
        f"ringtrain's built-in transformer on digits, SGD(learning_rate={LR})",
    ),
    "bert": (
        ["--model", f"{BERT}:build", "--data", f"{BERT}:data"],
        {256: 20},
        "examples/bert_classifier.py (keras-hub BertBackbone: 2 layers, hidden 64, 32 tokens) "
        "on its synthetic tokens, Adam(1e-3) as compiled",
    ),
}
QUICK_STEPS = {"transformer": {256: 6}}
SINGLE = "single 1 thread"
PIPELINES = {  # contender -> its train flags
    "1f1b M=4": ["--schedule", "1f1b", "--microbatches", "4"],
    "1f1b M=8": ["--schedule", "1f1b", "--microbatches", "8"],
    "1f1b-ahead M=8": ["--schedule", "1f1b-ahead", "--microbatches", "8"],
    "zb-h1 M=8": ["--schedule", "zb-h1", "--microbatches", "8"],
    "1f1b M=8 recompute": ["--schedule", "1f1b", "--microbatches", "8", "--recompute"],
    "zb-h1 M=8 recompute": ["--schedule", "zb-h1", "--microbatches", "8", "--recompute"],
}
QUICK_PIPELINES = ["1f1b M=8", "1f1b M=8 recompute"]
# The contenders whose fixed cost is measured: each also launches at a global batch of M, so
# that every microbatch holds one example, and its actions' own work is what one costing a
# single example pays.
ONE_EXAMPLE = ["1f1b M=4", "1f1b M=8", "zb-h1 M=8"]
ONE_EXAMPLE_STEPS = 40
PER_MICROBATCH = ("F", "B", "BI", "BW", "SA", "SG", "RA", "RG")  # a stage's, per microbatch


def _command(workload: str, contender: str, batch: int, steps: int) -> list[str]:
    train = [
        "train",
        *WORKLOADS[workload][0],
        "--batch-size",
        str(batch),
        "--steps",
        str(steps),
        "--progress",
        "none",
    ]
    if contender == SINGLE:
        return mpirun_command(1, "ringtrain.cli", *train, "--strategy", "single", binding="core")
    flags = ["--strategy", "pipeline", *PIPELINES[contender]]
    return mpirun_command(2, "ringtrain.cli", *train, *flags, binding="core")


def measure(args: argparse.Namespace) -> dict:
    """Every (workload, batch, contender) launch in turn, round after round, in a shifted
    order; in each round, each of ONE_EXAMPLE's launches at 1 example per microbatch too."""
    sizes = QUICK_STEPS if args.quick else {w: steps for w, (_, steps, _) in WORKLOADS.items()}
    names = [SINGLE, *(QUICK_PIPELINES if args.quick else PIPELINES)]
    limit = time.monotonic() + deadline(args.quick)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:

        def launch(round_index: int, workload: str, contender: str, batch: int, steps: int):
            metrics = train_metrics(_command(workload, contender, batch, steps), limit, tmp)
            calibration = metrics.get("calibration", {})
            rows.append(
                {
                    "round": round_index,
                    "contender": f"{workload} {contender} @ {batch}",
                    "workload": workload,
                    "name": contender,
                    "global_batch": batch,
                    "samples_per_sec": metrics["samples_per_sec"],
                    "bubble_measured": metrics.get("bubble_measured"),
                    "step_time_measured": metrics.get("step_time_measured"),
                    "own_ms_per_action": own_per_action(calibration),
                    "call_floor_ms": calibration.get("call_floor_ms"),
                }
            )

        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for workload, steps in sizes.items():
                for batch, count in steps.items():
                    for contender in names[shift:] + names[:shift]:
                        launch(round_index, workload, contender, batch, count)
                for contender in (c for c in ONE_EXAMPLE if c in names):
                    batch = microbatches(contender)
                    launch(round_index, workload, contender, batch, ONE_EXAMPLE_STEPS)
    return summarise(rows) | {
        "rounds": args.rounds,
        "steps_per_launch": {w: {str(b): n for b, n in s.items()} for w, s in sizes.items()},
        "one_example_steps": ONE_EXAMPLE_STEPS,
        "workloads": {w: WORKLOADS[w][2] for w in sizes},
    }


def microbatches(contender: str) -> int:
    flags = PIPELINES[contender]
    return int(flags[flags.index("--microbatches") + 1])


def own_per_action(calibration: dict) -> dict[str, dict[str, float]] | None:
    """Per stage and kind of action, the median milliseconds of one action's own work (its
    compute and fixed cost, its wait left out)."""
    costs = calibration.get("action_costs_ms")
    if costs is None:
        return None
    return {
        stage: {op: split["compute_ms"] + split["fixed_ms"] for op, split in ops.items()}
        for stage, ops in costs.items()
        if int(stage) >= 0
    }


def fixed_per_action(one: dict, full: dict, examples: int) -> dict[str, dict[str, float]]:
    """A microbatch's fixed cost per stage and kind of action: the action's own work on one
    example (`one`), less one example's compute, the growth of its own work per example up
    to the contender's `examples` per microbatch (`full`)."""
    fixed: dict[str, dict[str, float]] = {}
    for stage, ops in one.items():
        for op, alone in ops.items():
            if op not in PER_MICROBATCH:
                continue
            per_example = max(0.0, (full[stage][op] - alone) / max(1, examples - 1))
            fixed.setdefault(stage, {})[op] = alone - per_example
    return fixed


def _median_own(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per stage and kind of action, the median over launches of its own work."""
    first = runs[0]["own_ms_per_action"]
    return {
        stage: {op: median(r["own_ms_per_action"][stage][op] for r in runs) for op in ops}
        for stage, ops in first.items()
    }


def summarise(rows: list[dict]) -> dict:
    """Per workload and batch: each contender's samples/s and its ratio to that round's one
    process."""
    summary = []
    timed = [r for r in rows if not _one_example(r)]
    for workload, batch in dict.fromkeys((r["workload"], r["global_batch"]) for r in timed):
        mine = [r for r in timed if (r["workload"], r["global_batch"]) == (workload, batch)]
        single = f"{workload} {SINGLE} @ {batch}"
        entries = summarise_contenders(mine, "samples_per_sec", single, "vs_single")
        for entry in entries:
            runs = [r for r in mine if r["contender"] == entry["contender"]]
            name = runs[0]["name"]
            entry |= {"name": name, "workload": workload, "global_batch": batch}
            if runs[0]["bubble_measured"] is None:
                continue
            entry["bubble_measured_median"] = median(r["bubble_measured"] for r in runs)
            entry["call_floor_ms_median"] = median(r["call_floor_ms"] for r in runs)
            ones = [
                r
                for r in rows
                if _one_example(r) and (r["workload"], r["name"]) == (workload, name)
            ]
            if ones:
                examples = batch // microbatches(name)
                profile = fixed_per_action(_median_own(ones), _median_own(runs), examples)
                entry["fixed_ms_per_action_median"] = profile
                # the stage that pays most
                entry["fixed_ms_per_microbatch_median"] = max(
                    sum(ops.values()) for ops in profile.values()
                )
        summary += entries
    return {"raw": rows, "summary": summary}


def _one_example(row: dict) -> bool:
    """Whether a launch put one example in each microbatch (it measures the fixed cost)."""
    return row["name"] != SINGLE and row["global_batch"] == microbatches(row["name"])


def describe(report: dict) -> list[str]:
    lines = []
    for e in report["summary"]:
        line = (
            f"{e['contender']:>38}: {e['samples_per_sec_median']:8.0f} samples/s "
            f"({e['vs_single_median']:.2f}x one process)"
        )
        if "bubble_measured_median" in e:
            line += f"  bubble {e['bubble_measured_median']:.2f}"
        if "fixed_ms_per_microbatch_median" in e:
            line += f"  fixed {e['fixed_ms_per_microbatch_median']:.2f} ms/microbatch"
            line += f" (empty call {e['call_floor_ms_median']:.2f} ms)"
        lines.append(line)
    return lines


def draw(report: dict, path: str) -> None:
    """Throughput over one process, per contender, one panel per workload and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((e["workload"], e["global_batch"]) for e in report["summary"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        entries = [e for e in report["summary"] if (e["workload"], e["global_batch"]) == panel]
        ax.bar(range(len(entries)), [e["vs_single_median"] for e in entries])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(
            range(len(entries)), [e["name"] for e in entries], rotation=30, ha="right", fontsize=8
        )
        ax.set(ylabel="samples/s over one process", title=f"{panel[0]}, global batch {panel[1]}")
    title = "2-stage pipelines through the CLI against one process"
    fig.suptitle(textwrap.fill(title, 110), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
