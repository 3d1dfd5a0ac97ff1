"""Regenerate the README's performance section from benchmarks/results/*.json.

    python benchmarks/readme_tables.py      # rewrites the block between the markers
Numbers are never typed by hand: this script is the only writer of that block.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ringtrain.bench.allreduce import size_label

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _range(entry: dict, metric: str, fmt: str = ".0f") -> str:
    return (
        f"{entry[f'{metric}_median']:{fmt}} ({entry[f'{metric}_min']:{fmt}}–"
        f"{entry[f'{metric}_max']:{fmt}})"
    )


def _mode(report: dict) -> str:
    return " (quick mode)" if report["quick"] else ""


def pipeline_table(report: dict) -> str:
    lines = [
        "| contender | samples/s (median, min–max) | × single | bubble measured | "
        "bubble predicted | peak in-flight | peak boundary bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in report["summary"]:
        rate = _range(e, "samples_per_sec")
        if "bubble_gap" not in e:
            lines.append(f"| {e['contender']} | {rate} | 1.00 | | | | |")
            continue
        lines.append(
            f"| {e['contender']} | {rate} | {e['speedup_vs_single_median']:.2f} | "
            f"{e['bubble_measured_median']:.3f} | {e['bubble_predicted_median']:.3f} | "
            f"{e['peak_inflight']} | {e['peak_activation_bytes']} |"
        )
    met = ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in report["targets"].items())
    facts = report["machine"]
    intro = (
        f"`ringtrain bench pipeline` on {facts['cpus']} cores ({facts['machine']}), CNN on "
        "synthetic 32×32×3, global batch 64, P=2, one thread per rank, "
        f"{report['raw']['rounds']} alternating rounds{_mode(report)}."
    )
    picture = "![pipeline benchmark](benchmarks/results/pipeline.png)"
    return "\n".join([intro, "", *lines, "", f"Targets: {met}.", "", picture])


def strategies_table(report: dict) -> str:
    threads = report["threads"]
    lines = [
        "| contender | processes (intra/inter-op threads) | samples/s (median, min–max) |"
        " × single |",
        "|---|---|---|---|",
    ]
    for e in report["summary"]:
        processes = " + ".join(
            f"{n} × {kind} ({threads[kind]['intra_op']}/{threads[kind]['inter_op']})"
            for n, kind in report["processes_per_contender"][e["contender"]]
        )
        lines.append(
            f"| {e['contender']} | {processes} | {_range(e, 'samples_per_sec')} | "
            f"{e['speedup_vs_single_median']:.2f} |"
        )
    lines += ["", "| ratio, per round | median (min–max) |", "|---|---|"]
    for name, r in report["ratios"].items():
        lines.append(f"| {name} | {r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f}) |")
    verdicts = []
    for name, t in report["targets"].items():
        if t["met"] is None:
            verdicts.append(f"{name}: not measured ({t['why_not_measured']})")
        else:
            verdicts.append(f"{name}: {t['value']:.2f}, {'met' if t['met'] else 'NOT met'}")
    failed = [f"{name} did not run: {why}." for name, why in report["failures"].items()]
    facts, w = report["machine"], report["workload"]
    intro = (
        f"`ringtrain bench strategies` on {facts['cpus']} cores ({facts['cpu_model']}), "
        f"TensorFlow {facts['tensorflow']}: CNN on synthetic {'×'.join(map(str, w['input']))}, "
        f"global batch {w['global_batch']}, {w['optimizer']}, {report['steps_per_measurement']} "
        f"steps per turn, {report['rounds']} alternating rounds{_mode(report)}. "
        "Efficiency is data-parallel throughput over 2 × single; other ratios are ringtrain's "
        "data parallelism (custom loop) over each contender, round by round."
    )
    picture = "![strategies benchmark](benchmarks/results/strategies.png)"
    return "\n".join(
        [intro, "", *lines, "", f"Targets: {'; '.join(verdicts)}.", *failed, "", picture]
    )


def allreduce_table(report: dict) -> str:
    lines = [
        "| ranks | size | Horovod busbw | mpi4py Allreduce busbw | ring busbw | Horovod / MPI |"
        " ring / MPI | memcpy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cells: dict[tuple[int, int], dict[str, dict]] = {}
    for e in report["summary"]:
        cells.setdefault((e["ranks"], e["bytes"]), {})[e["contender"]] = e
    for (ranks, nbytes), at in cells.items():
        over = " (oversubscribed)" if at["memcpy"]["oversubscribed"] else ""
        lines.append(
            f"| {ranks}{over} | {size_label(nbytes)} | "
            + " | ".join(
                _range(at[c], "busbw_GBps", ".3g") for c in ("horovod", "mpi4py Allreduce", "ring")
            )
            + f" | {at['horovod']['vs_allreduce_median']:.2f} | "
            f"{at['ring']['vs_allreduce_median']:.2f} | {at['memcpy']['algbw_GBps_median']:.3g} |"
        )
    verdicts = [
        f"{name}: {'met' if t['met'] else 'NOT met'} (worst {t['worst_median_ratio']:.2f})"
        if t["worst_median_ratio"] is not None
        else f"{name}: not measured"
        for name, t in report["targets"].items()
    ]
    facts = report["machine"]
    intro = (
        f"`ringtrain bench allreduce` on {facts['cpus']} cores ({facts['cpu_model']}), "
        f"{facts['mpi']}, Horovod {facts['horovod']}: float32 sums, GB/s (median, min–max over "
        f"{report['rounds']} alternating rounds){_mode(report)}. Bus bandwidth is "
        "size/time × 2(N−1)/N; memcpy is `np.copyto` on one rank (size/time), the memory "
        "bandwidth every transfer on one machine is bounded by. Ratios are medians of per-round "
        "ratios; targets are judged on ranks with a core each, from 4 MiB up."
    )
    picture = "![allreduce benchmark](benchmarks/results/allreduce.png)"
    return "\n".join([intro, "", *lines, "", f"Targets: {'; '.join(verdicts)}.", "", picture])


SECTIONS = {
    "pipeline": pipeline_table,
    "strategies": strategies_table,
    "allreduce": allreduce_table,
}


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        sys.exit(
            f"readme_tables: {readme} needs one {BEGIN} line and, after it, one {END} line "
            "where the performance section goes; add them and run this again"
        )
    sections = []
    for name, table in SECTIONS.items():
        path = ROOT / "benchmarks" / "results" / f"{name}.json"
        if path.exists():
            sections.append(table(json.loads(path.read_text())))
    body = "\n\n".join(sections) or "(no results yet: run `ringtrain bench ...` first)"
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    readme.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")


if __name__ == "__main__":
    main()
