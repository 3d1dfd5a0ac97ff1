"""Pipeline schedules are plain data: valid, deadlock-free and with the textbook bubbles."""

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ringtrain import cli
from ringtrain.errors import UserError
from ringtrain.pipeline.calibrate import calibration_steps, stage_seconds, step_actions
from ringtrain.pipeline.costs import LinkModel, predict, predict_from_steps
from ringtrain.pipeline.generators import SCHEDULES
from ringtrain.pipeline.interpreter import interpret
from ringtrain.pipeline.ir import (
    Action,
    Op,
    Schedule,
    parse_action,
    schedule_from_json,
    schedule_to_json,
)
from ringtrain.pipeline.lower import naive_lowering, send_when_made
from ringtrain.pipeline.schedule import build_schedule, load_schedule_file
from ringtrain.pipeline.simulate import SimResult, simulate, unit_cost
from ringtrain.pipeline.trace import OPS, measured_step_seconds
from ringtrain.pipeline.validate import validate

REPO = Path(__file__).resolve().parents[1]
GRID = [(p, m) for p in range(1, 9) for m in range(1, 33)]


def built(kind: str, p: int, m: int, v: int = 1) -> tuple[Schedule, SimResult]:
    """Each schedule is built and simulated once for all the tests below."""
    return _built(kind, p, m, v)


@functools.cache
def _built(kind: str, p: int, m: int, v: int) -> tuple[Schedule, SimResult]:
    schedule = build_schedule(kind, p, m, v)
    return schedule, simulate(schedule)


def every_generated_schedule():
    for p, m in GRID:
        for kind in ("gpipe", "1f1b", "1f1b-ahead", "zb-h1"):
            yield kind, p, m, 1
        if m % p == 0:
            yield "interleaved", p, m, 2
    for p, m, v in [(2, 4, 3), (4, 8, 4), (3, 9, 3), (8, 16, 3)]:
        yield "interleaved", p, m, v


def compute_order(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in row if a.op.is_compute) for row in schedule.actions]


def test_every_generated_schedule_up_to_8_stages_and_32_microbatches_is_valid():
    """Valid includes running to the end with blocking sends: no deadlock."""
    for kind, p, m, v in every_generated_schedule():
        validate(built(kind, p, m, v)[0])


def test_gpipe_and_1f1b_unit_cost_bubble_makespan_and_peak_inflight_match_the_formulas():
    for p, m in GRID:
        for kind in ("gpipe", "1f1b"):
            result = built(kind, p, m)[1]
            assert result.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (kind, p, m)
            assert result.makespan == 2 * (m + p - 1), (kind, p, m)
            expected = [m] * p if kind == "gpipe" else [min(p - s, m) for s in range(p)]
            assert result.peak_inflight == expected, (kind, p, m)


def test_interleaved_bubble_is_below_1f1b_and_shrinks_v_times():
    """Megatron's figure: the warm-up costs (P-1)/V of a microbatch, so the bubble is
    (P-1)/(V*M + P-1) against 1F1B's (P-1)/(M + P-1)."""
    for kind, p, m, v in every_generated_schedule():
        if kind != "interleaved" or p == 1:
            continue
        result = built(kind, p, m, v)[1]
        assert result.bubble < built("1f1b", p, m)[1].bubble, (p, m, v)
        assert result.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9), (p, m, v)


def test_zb_h1_bubble_is_below_1f1b_with_the_same_peak_inflight_activations():
    """The peak is 1F1B's, P (its first stage's), on every stage; from M >= P on, the idle
    time per rank is (P-1)(F + BI - BW) = P-1 at unit costs instead of 1F1B's 2(P-1)."""
    for p, m in GRID:
        if p == 1:
            continue
        zb, one_f_one_b = built("zb-h1", p, m)[1], built("1f1b", p, m)[1]
        assert zb.bubble < one_f_one_b.bubble, (p, m)
        assert max(zb.peak_inflight) == max(one_f_one_b.peak_inflight) == min(p, m), (p, m)
        assert zb.peak_inflight == [min(p, m)] * p, (p, m)
        if m >= p:
            assert zb.makespan == 2 * m + p - 1, (p, m)


def test_bubbles_at_4_stages_and_8_microbatches():
    bubbles = {kind: built(kind, 4, 8, 2 if kind == "interleaved" else 1)[1] for kind in SCHEDULES}
    assert bubbles["gpipe"].bubble == bubbles["1f1b"].bubble == pytest.approx(3 / 11)
    assert bubbles["interleaved"].bubble == pytest.approx(3 / 19)
    assert bubbles["zb-h1"].bubble == pytest.approx(3 / 19)


class _Latency:
    """A wire on which every message takes the same time, whatever its size."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def wire(self) -> "_Latency":
        return self

    def carry(self, nbytes: float, leaves: float) -> float:
        return self.seconds


@pytest.mark.parametrize("p,m", [(2, 8), (3, 8), (4, 16)])
def test_one_microbatch_ahead_hides_the_hand_off_latency_that_1f1b_waits_for(p, m):
    """Alike under unit costs; with sends as the executor makes them (Isend when made) and a
    latency on every message, 1F1B's steady state waits for a gradient then an activation per
    microbatch, and 1f1b-ahead, holding one microbatch more on all but the last stage, less."""
    one, ahead = (send_when_made(built(kind, p, m)[0]) for kind in ("1f1b", "1f1b-ahead"))
    assert simulate(ahead).bubble == pytest.approx(simulate(one).bubble)
    assert simulate(ahead).peak_inflight == [min(p - s + 1, m) for s in range(p - 1)] + [1]
    slow = _Latency(0.2)  # a fifth of a microbatch's F
    assert simulate(ahead, link=slow).makespan < simulate(one, link=slow).makespan


def test_simulator_takes_measured_costs_and_a_link_s_time_by_bytes():
    """GPipe with B = 2F takes 3(M+P-1); a message of stage 0's 50 bytes at 100 bytes per
    unit adds half a unit on the way down and again on the way up."""
    gpipe = built("gpipe", 3, 4)[0]
    slow_backward = simulate(gpipe, cost=lambda a: {"F": 1.0, "B": 2.0}.get(a.op, 0.0))
    assert slow_backward.makespan == 3 * (4 + 3 - 1)
    one = built("1f1b", 2, 1)[0]
    timed = simulate(one, link=LinkModel(0.0, 100.0), boundary_bytes=[50])
    assert timed.makespan == 4 + 0.5 + 0.5
    assert timed.timeline[1] == [("1F0", 1.5, 2.5), ("1B0", 2.5, 3.5)]


def test_a_link_carries_one_message_at_a_time_in_each_direction():
    """GPipe, P=2, M=3 with free computations and a unit per message: the three activations
    posted at once arrive at 1, 2 and 3, and the three gradients, posted at 3, at 4, 5 and 6."""
    gpipe = built("gpipe", 2, 3)[0]
    timed = simulate(gpipe, cost=lambda a: 0.0, link=LinkModel(1.0, float("inf")))
    assert timed.makespan == 6.0
    assert [start for _, start, _ in timed.timeline[1][:3]] == [1.0, 2.0, 3.0]


HAND_TABLES = {
    ("gpipe", 2, 4): ["0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3", "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3"],
    ("1f1b", 2, 4): ["0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3", "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"],
    ("1f1b", 4, 8): [
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7",
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7",
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7",
    ],
    # stage s runs each BW s microbatches after its BI
    ("zb-h1", 2, 4): [
        "0F0 0F1 0BI0 0BW0 0F2 0BI1 0BW1 0F3 0BI2 0BW2 0BI3 0BW3",
        "1F0 1BI0 1F1 1BI1 1BW0 1F2 1BI2 1BW1 1F3 1BI3 1BW2 1BW3",
    ],
    # rank r holds stages r and r + 2; groups of 2 microbatches go through both
    ("interleaved", 2, 4): [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ],
}


@pytest.mark.parametrize("key", list(HAND_TABLES), ids=lambda k: f"{k[0]}-P{k[1]}-M{k[2]}")
def test_compute_order_equals_hand_derived_table(key):
    kind, p, m = key
    schedule = built(kind, p, m, 2 if kind == "interleaved" else 1)[0]
    assert compute_order(schedule) == HAND_TABLES[key]


def test_interleaved_places_stage_s_on_rank_s_mod_p():
    schedule = built("interleaved", 4, 8, 3)[0]
    assert schedule.stage_ranks == (0, 1, 2, 3) * 3
    for r, row in enumerate(schedule.actions):
        assert {a.stage for a in row} == {r, r + 4, r + 8}


def test_1f1b_lowering_at_2_stages_sends_where_the_peer_needs_it_then_reduces_and_steps():
    rows = [" ".join(str(a) for a in row) for row in built("1f1b", 2, 4)[0].actions]
    assert rows == [
        "0F0 0SA0 0F1 0RG0 0SA1 0B0 0F2 0RG1 0SA2 0B1 0F3 0RG2 0SA3 0B2 0RG3 0B3 0REDUCE 0STEP",
        "1RA0 1F0 1B0 1SG0 1RA1 1F1 1B1 1SG1 1RA2 1F2 1B2 1SG2 1RA3 1F3 1B3 1SG3 1REDUCE 1STEP",
    ]


def test_early_sends_keep_every_action_and_run_with_buffered_sends_everywhere():
    """What the executor runs with Isend: each send right after the computation that made its
    tensor, the rest of every list in its order, runnable without blocking sends; at 2
    stages 1F1B's stage 0 no longer holds activation i + 1 back until gradient i arrives."""
    for kind, p, m, v in every_generated_schedule():
        schedule = built(kind, p, m, v)[0]
        early = send_when_made(schedule)
        for row, moved in zip(schedule.actions, early.actions, strict=True):
            assert sorted(map(str, row)) == sorted(map(str, moved))
            rest = [a for a in row if not a.op.is_send]
            assert rest == [a for a in moved if not a.op.is_send]
        interpret(early.stage_ranks, early.actions, unit_cost(early.stage_ranks), blocking=False)
    rank0 = " ".join(str(a) for a in send_when_made(built("1f1b", 2, 4)[0]).actions[0])
    assert rank0.startswith("0F0 0SA0 0F1 0SA1 0RG0 0B0 0F2 0SA2 0RG1")


def test_zb_h1_sends_the_gradient_after_bi_and_reduces_after_the_last_bw():
    rank1 = [str(a) for a in built("zb-h1", 2, 4)[0].actions[1]]
    assert rank1.index("1SG0") == rank1.index("1BI0") + 1
    assert rank1[-3:] == ["1BW3", "1REDUCE", "1STEP"]


def test_stages_on_one_rank_hand_off_in_memory_without_messages():
    schedule = built("interleaved", 1, 3, 2)[0]
    assert not any(a.op.is_message for a in schedule.actions[0])
    assert schedule.actions[0][-3:] == [Action(0, "REDUCE"), Action(0, "STEP"), Action(1, "STEP")]


def test_naive_1f1b_lowering_deadlocks_at_2_stages_and_gpipe_survives_it():
    orders, ranks = SCHEDULES["1f1b"](2, 4, 1), (0, 1)
    naive = Schedule("1f1b", 4, ranks, naive_lowering(orders, ranks))
    with pytest.raises(ValueError) as err:
        validate(naive)
    assert str(err.value) == (
        "rank 0 action 3 (0SA1): deadlock under blocking sends; rank 1 waits at action 3 (1SG0)"
    )
    validate(Schedule("gpipe", 4, ranks, naive_lowering(SCHEDULES["gpipe"](2, 4, 1), ranks)))


def edited_1f1b(edit) -> Schedule:
    """A 2-rank, 4-microbatch 1F1B schedule after `edit(lists of action strings)`."""
    doc = schedule_to_json(built("1f1b", 2, 4)[0])
    edit(doc["actions"])
    return schedule_from_json(doc)


def swap(row: list[str], a: str, b: str) -> None:
    i, j = row.index(a), row.index(b)
    row[i], row[j] = row[j], row[i]


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda rows: swap(rows[1], "1F3", "1B3"),
            "rank 1 action 13 (1B3): backward of microbatch 3 before its forward",
        ),
        (
            lambda rows: rows[1].remove("1RA1"),
            "rank 1 action 4 (1F1): runs before receiving its activation",
        ),
        (
            lambda rows: rows[0].remove("0RG2"),
            "rank 0 action 12 (0B2): runs before receiving its gradient",
        ),
        (
            lambda rows: rows[1].insert(0, "1SA0"),
            "rank 1 action 0 (1SA0): there is no stage 2 to send to",
        ),
        (
            lambda rows: rows[0].insert(0, "1F0"),
            "rank 0 action 0 (1F0): stage 1 runs on rank 1",
        ),
        (lambda rows: rows[0].append("0F1"), "rank 0 action 18 (0F1): repeats an earlier action"),
        (
            lambda rows: rows[0].insert(0, "0F9"),
            "rank 0 action 0 (0F9): microbatch 9 is out of range (there are 4)",
        ),
        (lambda rows: rows[0].remove("0STEP"), "rank 0: 0STEP is missing"),
        (
            lambda rows: swap(rows[0], "0REDUCE", "0B3"),
            "rank 0 action 15 (0REDUCE): averages gradients before 0B3",
        ),
        (lambda rows: rows[1].remove("1SG2"), "rank 1: 1SG2 is missing"),
        (
            lambda rows: swap(rows[0], "0SA1", "0RG0"),
            "rank 0 action 3 (0SA1): deadlock under blocking sends; "
            "rank 1 waits at action 3 (1SG0)",
        ),
    ],
)
def test_validator_names_the_first_bad_action_in_one_line(edit, message):
    with pytest.raises(ValueError) as err:
        validate(edited_1f1b(edit))
    assert str(err.value) == message


def test_validator_checks_the_halves_of_a_split_backward():
    doc = schedule_to_json(built("zb-h1", 2, 2)[0])
    swap(doc["actions"][0], "0BI1", "0BW1")
    with pytest.raises(ValueError, match=r"\(0BW1\): weight-gradient half of microbatch 1 before"):
        validate(schedule_from_json(doc))


def test_actions_print_and_parse_round_trip():
    for text in ["0F3", "1B3", "2BI3", "2BW3", "0SA3", "1RA3", "1SG3", "0RG3", "12F12"]:
        assert str(parse_action(text)) == text
    assert parse_action("3REDUCE") == Action(3, "REDUCE")
    assert parse_action("1RG7") == Action(1, "RECV_GRAD", 7)
    for bad in ["F3", "0X1", "0STEP3", "0F", ""]:
        with pytest.raises(ValueError):
            parse_action(bad)


def test_ops_are_the_schedule_strings_and_say_what_they_are():
    """The enum's values are the op names schedules always had, so files and traces keep them."""
    names = ["F", "B", "BI", "BW", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"]
    assert [op.value for op in Op] == [*names, "REDUCE", "STEP"]
    assert Op.RECV_GRAD == "RECV_GRAD" and f"1{Op.SEND_ACT}" == "1SEND_ACT"
    for op in Op:
        assert Op.of_code(op.code) is op
        assert parse_action(str(Action(2, op, None if op.is_per_stage else 5))).op is op
    kinds = {
        "is_compute": "F B BI BW",
        "is_message": "SEND_ACT RECV_ACT SEND_GRAD RECV_GRAD",
        "is_send": "SEND_ACT SEND_GRAD",
        "is_recv": "RECV_ACT RECV_GRAD",
        "is_per_stage": "REDUCE STEP",
        "makes_input_grad": "B BI",
        "ends_microbatch": "B BW",
    }
    for prop, ops in kinds.items():
        assert [op for op in Op if getattr(op, prop)] == ops.split(), prop


def test_every_kind_round_trips_through_its_json_file(tmp_path):
    for kind, p, m, v in [("gpipe", 3, 4, 1), ("1f1b", 4, 8, 1), ("zb-h1", 3, 5, 1)] + [
        ("interleaved", 2, 4, 3)
    ]:
        schedule = built(kind, p, m, v)[0]
        path = tmp_path / f"{kind}.json"
        path.write_text(json.dumps(schedule_to_json(schedule)))
        assert load_schedule_file(str(path)) == schedule


def test_a_compute_order_file_is_lowered_to_the_generated_schedule(tmp_path):
    generated = built("1f1b", 3, 6)[0]
    path = tmp_path / "order.json"
    order = [row.split() for row in compute_order(generated)]
    path.write_text(json.dumps({"kind": "1f1b", "microbatches": 6, "actions": order}))
    assert load_schedule_file(str(path)) == generated


@pytest.mark.parametrize(
    "content,message",
    [
        ("{", "not JSON"),
        ('{"microbatches": 2}', "missing key 'actions'"),
        ('{"microbatches": 2, "actions": [["0F0"]], "stagse": 1}', "unknown key 'stagse'"),
        ('{"microbatches": 1, "actions": [["0F0", "0X0"]]}', "rank 0 action 1: not an action"),
        (
            '{"microbatches": 1, "actions": [["0F0", "0B0"], ["1B0", "1F0"]]}',
            "rank 1 action 0 (1B0): backward of microbatch 0 before its forward",
        ),
        (
            '{"microbatches": 2, "actions": [["0F0", "0B0", "0F1", "0B1"], '
            '["1F1", "1B1", "1F0", "1B0"]]}',
            "rank 0 action 1 (0B0): the compute orders wait on each other; "
            "rank 1 waits at action 0 (1F1)",
        ),
    ],
)
def test_an_invalid_schedule_file_is_refused_with_one_line(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(UserError) as err:
        load_schedule_file(str(path))
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "args,message",
    [
        (("zb", 2, 2), "unknown schedule kind"),
        (("1f1b", 0, 2), "stages must be >= 1"),
        (("1f1b", 2, 0), "microbatches must be >= 1"),
        (("1f1b", 2, 4, 2), "virtual stages are for interleaved"),
        (("interleaved", 4, 6, 2), "microbatches (6) to be a multiple of the pipeline stages (4)"),
    ],
)
def test_build_schedule_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_schedule(*args)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(["schedule", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_prints_the_schedule_file_with_its_prediction(capsys):
    code, out, _ = run_cli(
        ["--kind", "1f1b", "--stages", "3", "--microbatches", "5", "--json"], capsys
    )
    assert code == 0
    doc = json.loads(out)
    assert schedule_from_json(doc) == built("1f1b", 3, 5)[0]
    assert (doc["ranks"], doc["stages"], doc["microbatches"]) == (3, 3, 5)
    assert doc["predicted_bubble"] == pytest.approx(2 / 7)
    assert doc["peak_inflight"] == [3, 2, 1]


def test_cli_text_shows_one_line_per_rank_and_the_bubble(capsys):
    code, out, _ = run_cli(["--kind", "gpipe", "-P", "2", "-M", "2"], capsys)
    assert code == 0
    assert "rank 0 | 0F0 0F1 .   .   0B0 0B1\n" in out and "rank 1 | .   1F0 1F1 1B0 1B1 .\n" in out
    assert "predicted bubble: 33.3%" in out


def test_cli_checks_and_simulates_a_user_file(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schedule_to_json(built("zb-h1", 4, 8)[0])))
    code, out, _ = run_cli(["--file", str(path)], capsys)
    assert code == 0 and "predicted bubble: 15.8%" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--stages", "0"], "stages must be >= 1"),
        (["--microbatches", "0"], "microbatches must be >= 1"),
        (["--kind", "interleaved", "-P", "4", "-M", "6"], "multiple of the pipeline stages"),
        (["--file", "s.json", "--kind", "1f1b"], "--kind does not apply"),
        (["--file", "/nonexistent/s.json"], "cannot read the schedule"),
    ],
)
def test_cli_refuses_bad_input_with_one_line_and_exit_code_2(argv, message, capsys):
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith("ringtrain schedule: error:") and err.count("\n") == 1
    assert message in err


def test_cli_refuses_an_invalid_file_naming_the_first_bad_action(tmp_path, capsys):
    doc = schedule_to_json(built("1f1b", 2, 4)[0])
    swap(doc["actions"][1], "1F3", "1B3")
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    code, _, err = run_cli(["--file", str(path)], capsys)
    assert code == 2
    assert err == (
        f"ringtrain schedule: error: {path}: rank 1 action 13 (1B3): "
        "backward of microbatch 3 before its forward\n"
    )


def test_cli_writes_a_gantt_png(tmp_path, capsys):
    path = tmp_path / "gantt.png"
    code, _, _ = run_cli(["--kind", "zb-h1", "-P", "2", "-M", "3", "--png", str(path)], capsys)
    assert code == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schedule_code_imports_neither_tensorflow_nor_mpi():
    code = (
        "import sys\n"
        "import ringtrain.pipeline.schedule, ringtrain.pipeline.simulate\n"
        "import ringtrain.pipeline.schedule_cli, ringtrain.pipeline.calibrate\n"
        "assert 'tensorflow' not in sys.modules and 'mpi4py' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_a_link_model_fitted_to_exact_timings_recovers_latency_and_rate():
    link = LinkModel.fit([(n, 50e-6 + n / 1e9) for n in (1_000, 100_000, 1_000_000)])
    assert link.latency == pytest.approx(50e-6)
    assert link.bytes_per_second == pytest.approx(1e9)
    with pytest.raises(ValueError, match="two message sizes"):
        LinkModel.fit([(1000, 1e-5), (1000, 2e-5)])


def test_a_shaping_link_s_burst_is_what_a_lone_message_did_not_pay_for():
    """A 1000-byte message at 100 bytes a second after 0.5 s of latency: alone in 3.5 s, it
    paid for 300 bytes, so 700 went through on the burst; one that paid for all of it, none;
    one faster than the latency, all of it."""
    link = LinkModel(0.5, 100.0)
    assert link.with_lone_message(1000, 3.5).burst_bytes == pytest.approx(700)
    assert link.with_lone_message(1000, 12.0).burst_bytes == 0.0
    assert link.with_lone_message(1000, 0.1).burst_bytes == 1000.0
    assert link.with_lone_message(1000, 3.5).to_json()["burst_bytes"] == pytest.approx(700)


def test_a_wire_s_bucket_refills_while_it_rests_and_empties_under_a_train():
    """Bucket of 500 bytes, 100 bytes a second, no latency. A full bucket carries 400 bytes
    free; the next 400 right after find 100 left and pay 3 s; after 2 s of rest, 200 bytes
    are back, so 400 bytes pay 2 s; a burst of 0 pays the rate every time."""
    wire = LinkModel(0.0, 100.0, burst_bytes=500).wire()
    assert wire.carry(400, 0.0) == 0.0
    assert wire.carry(400, 0.0) == pytest.approx(3.0)
    assert wire.carry(400, 5.0) == pytest.approx(2.0)
    plain = LinkModel(0.0, 100.0).wire()
    assert [plain.carry(400, t) for t in (0.0, 100.0)] == [4.0, 4.0]


def test_the_simulator_refills_each_wire_s_bucket_between_messages():
    """GPipe, P=2, M=2, F = B = 1, 100-byte boundaries, 50 bytes a second, a 100-byte bucket.
    Each direction's first message goes free; the second leaves a unit later, finds 50 bytes
    refilled and pays a unit for the rest: activations arrive at 1 and 3, gradients at 5 and
    7, so the step ends at 8 (6 on a free link, 12 at the rate without a bucket)."""
    gpipe = built("gpipe", 2, 2)[0]
    cost = {"F": 1.0, "B": 1.0}.get

    def makespan(link: LinkModel) -> float:
        return simulate(gpipe, lambda a: cost(a.op, 0.0), link, boundary_bytes=[100]).makespan

    assert makespan(LinkModel(0.0, 50.0, burst_bytes=100)) == pytest.approx(8.0)
    assert makespan(LinkModel(0.0, float("inf"))) == pytest.approx(6.0)
    assert makespan(LinkModel(0.0, 50.0)) == pytest.approx(12.0)


def test_a_prediction_adds_measured_compute_and_the_link_s_time_per_message():
    """1F1B, P=2, M=1: F0, message, F1, B1, message, B0: 1 + 2 + 2 + 4 + the two messages,
    each 0.25 latency plus 500 bytes at 1000 bytes a unit."""
    one = built("1f1b", 2, 1)[0]
    seconds = {(0, "F"): 1.0, (0, "B"): 4.0, (1, "F"): 2.0, (1, "B"): 2.0}
    result = predict(one, seconds, LinkModel(0.25, 1000.0), boundary_bytes=[500])
    assert result.makespan == pytest.approx(1 + 2 + 2 + 4 + 2 * 0.75)
    with pytest.raises(ValueError, match="no measured time for 1B0"):
        predict(one, {(0, "F"): 1.0, (0, "B"): 1.0, (1, "F"): 1.0})


def row(step, op, mb, start, end, stage, rank, wait=0.0) -> list:
    """A row as a gathered trace holds it: step, op, mb, start, end, stage, fixed, wait, rank."""
    return [step, OPS.index(op), mb, start, end, stage, 0.0, wait, rank]


def test_calibration_takes_each_stage_s_action_times_over_the_steps_asked():
    """Every action's median; a receive's without the time it waited (waiting is the
    simulator's to work out)."""
    rows = np.array(
        [
            row(0, "F", 0, 0.0, 9.0, 0, 0),  # step 0 traced the graphs: left out
            *(row(1, "F", m, 0.0, 1.0 + m, 0, 0) for m in range(3)),
            row(1, "B", 0, 5.0, 7.0, 1, 1),
            row(1, "SA", 0, 1.0, 1.1, 0, 0),  # a message: not a computation
        ]
    )
    assert stage_seconds(rows, [1]) == {
        (0, "F"): 2.0,
        (1, "B"): 2.0,
        (0, "SEND_ACT"): pytest.approx(0.1),
    }
    receives = np.array(
        [
            *(row(1, "RA", m, 0.0, 1.0 + m, 1, 1, wait=0.75 + m) for m in range(3)),
            row(1, "RG", 0, 0.0, 0.25, 0, 0),  # its data was there: its own work only
        ]
    )
    assert stage_seconds(receives, [1]) == {(1, "RECV_ACT"): 0.25, (0, "RECV_GRAD"): 0.25}


def test_calibration_keeps_each_step_and_replica_s_own_action_times():
    """Ranks 0-1 are replica 0, 2-3 replica 1 (P=2): one mapping per (step, replica), in that
    order; every receive gets its own work, without its wait."""
    rows = np.array(
        [
            row(step, "F", 0, 0.0, step + replica / 10, 0, 2 * replica)
            for step in (1, 2)
            for replica in (0, 1)
        ]
        + [row(2, "RA", 0, 0.0, 0.5, 1, 3), row(1, "RA", 0, 0.0, 2.0, 1, 1, wait=1.5)]
    )
    assert step_actions(rows, [1, 2], pp_size=2) == [
        {Action(0, "F", 0): 1.0, Action(1, "RECV_ACT", 0): 0.5},
        {Action(0, "F", 0): 1.1},
        {Action(0, "F", 0): 2.0},
        {Action(0, "F", 0): 2.1, Action(1, "RECV_ACT", 0): 0.5},
    ]


def test_a_prediction_from_steps_is_the_replay_with_the_median_makespan():
    """1F1B, P=2, M=1 on a free link is F0 + F1 + B1 + B0; steps with every computation at 1, 3
    and 2 seconds replay to 4, 12 and 8: the prediction is the 8, with that replay's timeline.
    A step without one of the schedule's computations is refused."""
    one = built("1f1b", 2, 1)[0]
    compute = [a for row in one.actions for a in row if a.op.is_compute]
    steps = [{a: float(k) for a in compute} for k in (1, 3, 2)]
    result = predict_from_steps(one, steps)
    assert result.makespan == 8.0
    assert result.timeline[1] == [("1F0", 2.0, 4.0), ("1B0", 4.0, 6.0)]
    with pytest.raises(ValueError, match="no measured time for 1B0"):
        predict_from_steps(one, [{a: 1.0 for a in compute if str(a) != "1B0"}])


def test_a_measured_step_starts_at_its_first_computation_as_the_simulated_one_does():
    """Stage 1 posts its first receive (at 0) while stage 0 still finishes the last step; the
    step is from stage 0's first F (at 3) to the last STEP's end (at 10), as the simulator's
    makespan is from its first computation to its last action."""
    rows = np.array(
        [
            row(1, "RA", 0, 0.0, 4.0, 1, 1),
            row(1, "F", 0, 3.0, 4.0, 0, 0),
            row(1, "F", 0, 4.0, 6.0, 1, 1),
            row(1, "STEP", -1, 9.0, 10.0, 0, 0),
        ]
    )
    assert measured_step_seconds(rows, skip_first=False) == 7.0


def test_a_message_s_host_work_delays_its_arrival_and_its_receiver():
    """1F1B, P=2, M=1, F = B = 1: the send's 0.25 s of host work and the receive's 0.5 s
    both lie on the critical path, twice: 4 + 2 * 0.75."""
    one = built("1f1b", 2, 1)[0]
    seconds = {(s, op): 1.0 for s in (0, 1) for op in ("F", "B")}
    seconds |= {(0, "SEND_ACT"): 0.25, (1, "SEND_GRAD"): 0.25}
    seconds |= {(1, "RECV_ACT"): 0.5, (0, "RECV_GRAD"): 0.5}
    assert predict(one, seconds).makespan == pytest.approx(4 + 2 * 0.75)


def test_calibration_steps_are_spread_through_the_timed_steps():
    """A slow start must not weigh on the calibration alone: 3 steps spread through the run, or
    all but one of a short run, so that something is left to predict."""
    assert calibration_steps(0, 30) == [0, 10, 20]
    assert calibration_steps(1, 99) == [1, 34, 67]
    assert calibration_steps(5, 4) == [5, 6, 7]
    assert calibration_steps(0, 2) == [0]
    assert calibration_steps(0, 1) == [0]
