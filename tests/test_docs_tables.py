"""The performance pages' tables are what benchmarks/docs_tables.py writes from
benchmarks/results/*.json, so a new result without its regenerated page fails here."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "docs_tables.py"


def test_the_performance_pages_match_their_results():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_a_stale_or_unmarked_page_is_named(tmp_path: Path, monkeypatch):
    spec = importlib.util.spec_from_file_location("docs_tables", SCRIPT)
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    pages = tmp_path / "performance"
    shutil.copytree(ROOT / "docs" / "performance", pages)
    monkeypatch.setattr(tables, "PAGES", pages)
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    stale = pages / "strategies.md"
    stale.write_text(stale.read_text().replace("| single |", "| single (typed by hand) |", 1))
    with pytest.raises(SystemExit, match="out of date: performance/strategies.md"):
        tables.main(["--check"])
    tables.main([])  # regenerating mends it
    tables.main(["--check"])
    stale.write_text(stale.read_text().replace(tables.END, ""))
    with pytest.raises(SystemExit, match="performance/strategies.md needs one"):
        tables.main([])
