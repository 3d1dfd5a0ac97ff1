"""`ringtrain bench input --quick` runs both contenders in every round, inside memory cgroups
it removes afterwards, and fills its report: ratios, targets, memory against the set, the disk
and the pipeline alone. No speed is asserted: the numbers depend on the machine."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_bench import QUICK, quick_bench, rounds_per_contender

from ringtrain.bench.input_bench import DISK, MEMORY, TARGETS
from ringtrain.cluster.memory import memory_parent


@pytest.mark.mpi
def test_bench_input_quick(tmp_path):
    parent, _ = memory_parent("bench input")
    before = sorted(p.name for p in parent.iterdir() if p.is_dir())
    report = quick_bench("input", tmp_path)
    assert sorted(p.name for p in parent.iterdir() if p.is_dir()) == before
    rows = report["raw"]
    assert rounds_per_contender(rows) == {MEMORY: QUICK, DISK: QUICK}
    assert [r["contender"] for r in rows] == [MEMORY, DISK, DISK, MEMORY]
    for r in rows:
        assert r["samples_per_sec"] > 0 and 0 <= r["input_wait_fraction"] < 1
        assert len(r["ranks_vmhwm_bytes"]) == 2  # the two ranks, not mpirun
        assert all(high > 0 for high in r["ranks_vmhwm_bytes"]) and r["peak_resident_bytes"] > 0
    ratio = report["ratio_disk_over_memory"]
    assert len(ratio["per_round"]) == len(QUICK)
    assert ratio["min"] <= ratio["median"] <= ratio["max"]
    assert set(report["targets"]) == set(TARGETS)
    speed, wait = (report["targets"][name] for name in TARGETS)
    assert speed["met"] == (speed["value"] >= 0.95) and speed["value"] == ratio["median"]
    assert wait["met"] == (wait["value"] <= 0.05)
    data = report["dataset"]
    assert data["bytes"] > data["examples"] * 64 * 64 * 3
    assert Path(data["folder"]).is_relative_to(tmp_path)  # a quick set stays in scratch
    for e in report["summary"]:
        assert e["fullest_rank_vmhwm_of_set"] == e["fullest_rank_vmhwm_bytes"] / data["bytes"]
    alone = report["pipeline_alone"]
    assert alone["records"] > 0 and alone["records_per_sec"] > 0 and alone["mb_per_sec"] > 0
    assert report["cgroup"]["disk_peak_bytes"] <= report["cgroup"]["disk_limit_bytes"]
    assert report["profile"]["disk_step_ms"] > 0
    assert report["hosts"] is None and report["where"] == "one host"
    assert report["pinning"]["mpirun_flags"] == ["--bind-to", "core"]
