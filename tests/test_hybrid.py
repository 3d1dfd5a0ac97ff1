"""Hybrid parallelism: D pipeline replicas x P stages equal a plain TensorFlow loop."""

from __future__ import annotations

import json

import pytest
from conftest import (
    assert_exact_resume,
    assert_matches_reference,
    one_line_error,
    ringtrain,
    train_matches_reference,
)

from ringtrain.pipeline.grid import Grid


@pytest.mark.mpi
def test_hybrid_grids_2x2_4x1_1x4_match_the_independent_reference(grid_checks):
    results = grid_checks.results(4, "hybrid")
    assert_matches_reference(results)
    assert {r["pp_size"] for r in results} == {1, 2, 4}
    for r in results:
        grid = Grid(4, r["pp_size"])
        sums = r["replica_checksums"]  # every replica of a stage holds the same weights
        for ranks in grid.dp_groups():
            assert len({sums[rank] for rank in ranks}) == 1, r


@pytest.mark.mpi
def test_hybrid_resume_is_bit_for_bit(grid_checks):
    checks = grid_checks.resumes(4, "hybrid")
    assert_exact_resume(checks)
    assert {c["config"]["model"] for c in checks} == {"transformer"}


@pytest.mark.mpi
def test_cli_hybrid_matches_the_independent_reference(tmp_path, cli_reference):
    done, report = train_matches_reference(
        cli_reference,
        tmp_path,
        "--strategy",
        "hybrid",
        "--pp-size",
        "2",
        "--microbatches",
        "4",
        ranks=4,
    )
    assert "pipeline 1: ranks [2, 3]" in done.stdout
    assert report["dp_size"] == 2 and report["pp_size"] == 2
    assert "bubble_measured" in report and "bubble_predicted" in report


@pytest.mark.mpi
def test_last_stage_allreduce_starts_while_stage_0_still_runs_its_last_backward(tmp_path):
    """No barrier before the replica allreduce: the trace shows it overlapping stage 0's work.
    Microbatches of 128 transformer examples make that backward last far longer than the
    scheduling noise of 4 ranks on 2 cores. A barrier would forbid the overlap in every step;
    on a loaded machine (4 ranks on 2 cores) most steps can lose it to scheduling alone (a CI
    run saw it in 1 of 8), so the claim is that it shows in at least one of the 8 steps after
    the first."""
    trace = tmp_path / "t.json"
    done = ringtrain(
        "train",
        "--strategy",
        "hybrid",
        "--pp-size",
        "2",
        "--model",
        "transformer",
        "--batch-size",
        "512",
        "--microbatches",
        "2",
        "--steps",
        "9",
        "--trace",
        str(trace),
        ranks=4,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["pid"] == 0]
    overlapping = 0
    for step in range(1, 9):
        mine = [e for e in events if e["args"]["step"] == step]
        allreduce = min(e["ts"] for e in mine if e["tid"] == 1 and e["name"] == "ALLREDUCE")
        backward_end = max(
            e["ts"] + e["dur"] for e in mine if e["tid"] == 0 and e["name"].startswith("0B")
        )
        overlapping += allreduce < backward_end
    assert overlapping >= 1, overlapping


@pytest.mark.parametrize(
    "ranks,args,needle",
    [
        (3, ["--pp-size", "2"], "world size 3 is not divisible by --pp-size 2"),
        (
            2,
            [
                "--pp-size",
                "2",
                "--model",
                "transformer",
                "--batch-size",
                "3",
                "--microbatches",
                "4",
            ],
            "global batch 3 is smaller than the 4 shares it is cut into",
        ),
    ],
)
def test_hybrid_bad_grids_fail_on_every_rank(ranks, args, needle):
    done = ringtrain(
        "train", "--strategy", "hybrid", "--steps", "1", *args, ranks=ranks, timeout=120
    )
    one_line_error(done, needle)


def test_grid_of_8_ranks_as_2_pipelines_of_4_keeps_pipelines_on_consecutive_ranks():
    grid = Grid(8, 4)
    print(grid.describe())
    assert grid.pipeline_ranks(0) == [0, 1, 2, 3] and grid.pipeline_ranks(1) == [4, 5, 6, 7]
    assert grid.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [grid.pp_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [grid.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
