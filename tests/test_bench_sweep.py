"""`ringtrain bench sweep --quick` launches both contenders for both models, on the same
queued trials, and fills its report: trials per hour, the packed/wide ratios, the trials'
own seconds. No speed is asserted: the numbers depend on the machine."""

from __future__ import annotations

import pytest
from test_bench import quick_bench, rounds_per_contender

from ringtrain.bench.sweep_bench import CONTENDERS, MODELS


@pytest.mark.mpi
def test_bench_sweep_quick(tmp_path):
    report = quick_bench("sweep", tmp_path)
    rows, rounds, names = report["raw"], list(range(report["rounds"])), list(CONTENDERS)
    turns = [names[i % 2 :] + names[: i % 2] for i in rounds]  # the other order each round
    assert [(r["model"], r["contender"]) for r in rows] == [
        (m, c) for i in rounds for m in MODELS for c in turns[i]
    ]
    for model in MODELS:
        mine = [r for r in rows if r["model"] == model]
        assert rounds_per_contender(mine) == {c: rounds for c in CONTENDERS}
        for r in mine:
            # Both contenders trained exactly the queued trials, each to its full steps.
            assert r["trial_lrs"] == report["trial_lrs"]
            assert r["trial_steps"] == [report["steps_per_trial"][model]] * r["trials"]
            assert r["trials_per_hour"] == pytest.approx(r["trials"] * 3600 / r["wall_seconds"])
            assert sum(r["group_busy_seconds"]) == pytest.approx(r["trial_seconds_sum"])
            groups = report["ranks"] // report["contenders"][r["contender"]]["group_size"]
            assert sorted(set(r["trial_groups"])) == list(range(groups))
            assert all(s > 0 for s in r["trial_seconds"]) and r["load_1min_before"] >= 0
        ratio = report["ratios"][model]["packed_over_wide"]
        assert len(ratio["per_round"]) == len(rounds)
        assert ratio["min"] <= ratio["median"] <= ratio["max"]
        assert len(report["ratios"][model]["wide_trial_speedup"]["per_round"]) == len(rounds)
    assert {(e["model"], e["contender"]) for e in report["summary"]} == {
        (m, c) for m in MODELS for c in CONTENDERS
    }
    for e in report["summary"]:
        assert e["trials_per_hour_min"] <= e["trials_per_hour_median"] <= e["trials_per_hour_max"]
    assert report["pinning"]["mpirun_flags"] == ["--bind-to", "core"]
    assert set(report["load_average"]) == {"start", "end"}
