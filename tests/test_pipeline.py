"""Model and pipeline parallelism over mpi4py equal a plain TensorFlow loop."""

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

from ringtrain.errors import EXIT_USAGE
from ringtrain.pipeline.ir import Op, Schedule
from ringtrain.pipeline.schedule import build_schedule

pytestmark = pytest.mark.mpi
STRATEGIES = ("single", "data", "model", "pipeline", "hybrid")


def rank_peaks(schedule: Schedule) -> list[int]:
    """Per rank, the most microbatches held between a forward and the end of its backward,
    over all the rank's stages: what the executor reports as peak_inflight."""
    peaks = []
    for row in schedule.actions:
        held = peak = 0
        for a in row:
            held += (a.op is Op.F) - a.op.ends_microbatch
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("pp_size", [2, 3, 4])
def test_pipeline_and_model_parallel_match_the_independent_reference(pp_size, grid_checks):
    results = grid_checks.results(pp_size, "pipeline", "model")
    assert_matches_reference(results)
    for r in results:
        c, m = r["config"], r["config"]["microbatches"]
        assert r["pp_size"] == pp_size
        schedule = build_schedule(c["schedule"], pp_size, m, c["virtual_stages"])
        assert r["peak_inflight"] == rank_peaks(schedule), r
        # Memory: 1F1B holds at most min(P - s, M) microbatches at stage s, GPipe holds M,
        # ZB-H1 at most P on every stage.
        if c["schedule"] in ("gpipe", "1f1b"):
            expected = [
                m if c["schedule"] == "gpipe" else min(pp_size - s, m) for s in range(pp_size)
            ]
            assert r["peak_inflight"] == expected, r
        if c["schedule"] == "zb-h1":
            assert max(r["peak_inflight"]) <= pp_size, r
        if c["schedule"] == "1f1b-ahead":  # one more than 1F1B on every stage but the last
            ahead = [min(pp_size - s + 1, m) for s in range(pp_size - 1)]
            assert r["peak_inflight"] == [*ahead, 1], r
    kinds = {(r["config"]["strategy"], r["config"]["schedule"]) for r in results}
    assert {("model", "1f1b"), ("pipeline", "gpipe"), ("pipeline", "1f1b")} <= kinds
    if pp_size < 4:
        assert ("pipeline", "1f1b-ahead") in kinds
    assert any(r["config"]["microbatches"] in (3, 5) for r in results)  # odd M
    if pp_size == 2:
        assert any(r["config"]["sync_sends"] for r in results)  # Ssend: no reliance on buffering
        assert any(r["config"]["clip_norm"] for r in results)


def test_interleaved_and_zero_bubble_cover_their_grid(grid_checks):
    """Exactness is checked above; here, that the grid holds the cases the schedules need:
    interleaved P=2 V=2 at M = 2, 4, 6; ZB-H1 at P = 2, 3, 4 and M = 1, 3, 8; each on mlp and
    transformer with SGD and Adam; each once with and without --recompute."""
    every = [r for ranks in (2, 3, 4) for r in grid_checks.results(ranks, "pipeline")]
    runs = {kind: [r for r in every if r["config"]["schedule"] == kind] for kind in SPLIT}
    interleaved = {(r["pp_size"], r["config"]["virtual_stages"]) for r in runs["interleaved"]}
    assert interleaved == {(2, 2)}
    assert {r["config"]["microbatches"] for r in runs["interleaved"]} == {2, 4, 6}
    cells = {(r["pp_size"], r["config"]["microbatches"]) for r in runs["zb-h1"]}
    assert cells == {(p, m) for p in (2, 3, 4) for m in (1, 3, 8)}
    for kind, results in runs.items():
        pairs = {(r["config"]["model"], r["config"]["optimizer"]) for r in results}
        assert pairs == {(m, o) for m in ("mlp", "transformer") for o in ("sgd", "adam")}, kind
        configs = [r["config"] for r in results]
        twins = [c for c in configs if c["recompute"] and {**c, "recompute": False} in configs]
        assert twins, kind
    assert all(  # the default: activations kept, no forward redone
        r["config"]["recompute"] is False for r in every if r["config"]["schedule"] == "1f1b"
    )
    threaded = {r["pp_size"] for r in every if r["config"]["mpi_progress"] == "thread"}
    assert threaded == {2, 4}  # exact with a progress thread inside MPI during compute


SPLIT = ("interleaved", "zb-h1")


def test_every_strategy_meets_every_model_and_optimizer_at_the_default_adam_lr(grid_checks):
    every = [r for ranks in (1, 2, 3, 4) for r in grid_checks.results(ranks, *STRATEGIES)]
    for strategy in STRATEGIES:
        configs = [r["config"] for r in every if r["config"]["strategy"] == strategy]
        pairs = {(c["model"], c["optimizer"]) for c in configs}
        assert pairs == {(m, o) for m in ("mlp", "cnn", "transformer") for o in ("sgd", "adam")}
        assert any(c["optimizer"] == "adam" and c["lr"] == 0.003 for c in configs), strategy
    hybrid = {
        (r["world_size"] // r["pp_size"], r["pp_size"])
        for r in every
        if r["config"]["strategy"] == "hybrid"
    }
    assert hybrid == {(2, 2), (4, 1), (1, 4)}


def test_pipeline_resume_is_bit_for_bit_and_keeps_the_checkpoints_partition(grid_checks):
    checks = grid_checks.resumes(2, "pipeline") + grid_checks.resumes(3, "pipeline")
    assert_exact_resume(checks)
    assert {(c["config"]["model"], c["config"]["schedule"]) for c in checks} == {
        ("cnn", "1f1b"),
        ("mlp", "interleaved"),  # a checkpoint part per rank of two stages each
        ("transformer", "zb-h1"),
    }
    for c in checks:  # resumed under the default (time) partition, it kept the stored one
        full, resumed = c["partitions"]
        assert full == resumed, c
    # params splits 4 elements over 3 stages unlike uniform: the reuse is not a coincidence
    assert [[0, 1], [1, 2], [2, 4]] in [c["partitions"][1] for c in checks]


# 1F1B through the CLI is test_your_model.py's pipeline launch; the grid holds every schedule.
@pytest.mark.parametrize("strategy,schedule", [("pipeline", "gpipe"), ("model", "1f1b")])
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
        "--partition",
        "uniform",
        ranks=2,
    )
    assert report["partition"] == [[0, 2], [2, 4]]
    assert 0.0 <= report["bubble_measured"] < 1.0
    expected_bubble = 1 / (int(micro) + 1)  # (P-1)/(M+P-1) with P=2
    assert report["bubble_predicted_unit_costs"] == pytest.approx(expected_bubble)
    # The prediction from the run's own calibration: 3 steps spread through it, after the one
    # that traced the graphs, and a ping-pong.
    assert 0.0 <= report["bubble_predicted"] < 1.0 and report["step_time_predicted"] > 0
    assert report["calibration"]["link"]["bytes_per_second"] > 0
    steps = report["calibration"]["steps"]
    assert len(steps) == 3 and steps[0] == 1 and steps == sorted(set(steps))
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events} == {0, 1}
    # Every action's time split three ways; a computation's fixed part is its 1-example time,
    # a receive's wait its time blocked, and the three add up to the action's whole.
    for e in events:
        split = [e["args"][k] for k in ("compute_ms", "fixed_ms", "wait_ms")]
        assert min(split) >= 0 and sum(split) == pytest.approx(e["dur"] / 1e3, abs=1e-6)
    named = {e["name"]: e["args"] for e in events}
    assert named["0F0"]["fixed_ms"] > 0 and named["0F0"]["wait_ms"] == 0
    assert any(e["args"]["wait_ms"] > 0 for e in events if "RA" in e["name"])
    costs = report["calibration"]["action_costs_ms"]  # per stage, per kind of action
    assert {"F", "B", "SA", "RG"} <= costs["0"].keys() and {"F", "B", "RA", "SG"} <= costs[
        "1"
    ].keys()
    assert costs["0"]["F"]["fixed_ms"] > 0 and report["calibration"]["call_floor_ms"] > 0
    assert set(report["calibration"]["fixed_ms_per_microbatch"]) == {"0", "1"}
    assert all(v > 0 for v in report["calibration"]["fixed_ms_per_microbatch"].values())
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_runs_a_schedule_file_equal_to_1f1b_exactly(tmp_path, cli_reference):
    printed = ringtrain(
        "schedule", "--kind", "1f1b", "--stages", "2", "--microbatches", "4", "--json"
    )
    assert printed.returncode == 0, printed.stderr
    path = tmp_path / "mine.json"
    path.write_text(printed.stdout)
    _, report = train_matches_reference(
        cli_reference, tmp_path, "--strategy", "pipeline", "--schedule", str(path), ranks=2
    )
    assert report["schedule"] == str(path) and report["stage_ranks"] == [0, 1]


@pytest.mark.parametrize(
    "ranks,micro,swap,needle",
    [
        (2, 4, True, "rank 1 action 0 (1F0): runs before receiving its activation"),
        (3, 4, False, "is for 3 pipeline ranks, but this run has 1"),
        (1, 65, False, "global batch 64 is smaller than the 65 shares"),  # the file's M
    ],
)
def test_cli_refuses_a_bad_schedule_file_in_one_line(tmp_path, ranks, micro, swap, needle):
    printed = ringtrain("schedule", "--kind", "1f1b", "-P", str(ranks), "-M", str(micro), "--json")
    doc = json.loads(printed.stdout)
    if swap:  # rank 1 computes microbatch 0 before receiving its activation
        doc["actions"][1][:2] = doc["actions"][1][1::-1]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    done = ringtrain("train", "--strategy", "pipeline", "--schedule", str(path))
    one_line_error(done, needle)
    assert done.returncode == EXIT_USAGE
    assert len([line for line in done.stderr.splitlines() if line.strip()]) == 1, done.stderr


def test_kept_activations_give_a_tapes_gradients():
    """The forward/backward pair a stage calls without a tape (TensorFlow's own, reached
    through a private class: pinned, so a change of TensorFlow's shows here first) gives a
    tape's gradients, for the input and, summed over the microbatches, for every weight.
    Their sizes differ, as a partial batch's do: a third size reuses the relaxed trace."""
    import numpy as np

    from ringtrain.keras_model.graph import split_graph
    from ringtrain.models import compile_classifier, transformer
    from ringtrain.pipeline.split import GraphPlan
    from ringtrain.tensorflow_loader import tf

    model = compile_classifier(transformer((8, 8, 1), 10))
    plan = GraphPlan(model, split_graph(model, np.zeros((4, 8, 8, 1), np.float32)))
    bounds = [(0, 1), (1, 3), (3, 4)]  # a middle stage and a last one
    share = np.float32(0.25)  # each of four microbatches
    for index in (1, 2):
        stage = plan.build(index, bounds, microbatches=4)
        expected_sums, input_grads = None, []
        for size in (5, 3, 4, 3):
            x, y = plan.stand_in(bounds, index, size), tf.constant(np.arange(size) % 10)
            upstream = (
                None
                if stage.last
                else (tf.random.stateless_normal((size, 8, 32), seed=(index, size)),)
            )
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = stage.output(x, y, share)
            *grads, to_input = tape.gradient(out, [*stage.variables, *x], upstream)
            expected_sums = (
                grads
                if expected_sums is None
                else [a + b for a, b in zip(expected_sums, grads, strict=True)]
            )
            made, kept = stage.forward_keeping(x, y, share)
            for got, want in zip(tf.nest.flatten(made), tf.nest.flatten(out), strict=True):
                np.testing.assert_array_equal(got.numpy(), want.numpy())
            input_grads.append((stage.backward(kept, x, y, share, upstream)[0], to_input))
        for got, want in input_grads:
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)
        for got, want in zip(stage.summed_gradients(), expected_sums, strict=True):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-7)
