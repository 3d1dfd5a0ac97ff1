"""`ringtrain bench pipeline`: measured against predicted bubble, GPipe and 1F1B, P=2.

The two ranks run one thread each (fair against the single process's one thread). The
simulator is fed the per-stage F and B times measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

RESULTS = Path("benchmarks/results")
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
THREADS = {"RINGTRAIN_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, parser_class=type(parser))
    p = sub.add_parser(
        "pipeline",
        help="measured vs predicted bubble, GPipe vs 1F1B, P=2",
        prog=f"{parser.prog} pipeline",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run (under 3 minutes)")
    p.add_argument("--rounds", type=int, help="alternation rounds (default 3, quick 3)")
    p.add_argument("--out", default=str(RESULTS / "pipeline.json"))
    p.add_argument("--png", default=str(RESULTS / "pipeline.png"))


def run_bench_command(args: argparse.Namespace) -> int:
    rounds = args.rounds or 3
    steps = 2 if args.quick else 8
    micro = [1, 2, 4, 8, 16]
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = os.path.join(tmp, "raw.json")
        cmd = [
            "mpirun",
            "--oversubscribe",
            "-np",
            "2",
            "-x",
            "RINGTRAIN_THREADS",
            sys.executable,
            "-m",
            "ringtrain.bench.pipeline_worker",
            raw_path,
            str(rounds),
            str(steps),
            ",".join(map(str, micro)),
        ]
        done = subprocess.run(cmd, env={**os.environ, **ROOT_OK, **THREADS})
        if done.returncode != 0:
            print(
                f"ringtrain bench: error: the benchmark ranks failed (exit {done.returncode})",
                file=sys.stderr,
            )
            return 1
        raw = json.loads(Path(raw_path).read_text())
    report = summarise(raw) | {
        "machine": machine_facts(),
        "quick": args.quick,
        "threads": {"intra_op": 1, "inter_op": 1, "ranks": 2},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    draw(report, args.png)
    for row in report["summary"]:
        print(
            f"{row['contender']:>12}: {row['samples_per_sec_median']:8.1f} samples/s"
            + (
                f"  bubble measured {row['bubble_measured_median']:.3f} predicted "
                f"{row['bubble_predicted_median']:.3f}"
                if "bubble_measured_median" in row
                else ""
            )
        )
    print(f"wrote {args.out} and {args.png}")
    return 0


def summarise(raw: dict) -> dict:
    """Medians and ranges per contender; throughput ratios to single, computed per round."""
    rows = raw["raw"]
    single = {r["round"]: r["samples_per_sec"] for r in rows if r["contender"] == "single"}
    summary = []
    for name in dict.fromkeys(r["contender"] for r in rows):
        mine = [r for r in rows if r["contender"] == name]
        rates = [r["samples_per_sec"] for r in mine]
        entry = {
            "contender": name,
            "samples_per_sec_median": median(rates),
            "samples_per_sec_min": min(rates),
            "samples_per_sec_max": max(rates),
            "speedup_vs_single_per_round": [
                r["samples_per_sec"] / single[r["round"]] for r in mine
            ],
        }
        entry["speedup_vs_single_median"] = median(entry["speedup_vs_single_per_round"])
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
        summary.append(entry)
    pipelines = [e for e in summary if "bubble_gap" in e]
    target = next((e for e in pipelines if e["contender"] == "1f1b M=8"), None)
    targets = {
        "bubble_within_0.05_at_every_M": all(e["bubble_gap"] <= 0.05 for e in pipelines),
        "1f1b_M8_speedup_at_least_1.5": bool(target and target["speedup_vs_single_median"] >= 1.5),
    }
    return {"raw": raw, "summary": summary, "targets": targets}


def machine_facts() -> dict:
    import tensorflow as tf

    return {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
    }


def draw(report: dict, path: str) -> None:
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
