"""`ringtrain bench pipeline`: measured against predicted bubble, GPipe and 1F1B, P=2.

The two ranks run one thread each (fair against the single process's one thread). The
simulator is fed the per-stage F and B times measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from statistics import median

from ringtrain.bench.common import (
    deadline,
    mpi_env,
    mpirun_command,
    run_bounded,
    summarise_contenders,
)

MICROBATCHES = [1, 2, 4, 8, 16]


def measure(args: argparse.Namespace) -> dict:
    """One 2-rank mpirun in which every contender takes its turn, round after round."""
    steps = 2 if args.quick else 8
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        cmd = mpirun_command(
            2,
            "ringtrain.bench.pipeline_worker",
            str(raw_path),
            str(args.rounds),
            str(steps),
            ",".join(map(str, MICROBATCHES)),
        )
        run_bounded(cmd, mpi_env(threads=1), deadline(args.quick), Path(tmp) / "ranks.log")
        raw = json.loads(raw_path.read_text())
    return summarise(raw) | {"threads": {"intra_op": 1, "inter_op": 1, "ranks": 2}}


def describe(report: dict) -> list[str]:
    return [
        f"{row['contender']:>12}: {row['samples_per_sec_median']:8.1f} samples/s"
        + (
            f"  bubble measured {row['bubble_measured_median']:.3f} predicted "
            f"{row['bubble_predicted_median']:.3f}"
            if "bubble_measured_median" in row
            else ""
        )
        for row in report["summary"]
    ]


def summarise(raw: dict) -> dict:
    """Medians and ranges per contender; throughput ratios to single, computed per round."""
    rows = raw["raw"]
    summary = summarise_contenders(rows, "samples_per_sec", "single", "speedup_vs_single")
    for entry in summary:
        mine = [r for r in rows if r["contender"] == entry["contender"]]
        if "bubble_measured" in mine[0]:
            for key in ("bubble_measured", "bubble_predicted", "bubble_predicted_unit"):
                entry[f"{key}_median"] = median(r[key] for r in mine)
            entry["bubble_gap"] = abs(
                entry["bubble_measured_median"] - entry["bubble_predicted_median"]
            )
            entry |= {
                k: mine[0][k]
                for k in (
                    "schedule",
                    "microbatches",
                    "peak_inflight",
                    "boundary_bytes_per_microbatch",
                )
            }
            entry["peak_activation_bytes"] = [
                p * entry["boundary_bytes_per_microbatch"][0] for p in entry["peak_inflight"]
            ]
    pipelines = [e for e in summary if "bubble_gap" in e]
    target = next((e for e in pipelines if e["contender"] == "1f1b M=8"), None)
    targets = {
        "bubble_within_0.05_at_every_M": all(e["bubble_gap"] <= 0.05 for e in pipelines),
        "1f1b_M8_speedup_at_least_1.5": bool(target and target["speedup_vs_single_median"] >= 1.5),
    }
    return {"raw": raw, "summary": summary, "targets": targets}


def draw(report: dict, path: str) -> None:
    """Bubble against M (measured and predicted), and speed-up over one process."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for kind, colour in (("gpipe", "tab:blue"), ("1f1b", "tab:orange")):
        rows = [e for e in report["summary"] if e.get("schedule") == kind]
        ms = [e["microbatches"] for e in rows]
        left.plot(
            ms,
            [e["bubble_measured_median"] for e in rows],
            "o-",
            color=colour,
            label=f"{kind} measured",
        )
        left.plot(
            ms,
            [e["bubble_predicted_median"] for e in rows],
            "x--",
            color=colour,
            label=f"{kind} predicted",
        )
        right.plot(
            ms, [e["speedup_vs_single_median"] for e in rows], "o-", color=colour, label=kind
        )
    left.set(xscale="log", xlabel="microbatches M", ylabel="bubble", title="bubble, P=2")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(
        xscale="log",
        xlabel="microbatches M",
        ylabel="throughput / single process",
        title="speed-up over one process",
    )
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
