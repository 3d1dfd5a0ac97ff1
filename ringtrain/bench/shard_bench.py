"""`ringtrain bench shard-optimizer`: what `--shard-optimizer` costs a data-parallel step.

The workloads: ringtrain's built-in CNN and transformer on the embedded digits, with Adam (two
slots per weight: the state the flag divides). Each measurement is one `ringtrain train`
launch on 2 ranks (`mpirun -np 2 --bind-to core`, one thread each), timed by its own metrics
(samples/s over its steps after the first, which traces): plain `--strategy data`, and the
same with `--shard-optimizer`. The two alternate, round after round, in a shifted order, and
every ratio is the sharded step's time over the plain step's of the same round.

The target is a sharded step at most 1.15 times a plain one. The flag swaps one allreduce
for a reduce-scatter and an allgather of the same bytes, and a rank's optimizer updates a
half of the weights instead of all of them.
"""

from __future__ import annotations

import argparse
import tempfile
import textwrap
import time

from ringtrain.bench.common import deadline, summarise_contenders, train_metrics
from ringtrain.launch.mpirun import mpirun_command

WORKLOADS = {  # name -> (global batch, steps per launch): a few seconds of steps each, as
    "cnn": (256, 600),  # a step of milliseconds varies by a third from one launch to the next
    "transformer": (256, 300),
}
QUICK_WORKLOADS = {"cnn": (256, 6)}
PLAIN, SHARDED = "data", "data --shard-optimizer"
CONTENDERS = {PLAIN: [], SHARDED: ["--shard-optimizer"]}
TARGET = 1.15  # a sharded step's time over a plain one's, at most


def _command(workload: str, contender: str, batch: int, steps: int) -> list[str]:
    train = ["train", "--model", workload, "--optimizer", "adam", "--strategy", "data"]
    train += ["--batch-size", str(batch), "--steps", str(steps), "--progress", "none"]
    return mpirun_command(2, "ringtrain.cli", *train, *CONTENDERS[contender], binding="core")


def measure(args: argparse.Namespace) -> dict:
    """Every (workload, contender) launch in turn, round after round, in a shifted order."""
    workloads = QUICK_WORKLOADS if args.quick else WORKLOADS
    names = list(CONTENDERS)
    limit = time.monotonic() + deadline(args.quick)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for workload, (batch, steps) in workloads.items():
                for contender in names[shift:] + names[:shift]:
                    metrics = train_metrics(_command(workload, contender, batch, steps), limit, tmp)
                    rows.append(
                        {
                            "round": round_index,
                            "contender": f"{workload} {contender}",
                            "workload": workload,
                            "name": contender,
                            "global_batch": batch,
                            "step_seconds": batch / metrics["samples_per_sec"],
                            "samples_per_sec": metrics["samples_per_sec"],
                            "peak_resident_bytes": metrics["peak_resident_bytes"],
                        }
                    )
    return summarise(rows) | {
        "rounds": args.rounds,
        "workloads": {w: {"global_batch": b, "steps": s} for w, (b, s) in workloads.items()},
        "optimizer": "Adam, as `ringtrain train --optimizer adam` builds it",
        "target": f"sharded step time at most {TARGET}x the plain one",
    }


def summarise(rows: list[dict]) -> dict:
    """Per workload: each contender's step time, and its per-round ratio to the plain one."""
    summary, verdicts = [], {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        entries = summarise_contenders(mine, "step_seconds", f"{workload} {PLAIN}", "vs_plain")
        for entry in entries:
            runs = [r for r in mine if r["contender"] == entry["contender"]]
            peaks = sorted(r["peak_resident_bytes"] for r in runs)
            entry |= {"name": runs[0]["name"], "workload": workload}
            entry["peak_resident_bytes_median"] = peaks[len(peaks) // 2]
            if entry["name"] == SHARDED:
                verdicts[workload] = entry["vs_plain_median"] <= TARGET
        summary += entries
    return {"raw": rows, "summary": summary, "within_target": verdicts}


def describe(report: dict) -> list[str]:
    lines = []
    for e in report["summary"]:
        line = (
            f"{e['contender']:>34}: {e['step_seconds_median'] * 1e3:7.1f} ms/step "
            f"({e['vs_plain_median']:.3f}x plain), VmHWM "
            f"{e['peak_resident_bytes_median'] / 2**20:.0f} MiB"
        )
        lines.append(line)
    for workload, met in report["within_target"].items():
        lines.append(f"{workload}: sharded within {TARGET}x of plain: {'yes' if met else 'NO'}")
    return lines


def draw(report: dict, path: str) -> None:
    """Step time over the plain step's, per round, one bar group per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sharded = [e for e in report["summary"] if e["name"] == SHARDED]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, e in enumerate(sharded):
        ratios = e["vs_plain_per_round"]
        ax.bar(i, e["vs_plain_median"], color="tab:blue", alpha=0.6)
        ax.plot([i] * len(ratios), ratios, "o", color="black", ms=4)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(TARGET, color="tab:red", ls="--", lw=1, label=f"target {TARGET}x")
    ax.set_xticks(range(len(sharded)), [e["workload"] for e in sharded])
    highest = max((r for e in sharded for r in e["vs_plain_per_round"]), default=TARGET)
    ax.set(ylabel="sharded step time / plain step time", ylim=(0, max(highest, TARGET) + 0.2))
    ax.legend(fontsize=8)
    title = "--shard-optimizer against plain data parallelism, 2 ranks, Adam (dots: rounds)"
    ax.set_title(textwrap.fill(title, 60), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
