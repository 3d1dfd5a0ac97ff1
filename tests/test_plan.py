"""`ringtrain plan`: the cost model on synthetic calibrations with known answers (milliseconds),
its bad inputs in one line each, and one calibration checked against the clock."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import one_line_error, ringtrain

from ringtrain.pipeline.costs import FREE_LINK, LinkModel, MeasuredCurve
from ringtrain.plan import costmodel
from ringtrain.plan.cli import fingerprint
from ringtrain.plan.costmodel import Calibration, Candidate, ElementCost

USER_MODEL, USER_DATA = "tests/user_models.py:residual_cnn", "tests/user_models.py:digits_split"

MS = 1e-3
# An executor reference run that cost nothing beyond compute and added no memory.
REFERENCE = {
    "bounds": [(0, 2), (2, 4)],
    "microbatch": 16.0,
    "seconds": {},
    "microbatches": 4,
    "added_bytes": 0,
}


def synthetic(
    params: int = 1000,
    per_sample: float = 0.1 * MS,
    link: LinkModel = FREE_LINK,
    elements: int = 4,
) -> Calibration:
    """Elements that cost F = B = per_sample a sample (BI = BW = half of B), no fixed cost, each
    with `params` weights and 10 floats in and out per sample; a stage costs its elements' sum
    and its optimizer step nothing."""
    half = per_sample / 2
    seconds = {"F": (0.0, per_sample), "B": (0.0, per_sample), "BI": (0.0, half), "BW": (0.0, half)}
    ranges = {
        (a, b): {
            "F": (0.0, (b - a) * per_sample),
            "B": (0.0, (b - a) * per_sample),
            "BW": (0.0, (b - a) * half),
            "STEP": (0.0, 0.0),
        }
        for a in range(elements)
        for b in range(a + 1, elements + 1)
    }
    return Calibration(
        model="mlp",
        dataset="digits",
        optimizer="sgd",
        elements=[ElementCost(seconds, params, 10, 10) for _ in range(elements)],
        allreduce={"intra": link, "inter": link},
        p2p={"intra": link, "inter": link},
        baseline_bytes=1000,
        step_seconds=(0.0, 2 * elements * per_sample),
        step_peak=(0, 1.0),
        stages=ranges,
        executor=[REFERENCE],
    )


def test_ring_allreduce_time_follows_the_textbook_formula():
    link = LinkModel(latency=2 * MS, bytes_per_second=1e9)
    assert costmodel.allreduce_seconds(link, 1, 10**9) == 0.0
    assert costmodel.allreduce_seconds(link, 2, 10**6) == pytest.approx(link.time(10**6))
    # 4 ranks: 6 steps of latency / 2, and 2 * 3/4 of the bytes through each link
    assert costmodel.allreduce_seconds(link, 4, 10**6) == pytest.approx(6 * MS + 1.5 * MS)


def test_a_measured_curve_is_exact_where_timed_and_straight_between():
    # a token bucket's shape: what fits the burst is fast, the rest goes at the cap
    curve = MeasuredCurve.of([(1 << 20, 40 * MS), (4096, 1 * MS), (64 << 10, 2 * MS)])
    timed = [curve.time(n) for n in (4096, 64 << 10, 1 << 20)]
    assert timed == pytest.approx([MS, 2 * MS, 40 * MS])
    assert curve.time(34 << 10) == pytest.approx(1.5 * MS, rel=0.02)  # halfway along the line
    assert curve.time(2 << 20) == pytest.approx(80 * MS, rel=0.03)  # past the end, its slope
    assert curve.time(0) >= 0.0
    # 4 ranks: 3 two-rank allreduces of half the bytes each
    assert costmodel.allreduce_seconds(curve, 4, 1 << 20) == pytest.approx(3 * curve.time(1 << 19))
    # a straight curve gives the textbook ring time
    line = LinkModel(latency=2 * MS, bytes_per_second=1e9)
    straight = MeasuredCurve.of([(n, line.time(n)) for n in (10**3, 10**7)])
    assert costmodel.allreduce_seconds(straight, 4, 10**6) == pytest.approx(6 * MS + 1.5 * MS)


def test_data_parallel_is_compute_plus_the_allreduce_and_state_is_counted():
    cal = synthetic(params=250_000, link=LinkModel(0.0, 1e9))  # 4 MB of gradients
    p = costmodel.predict_data_parallel(cal, ranks=2, nodes=1, batch=64, fp16=False)
    assert p.compute_seconds == pytest.approx(32 * 8 * 0.1 * MS)
    assert p.exposed_comm_seconds == pytest.approx(4e6 / 1e9)
    assert p.step_seconds == pytest.approx(p.compute_seconds + p.exposed_comm_seconds)
    assert p.samples_per_second == pytest.approx(64 / p.step_seconds)
    # weights + gradients (SGD: no slots) of 4 elements, each element's 20 floats for 32 samples
    assert p.peak_bytes == 1000 + 4 * 250_000 * 4 * 2 + 4 * 20 * 4 * 32
    fp16 = costmodel.predict_data_parallel(cal, ranks=2, nodes=1, batch=64, fp16=True)
    assert fp16.exposed_comm_seconds == pytest.approx(2e6 / 1e9)


def test_what_the_engine_s_step_took_beyond_its_parts_is_added_to_every_data_parallel_step():
    plain = synthetic(params=250_000, link=LinkModel(0.0, 1e9))
    parts = costmodel.predict_data_parallel(plain, ranks=2, nodes=1, batch=64, fp16=False)
    halved = costmodel.predict_data_parallel(plain, ranks=2, nodes=1, batch=64, fp16=True)
    engine = (parts.step_seconds + 1.5 * MS, halved.step_seconds + 0.5 * MS, 64, False)
    measured = replace(plain, engine_step=engine)
    assert measured.step_overhead(False) == pytest.approx(1.5 * MS)
    assert measured.step_overhead(True) == pytest.approx(0.5 * MS)  # fp16 has its own
    for ranks in (2, 4):
        for fp16, extra in ((False, 1.5 * MS), (True, 0.5 * MS)):
            base = costmodel.predict_data_parallel(plain, ranks, nodes=1, batch=64, fp16=fp16)
            more = costmodel.predict_data_parallel(measured, ranks, nodes=1, batch=64, fp16=fp16)
            assert more.step_seconds == pytest.approx(base.step_seconds + extra)
            assert more.exposed_comm_seconds == pytest.approx(base.exposed_comm_seconds + extra)
    # an engine step faster than its parts takes it off, but a step never beats its compute
    faster = replace(plain, engine_step=(parts.step_seconds - 1 * MS, 0.0, 64, False))
    assert faster.step_overhead(False) == pytest.approx(-1 * MS)
    quick = costmodel.predict_data_parallel(faster, 2, nodes=1, batch=64, fp16=False)
    assert quick.step_seconds == pytest.approx(parts.step_seconds - 1 * MS)
    floor = costmodel.predict_data_parallel(faster, 2, nodes=1, batch=64, fp16=True)
    assert floor.step_seconds == pytest.approx(parts.compute_seconds)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_a_balanced_pipeline_on_a_free_link_has_the_textbook_bubble(kind):
    cal = synthetic()
    p = costmodel.predict_pipeline(cal, Candidate(1, 2, kind, 4), nodes=1, batch=64)
    stage_f = 2 * 0.1 * MS * 16  # two elements, a microbatch of 16
    assert p.bubble == pytest.approx(1 / 5)
    assert p.step_seconds == pytest.approx(5 * 2 * stage_f)  # (M + P - 1) x (F + B)
    assert p.exposed_comm_seconds == pytest.approx(0.0, abs=1e-12)


def test_zero_bubble_idles_less_than_1f1b_at_the_same_p_and_m():
    cal = synthetic()
    one_f_one_b = costmodel.predict_pipeline(cal, Candidate(1, 4, "1f1b", 8), 1, 64)
    zb = costmodel.predict_pipeline(cal, Candidate(1, 4, "zb-h1", 8), 1, 64)
    assert zb.bubble < one_f_one_b.bubble


def test_the_crossover_data_parallel_on_a_fast_link_a_pipeline_on_a_slow_one():
    heavy = 2_000_000  # 32 MB of gradients; a step's compute is 26 ms on each of 2 ranks
    fast = synthetic(params=heavy, link=LinkModel(10e-6, 100e9))
    slow = synthetic(params=heavy, link=LinkModel(100e-6, 25e6))
    assert costmodel.plan(fast, 2, 1, 64)[0].candidate.strategy == "data"
    assert costmodel.plan(slow, 2, 1, 64)[0].candidate.strategy == "pipeline"


def test_memory_below_the_data_parallel_footprint_excludes_it_and_the_first_plan_fits():
    cal = synthetic(params=1_000_000, link=LinkModel(0.0, 1e12))
    everything = costmodel.plan(cal, 2, 1, 64)
    data = next(p for p in everything if p.candidate.strategy == "data")
    assert everything[0] is data  # the fastest on a free link
    limited = costmodel.plan(cal, 2, 1, 64, memory_per_rank=data.peak_bytes - 1)
    assert all(not p.fits for p in limited if p.candidate.pp_size == 1)
    assert limited[0].fits and limited[0].candidate.strategy == "pipeline"


def test_hybrid_grids_are_candidates_when_the_ranks_allow():
    found = {(c.dp_size, c.pp_size) for c in costmodel.candidates(4, 4, [2])}
    assert found == {(4, 1), (2, 2), (1, 4)}
    hybrid = costmodel.predict_pipeline(synthetic(), Candidate(2, 2, "1f1b", 2), 2, 64)
    assert hybrid.candidate.flags() == [
        *["--strategy", "hybrid", "--pp-size", "2", "--schedule", "1f1b", "--microbatches", "2"]
    ]
    assert hybrid.step_seconds > 0


# ---- the command line -----------------------------------------------------------------------


def _calibration_file(tmp_path: Path, **changes) -> Path:
    cal = synthetic()
    doc = {
        "format": costmodel.FORMAT,
        "model": "mlp",
        "dataset": "digits",
        "optimizer": "sgd",
        "fingerprint": fingerprint(),
        "elements": [
            {
                "seconds": {op: list(v) for op, v in e.seconds.items()},
                "params": e.params,
                "input_floats": e.input_floats,
                "output_floats": e.output_floats,
            }
            for e in cal.elements
        ],
        "step_seconds": list(cal.step_seconds),
        "engine_step_seconds": {"float32": 0.0, "fp16": 0.0},
        "batch_size": 64,
        "compute_measured": "intra",
        "step_peak": list(cal.step_peak),
        "executor": [REFERENCE],
        "stages": [
            {"start": a, "end": b, "seconds": {op: list(v) for op, v in fits.items()}}
            for (a, b), fits in cal.stages.items()
        ],
        "baseline_bytes": cal.baseline_bytes,
        "allreduce": {"intra": MeasuredCurve.of([(4096, 1e-4), (1 << 20, 1.1e-3)]).to_json()},
        "p2p": {"intra": LinkModel(1e-5, 1e9).to_json()},
        **changes,
    }
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(doc))
    return path


def test_plan_prints_the_table_and_one_command_and_json_gives_the_same(tmp_path):
    path = _calibration_file(tmp_path)
    done = ringtrain("plan", "--calibration", str(path), "--optimizer", "sgd")
    assert done.returncode == 0, done.stderr
    last = done.stdout.splitlines()[-1]
    assert last.startswith("recommended: mpirun -np 2 ringtrain train --model mlp")
    data = ringtrain("plan", "--calibration", str(path), "--optimizer", "sgd", "--json")
    table = json.loads(data.stdout)
    assert table["recommended"] == last.removeprefix("recommended: ")
    assert {row["configuration"] for row in table["candidates"]} >= {"data", "pipeline 1f1b M=4"}


@pytest.mark.parametrize(
    "flags,changes,needle",
    [
        ([], {"cpu_model": "another CPU"}, "calibrated on another machine (cpu_model"),
        (["--model", "cnn"], {}, "calibrated for model 'mlp' on 'digits', not 'cnn'"),
        ([], {"elements": "garbage"}, "damaged calibration"),
        ([], {"format": "something else"}, "damaged calibration"),
        ([], {"format": "ringtrain-calibration/1"}, "calibration format ringtrain-calibration/1"),
        (["--grid", "2x2"], {}, "grid 2x2 needs 4 ranks, but --nodes x --ranks-per-node gives 2"),
        (["--memory-per-rank", "0"], {}, "a rank's memory must be above zero"),
        (["--memory-per-rank", "1K"], {}, "nothing fits in 1024 bytes per rank"),
        (["--nodes", "2"], {}, "the calibration has no across-node figures"),
        (["--optimizer", "adam"], {}, "calibrated with optimizer 'sgd', not 'adam'"),
        (["--batch-size", "0"], {}, "--batch-size must be at least 1"),
        (["--model", "resnet"], {}, "unknown model 'resnet'; choose one of mlp"),
        (
            ["--model", USER_MODEL, "--optimizer", "sgd"],
            {},
            "--optimizer does not apply to a compiled model",
        ),
        (["--model-arg", "units=3"], {}, "--model-arg needs --model PATH.py:FUNCTION"),
        (["--model", USER_MODEL, "--data", USER_DATA, "--dataset", "synthetic"], {}, "not both"),
        (
            ["--model", USER_MODEL, "--model-arg", "optimizer='sgd'"],
            {"model": USER_MODEL, "optimizer": "compiled"},
            f"calibrated for model '{USER_MODEL}' on 'digits', not",
        ),
    ],
)
def test_bad_plan_inputs_say_one_line(tmp_path, flags, changes, needle):
    if "--optimizer" not in flags and USER_MODEL not in flags:
        flags = [*flags, "--optimizer", "sgd"]
    stamp = {**fingerprint(), **{k: v for k, v in changes.items() if k == "cpu_model"}}
    rest = {k: v for k, v in changes.items() if k != "cpu_model"}
    path = _calibration_file(tmp_path, fingerprint=stamp, **rest)
    one_line_error(ringtrain("plan", "--calibration", str(path), *flags), needle)


def test_plan_calibrates_a_users_model_and_its_recommended_line_trains_it(tmp_path):
    """`plan calibrate --model FUNCTION --data FUNCTION` measures the user's graph (its blocks
    between valid cuts are the units a pipeline groups), and `plan` recommends a line that
    names the same model, arguments and data, and runs."""
    path = tmp_path / "calibration.json"
    source = ["--model", USER_MODEL, "--model-arg", "optimizer=nesterov", "--data", USER_DATA]
    flags = [*source, "--batch-size", "64", "--calibration", str(path)]
    done = ringtrain("plan", "calibrate", *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(path.read_text())
    assert doc["model"] == f"{USER_MODEL} optimizer=nesterov" and doc["dataset"] == USER_DATA
    assert doc["optimizer"] == "compiled" and doc["optimizer_slots"] == 1.0  # SGD's momentum
    assert len(doc["elements"]) >= 3 and all("seconds" in e for e in doc["elements"])
    table = json.loads(ringtrain("plan", *flags, "--json").stdout)
    assert any(row["stages"] == 2 for row in table["candidates"])
    recommended = shlex.split(table["recommended"])
    assert recommended[:5] == ["mpirun", "-np", "2", "ringtrain", "train"]
    assert recommended[5:11] == source
    ran = ringtrain(*recommended[4:], "--steps", "3", ranks=2)
    assert ran.returncode == 0, ran.stderr[-3000:]


def test_an_unreadable_calibration_file_says_so(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text("{not json")
    one_line_error(ringtrain("plan", "--calibration", str(path)), "unreadable calibration")
    one_line_error(
        ringtrain("plan", "--calibration", str(tmp_path / "none.json")), "no calibration file"
    )


def test_the_runtime_share_of_memory_is_the_measured_step_less_the_model_own():
    base = synthetic(params=250_000)
    model_at_32 = 4 * 250_000 * 4 * 2 + 4 * 20 * 4 * 32
    measured = Calibration(**{**base.__dict__, "step_peak": (model_at_32 + 5_000_000, 32.0)})
    assert measured.runtime_bytes == 5_000_000
    p = costmodel.predict_data_parallel(measured, ranks=4, nodes=1, batch=64, fp16=False)
    assert p.peak_bytes == 1000 + 5_000_000 + 4 * 250_000 * 4 * 2 + 4 * 20 * 4 * 16


def test_the_executor_overhead_is_the_reference_runs_beyond_their_compute():
    """Reference runs at microbatches 8 and 32 whose F took 1 ms and 2 ms more than the
    stage's compute, whose receives took 0.2 ms of host work: a microbatch of 16 pays
    4/3 ms on each F and the receive's 0.2 ms."""
    base = synthetic()

    def reference(microbatch: float, extra: float) -> dict:
        compute = 2 * 0.1 * MS * microbatch  # a stage of two elements
        seconds = {"0F": compute + extra, "1F": compute + extra, "1RECV_ACT": 0.2 * MS}
        return {**REFERENCE, "microbatch": microbatch, "seconds": seconds}

    cal = Calibration(**{**base.__dict__, "executor": [reference(8, MS), reference(32, 2 * MS)]})
    last = costmodel.executor_overhead(cal, first=False, last=True, microbatch=16)
    assert last["F"] == pytest.approx(4 / 3 * MS)
    assert last["RECV_ACT"] == pytest.approx(0.2 * MS)
    assert last["B"] == last["STEP"] == 0.0
    plain = costmodel.predict_pipeline(base, Candidate(1, 2, "gpipe", 4), 1, 64)
    slower = costmodel.predict_pipeline(cal, Candidate(1, 2, "gpipe", 4), 1, 64)
    assert slower.step_seconds > plain.step_seconds + 4 * 4 / 3 * MS


def test_a_sharded_optimizer_divides_the_slots_and_is_recommended_only_when_it_alone_fits():
    """Adam's two slots per weight, divided among 4 replicas; the same collective bytes (a
    reduce-scatter and an all-gather are the two halves of a ring allreduce)."""
    cal = replace(synthetic(params=250_000, link=LinkModel(0.0, 1e9)), optimizer="adam")
    plain = costmodel.predict_data_parallel(cal, 4, nodes=1, batch=64, fp16=False)
    sharded = costmodel.predict_data_parallel(cal, 4, nodes=1, batch=64, fp16=False, shard=True)
    slots = 4 * 250_000 * 2 * 4  # four elements' weights, two slots each, four bytes a word
    assert plain.peak_bytes - sharded.peak_bytes == slots - slots // 4
    assert sharded.step_seconds == pytest.approx(plain.step_seconds)
    assert sharded.candidate.flags() == ["--strategy", "data", "--shard-optimizer"]
    roomy = costmodel.plan(cal, nodes=1, ranks_per_node=4, batch=64)
    assert not roomy[0].candidate.shard_optimizer  # a tie goes to the plain run
    tight = costmodel.plan(
        cal, nodes=1, ranks_per_node=4, batch=64, memory_per_rank=sharded.peak_bytes
    )
    fitting = [p for p in tight if p.fits and p.candidate.pp_size == 1]
    assert fitting and all(p.candidate.shard_optimizer for p in fitting)


def test_a_hybrid_grid_may_share_each_stages_slots_among_its_replicas():
    """2 x 2: each stage holds two elements' weights; sharded, its two replicas keep half of
    its Adam slots each, in the same time."""
    cal = replace(synthetic(params=250_000, link=LinkModel(0.0, 1e9)), optimizer="adam")
    plain = costmodel.predict_pipeline(cal, Candidate(2, 2, "1f1b", 4), nodes=1, batch=64)
    grid = Candidate(2, 2, "1f1b", 4, shard_optimizer=True)
    sharded = costmodel.predict_pipeline(cal, grid, nodes=1, batch=64)
    assert plain.peak_bytes - sharded.peak_bytes == 2 * 250_000 * 2 * 4 // 2
    assert sharded.step_seconds == pytest.approx(plain.step_seconds)
    assert grid.flags()[-1] == "--shard-optimizer" and "sharded optimizer" in grid.label()
    listed = costmodel.candidates(4, elements=4, microbatch_counts=[4])
    assert grid in listed and Candidate(1, 4, "1f1b", 4, shard_optimizer=True) not in listed
