"""Model and pipeline parallelism over mpi4py equal a plain TensorFlow loop."""

from __future__ import annotations

import json

import pytest
from conftest import (
    assert_exact_resume,
    assert_matches_reference,
    train_matches_reference,
)

pytestmark = pytest.mark.mpi
STRATEGIES = ("single", "data", "model", "pipeline", "hybrid")


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_pipeline_and_model_parallel_match_the_independent_reference(stages, grid_checks):
    results = grid_checks.results(stages, "pipeline", "model")
    assert_matches_reference(results)
    for r in results:
        c, m = r["config"], r["config"]["microbatches"]
        assert r["stages"] == stages
        # Memory: 1F1B holds at most min(P - s, M) microbatches at stage s, GPipe holds M.
        expected = [m if c["schedule"] == "gpipe" else min(stages - s, m) for s in range(stages)]
        assert r["peak_inflight"] == expected, r
    kinds = {(r["config"]["strategy"], r["config"]["schedule"]) for r in results}
    assert {("model", "1f1b"), ("pipeline", "gpipe"), ("pipeline", "1f1b")} <= kinds
    assert any(r["config"]["microbatches"] in (3, 5) for r in results)  # odd M
    if stages == 2:
        assert any(r["config"]["sync_sends"] for r in results)  # Ssend: no reliance on buffering
        assert any(r["config"]["clip_norm"] for r in results)


def test_every_strategy_meets_every_model_and_optimizer_at_the_default_adam_lr(grid_checks):
    every = [r for ranks in (1, 2, 3, 4) for r in grid_checks.results(ranks, *STRATEGIES)]
    for strategy in STRATEGIES:
        configs = [r["config"] for r in every if r["config"]["strategy"] == strategy]
        pairs = {(c["model"], c["optimizer"]) for c in configs}
        assert pairs == {(m, o) for m in ("mlp", "cnn", "transformer") for o in ("sgd", "adam")}
        assert any(c["optimizer"] == "adam" and c["lr"] == 0.003 for c in configs), strategy
    hybrid = {
        (r["world_size"] // r["stages"], r["stages"])
        for r in every
        if r["config"]["strategy"] == "hybrid"
    }
    assert hybrid == {(2, 2), (4, 1), (1, 4)}


def test_pipeline_resume_is_bit_for_bit(grid_checks):
    checks = grid_checks.resumes(2, "pipeline")
    assert_exact_resume(checks)
    assert {c["config"]["model"] for c in checks} == {"cnn"}


@pytest.mark.parametrize(
    "strategy,schedule", [("pipeline", "gpipe"), ("pipeline", "1f1b"), ("model", "1f1b")]
)
def test_cli_pipeline_matches_the_independent_reference(
    tmp_path, cli_reference, strategy, schedule
):
    trace, gantt = tmp_path / "trace.json", tmp_path / "gantt.png"
    micro = "1" if strategy == "model" else "4"
    _, report = train_matches_reference(
        cli_reference,
        tmp_path,
        "--strategy",
        strategy,
        "--schedule",
        schedule,
        "--microbatches",
        micro,
        "--trace",
        str(trace),
        "--gantt",
        str(gantt),
        ranks=2,
    )
    assert report["partition"] == [[0, 2], [2, 4]]
    assert 0.0 <= report["bubble_measured"] < 1.0
    expected_bubble = 1 / (int(micro) + 1)  # (P-1)/(M+P-1) with P=2
    assert report["bubble_predicted"] == pytest.approx(expected_bubble)
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events} == {0, 1}
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
