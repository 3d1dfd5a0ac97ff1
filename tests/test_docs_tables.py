"""The performance pages' tables and the docs' inline figures are what benchmarks/docs_tables.py
writes from benchmarks/results/*.json, so a new result without its regenerated page fails here."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from test_figures import docs_tables

from ringtrain.bench.roofline import roofline_verdict
from ringtrain.plan.cli import CALIBRATION_RUNS

SCRIPT = ROOT / "benchmarks" / "docs_tables.py"
PLAN_RESULTS = sorted((ROOT / "benchmarks" / "results").glob("plan-*.json"))
DP_RESULTS = sorted((ROOT / "benchmarks" / "results").glob("dp*.json"))


def test_the_performance_pages_match_their_results():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


@pytest.fixture
def copied_docs(tmp_path: Path, monkeypatch):
    """docs_tables pointed at a copy of README.md and docs/ in tmp_path."""
    tables = docs_tables()
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    monkeypatch.setattr(tables, "DOCS", tmp_path / "docs")
    monkeypatch.setattr(tables, "PAGES", tmp_path / "docs" / "performance")
    return tables, tmp_path / "docs"


def test_a_stale_or_unmarked_page_is_named(copied_docs):
    tables, docs = copied_docs
    stale = docs / "performance" / "strategies.md"
    stale.write_text(stale.read_text().replace("| single |", "| single (typed by hand) |", 1))
    with pytest.raises(SystemExit, match="out of date: docs/performance/strategies.md"):
        tables.main(["--check"])
    tables.main([])  # regenerating mends it
    tables.main(["--check"])
    stale.write_text(stale.read_text().replace(tables.END, ""))
    with pytest.raises(SystemExit, match="docs/performance/strategies.md needs one"):
        tables.main([])


def test_a_stale_or_unknown_inline_figure_is_named(copied_docs):
    tables, docs = copied_docs
    page = docs / "performance" / "index.md"
    text = page.read_text()
    span = tables.SPAN.search(text)
    page.write_text(text.replace(span.group(0), f"{span[1]}0.3-2.3%{span[4]}"))
    with pytest.raises(SystemExit, match="out of date: docs/performance/index.md"):
        tables.main(["--check"])
    tables.main([])
    assert page.read_text() == text
    page.write_text(text.replace(span.group(0), "<!-- fig: typed by hand -->1.5x<!-- /fig -->"))
    with pytest.raises(SystemExit, match="no inline figure 'typed by hand'"):
        tables.main([])


def test_a_step_that_beats_its_roofline_is_an_error_never_a_hit():
    assert roofline_verdict(0.95) == "met"
    assert roofline_verdict(0.898) == "missed"
    assert roofline_verdict(1.36) == "roofline error"
    report = copy.deepcopy(json.loads(DP_RESULTS[0].read_text()))
    for workload in report["workloads"]:
        workload["ratios"]["roofline (no-overlap / ringtrain)"] = 1.2
    summary = docs_tables().dp_summary([report])
    count = len(report["workloads"])
    assert f"met in 0 of {count} cases" in summary
    assert f"{count} roofline errors, counted as neither" in summary
    assert "roofline error: limit wrong for this case" in docs_tables().dp_table(report)


@pytest.mark.parametrize("path", PLAN_RESULTS, ids=[p.stem for p in PLAN_RESULTS])
def test_plan_accuracy_is_headlined_out_of_sample(path: Path):
    """In sample is exactly what `plan calibrate` runs itself; each link speed keeps at least
    12 configurations it never ran for the headline."""
    report = json.loads(path.read_text())
    calibrated = {c.label() for c in CALIBRATION_RUNS}
    rows = [r for w in report["workloads"] for r in w["configurations"]]
    inside = {r["configuration"] for r in rows if docs_tables()._in_sample(r)}
    assert inside == calibrated
    outside = [r for r in rows if not docs_tables()._in_sample(r)]
    assert len(outside) >= 12
    headline = docs_tables().plan_accuracy(report)
    assert f"({len(outside)} configurations `plan calibrate` never ran" in headline
