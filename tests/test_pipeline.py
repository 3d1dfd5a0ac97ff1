"""Model and pipeline parallelism over mpi4py equal single-process training."""

from __future__ import annotations

import json

import pytest
from conftest import (
    REFERENCE_FLAGS,
    load_npz,
    mpi_checks,
    ringtrain,
)

from ringtrain.weights import relative_difference

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_gpipe_and_1f1b_equal_single_process_for_every_configuration(stages, tmp_path):
    results = mpi_checks("pipeline", stages, tmp_path if stages == 2 else None)
    assert len(results) == 29
    for r in results:
        assert r["rel_diff"] <= 1e-5, r
        assert r["loss_diff"] <= 1e-5, r
        c, m = r["config"], r["config"]["microbatches"]
        # Memory: 1F1B holds at most min(P - s, M) microbatches at stage s, GPipe holds M.
        expected = [m if c["schedule"] == "gpipe" else min(stages - s, m) for s in range(stages)]
        assert r["peak_inflight"] == expected, r
    seen = {
        (r["config"]["strategy"], r["config"]["schedule"], r["config"]["microbatches"])
        for r in results
    }
    assert ("model", "1f1b", 1) in seen and ("pipeline", "gpipe", 8) in seen
    assert any(r["config"]["sync_sends"] for r in results)  # Ssend: no reliance on buffering
    assert any(r["config"]["clip_norm"] for r in results)


@pytest.mark.parametrize(
    "strategy,schedule", [("pipeline", "gpipe"), ("pipeline", "1f1b"), ("model", "1f1b")]
)
def test_cli_pipeline_weights_equal_single_process(tmp_path, single_reference, strategy, schedule):
    weights, metrics = tmp_path / "w.npz", tmp_path / "m.json"
    trace, gantt = tmp_path / "trace.json", tmp_path / "gantt.png"
    micro = "1" if strategy == "model" else "4"
    done = ringtrain(
        "train",
        "--strategy",
        strategy,
        "--schedule",
        schedule,
        "--microbatches",
        micro,
        *REFERENCE_FLAGS,
        "--weights-out",
        str(weights),
        "--metrics-out",
        str(metrics),
        "--trace",
        str(trace),
        "--gantt",
        str(gantt),
        ranks=2,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert relative_difference(load_npz(weights), single_reference) <= 1e-5
    report = json.loads(metrics.read_text())
    assert report["partition"] == [[0, 2], [2, 4]]
    assert 0.0 <= report["bubble_measured"] < 1.0
    expected_bubble = 1 / (int(micro) + 1)  # (P-1)/(M+P-1) with P=2
    assert report["bubble_predicted"] == pytest.approx(expected_bubble)
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events} == {0, 1}
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
