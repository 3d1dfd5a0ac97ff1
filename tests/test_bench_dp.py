"""`ringtrain bench dp --quick` on one workload: it runs, measures every contender and every
roofline term in each round, checks its MPI sums, and writes the report and the chart."""

from __future__ import annotations

import json

import pytest
from conftest import BIN, run

CONTENDERS = (
    "single",
    "compute per rank",
    "ringtrain",
    "ringtrain bucketed",
    "plain Horovod",
    "MWMS tuned, inter-op 2",  # TensorFlow's workers, taking turns with ringtrain's launch
)


@pytest.mark.mpi
def test_bench_dp_quick_reports_the_roofline_beside_every_contender(tmp_path):
    out, png = tmp_path / "dp.json", tmp_path / "dp.png"
    done = run(
        [str(BIN / "ringtrain"), "bench", "dp", "--quick", "--workloads", "cnn"]
        + ["--out", str(out), "--png", str(png)],
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert png.stat().st_size > 0
    report = json.loads(out.read_text())
    (cnn,) = report["workloads"]
    assert len(cnn["rounds"]) == report["rounds"] == 2  # a quick run's two rounds
    for row in cnn["rounds"]:  # every contender and term in every round
        assert all(row[c] > 0 for c in CONTENDERS), row
        assert row["MPI_Allreduce in_place"] > 0 and row["MPI_Allreduce out_of_place"] > 0
        assert set(row["ringtrain breakdown"]) >= {"learning_rate", "step", "stop_agreement"}
    ms = cnn["ms"]
    assert ms["no-overlap limit"] == pytest.approx(
        ms["compute per rank"] + min(ms["MPI_Allreduce in place"], ms["MPI_Allreduce out of place"])
    )
    assert cnn["ratios"]["ringtrain over tuned MWMS (speed)"] > 0
    assert cnn["mwms"]["mwms-2"]["cpus_allowed_list"]
    trace = cnn["overlap_trace"]
    assert len(trace["bucket_arrival_ms"]) == cnn["buckets"] >= 1
    assert "ALLREDUCE" in json.dumps(cnn["horovod_timeline_ms_per_step"]).upper()
    assert [r["cpus_allowed_list"] for r in cnn["ranks"]] and cnn["link_mb_s"] > 0
    assert "HOROVOD_CYCLE_TIME" in cnn["ranks"][0]["environment"]
    assert "bench dp, one host" in done.stdout
