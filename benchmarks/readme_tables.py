"""Regenerate the README's performance section from benchmarks/results/*.json.

    python benchmarks/readme_tables.py      # rewrites the block between the markers
Numbers are never typed by hand: this script is the only writer of that block.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def pipeline_table(report: dict) -> str:
    lines = [
        "| contender | samples/s (median, min–max) | × single | bubble measured | "
        "bubble predicted | peak in-flight | peak boundary bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in report["summary"]:
        rate = (
            f"{e['samples_per_sec_median']:.0f} ({e['samples_per_sec_min']:.0f}–"
            f"{e['samples_per_sec_max']:.0f})"
        )
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
    mode = " (quick mode)" if report["quick"] else ""
    intro = (
        f"`ringtrain bench pipeline` on {facts['cpus']} cores ({facts['machine']}), CNN on "
        "synthetic 32×32×3, global batch 64, P=2, one thread per rank, "
        f"{report['raw']['rounds']} alternating rounds{mode}."
    )
    picture = "![pipeline benchmark](benchmarks/results/pipeline.png)"
    return "\n".join([intro, "", *lines, "", f"Targets: {met}.", "", picture])


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    path = ROOT / "benchmarks" / "results" / "pipeline.json"
    body = pipeline_table(json.loads(path.read_text())) if path.exists() else "(no results yet)"
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    readme.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")


if __name__ == "__main__":
    main()
