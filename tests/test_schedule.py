"""Pipeline schedules are plain data: valid, deadlock-free and with the textbook bubble."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain.pipeline.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    build_schedule,
    naive_lowering,
    parse_action,
    validate,
)
from ringtrain.pipeline.schedule_cli import add_schedule_arguments, run_schedule_command
from ringtrain.pipeline.simulate import predicted_bubble, simulate

GRID = [(kind, p, m) for kind in SCHEDULES for p in range(1, 9) for m in range(1, 33)]
REPO = Path(__file__).resolve().parents[1]


def compute_order(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in row if a.is_compute) for row in schedule.actions]


def test_every_schedule_up_to_8_stages_and_32_microbatches_is_valid():
    for kind, p, m in GRID:
        validate(build_schedule(kind, p, m))


def test_unit_cost_bubble_makespan_and_peak_inflight_match_the_formulas():
    for kind, p, m in GRID:
        result = simulate(build_schedule(kind, p, m))
        assert result.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (kind, p, m)
        assert result.makespan == 2 * (m + p - 1), (kind, p, m)
        expected = [m] * p if kind == "gpipe" else [min(p - s, m) for s in range(p)]
        assert result.peak_inflight == expected, (kind, p, m)
    assert predicted_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)


HAND_TABLES = {
    ("gpipe", 2, 4): ["F0 F1 F2 F3 B0 B1 B2 B3"] * 2,
    ("1f1b", 2, 4): ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
    ("gpipe", 4, 8): ["F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7"] * 4,
    ("1f1b", 4, 8): [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    ],
}


@pytest.mark.parametrize("key", list(HAND_TABLES), ids=lambda k: f"{k[0]}-P{k[1]}-M{k[2]}")
def test_compute_order_equals_hand_derived_table(key):
    kind, p, m = key
    schedule = build_schedule(kind, p, m)
    assert compute_order(schedule) == HAND_TABLES[key]
    assert simulate(schedule).makespan == 2 * (m + p - 1)


def test_1f1b_lowering_at_2_stages_sends_where_the_peer_needs_it():
    rows = [" ".join(str(a) for a in row) for row in build_schedule("1f1b", 2, 4).actions]
    assert rows == [
        "F0 SA0 F1 RG0 SA1 B0 F2 RG1 SA2 B1 F3 RG2 SA3 B2 RG3 B3",
        "RA0 F0 B0 SG0 RA1 F1 B1 SG1 RA2 F2 B2 SG2 RA3 F3 B3 SG3",
    ]


def test_single_stage_has_no_communication():
    assert all(a.is_compute for a in build_schedule("1f1b", 1, 5).actions[0])


def test_naive_1f1b_lowering_deadlocks_at_2_stages():
    with pytest.raises(ValueError, match=r"deadlock.*stage 0 at SA1.*stage 1 at SG0"):
        validate(naive_lowering("1f1b", 2, 4))
    validate(naive_lowering("gpipe", 2, 4))  # GPipe survives the naive lowering


def test_validator_rejects_backward_before_forward():
    with pytest.raises(ValueError, match="B0 comes before F0"):
        validate(Schedule("custom", 1, 1, [[Action("B", 0), Action("F", 0)]]))


def test_validator_rejects_a_missing_receive():
    schedule = build_schedule("gpipe", 2, 2)
    schedule.actions[1].remove(Action("RECV_ACT", 1))
    with pytest.raises(ValueError, match="stage 1: RA1 must appear exactly once"):
        validate(schedule)


def test_validator_rejects_a_send_without_a_peer():
    schedule = build_schedule("gpipe", 2, 2)
    schedule.actions[1].append(Action("SEND_ACT", 0))
    with pytest.raises(ValueError, match="stage 1: unexpected SA0"):
        validate(schedule)


def test_actions_print_and_parse_round_trip():
    for text in ["F3", "B3", "SA3", "RA3", "SG3", "RG3", "F12"]:
        assert str(parse_action(text)) == text
    assert parse_action("RG7") == Action("RECV_GRAD", 7)
    with pytest.raises(ValueError):
        parse_action("X1")


@pytest.mark.parametrize("args", [("zb", 2, 2), ("1f1b", 0, 2), ("1f1b", 2, 0)])
def test_build_schedule_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        build_schedule(*args)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="ringtrain schedule")
    add_schedule_arguments(parser)
    code = run_schedule_command(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_prints_one_object_with_the_lowered_actions(capsys):
    code, out, _ = run_cli(
        ["--kind", "1f1b", "--stages", "3", "--microbatches", "5", "--json"], capsys
    )
    assert code == 0
    doc = json.loads(out)
    keys = {"kind", "stages", "microbatches", "actions", "predicted_bubble", "peak_inflight"}
    assert set(doc) == keys
    assert (doc["kind"], doc["stages"], doc["microbatches"]) == ("1f1b", 3, 5)
    assert doc["actions"] == [[str(a) for a in row] for row in build_schedule("1f1b", 3, 5).actions]
    assert doc["predicted_bubble"] == pytest.approx(2 / 7)
    assert doc["peak_inflight"] == [3, 2, 1]


def test_cli_text_shows_one_line_per_stage_and_the_bubble(capsys):
    code, out, _ = run_cli(["--kind", "gpipe", "-P", "2", "-M", "2"], capsys)
    assert code == 0
    assert "stage 0 | F0 F1 .  .  B0 B1\n" in out and "stage 1 | .  F0 F1 B0 B1 .\n" in out
    assert "predicted bubble: 33.3%" in out


@pytest.mark.parametrize("flag", ["--stages", "--microbatches"])
def test_cli_rejects_non_positive_values_with_exit_code_2(flag, capsys):
    code, out, err = run_cli([flag, "0"], capsys)
    assert code == 2 and out == ""
    assert err.startswith("ringtrain schedule: error:") and err.count("\n") == 1


def test_cli_writes_a_gantt_png(tmp_path, capsys):
    path = tmp_path / "gantt.png"
    code, _, _ = run_cli(["--stages", "2", "--microbatches", "3", "--png", str(path)], capsys)
    assert code == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schedule_code_imports_neither_tensorflow_nor_mpi():
    code = (
        "import sys\n"
        "import ringtrain.pipeline.schedule, ringtrain.pipeline.simulate\n"
        "import ringtrain.pipeline.schedule_cli\n"
        "assert 'tensorflow' not in sys.modules and 'mpi4py' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
