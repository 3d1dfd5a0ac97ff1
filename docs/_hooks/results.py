"""Publishes the benchmark plots, benchmarks/results/*.png, at results/NAME.png in the site.

The plots stay where `ringtrain bench` writes them; pages under docs/performance/ show them as
`../results/NAME.png`, and `mkdocs build --strict` checks those links like any other.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

PLOTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"  # from docs/_hooks/


def on_files(files: Files, config, **kwargs) -> Files:
    for plot in sorted(PLOTS.glob("*.png")):
        files.append(File.generated(config, f"results/{plot.name}", abs_src_path=str(plot)))
    return files
