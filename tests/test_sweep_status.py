"""`ringtrain sweep status` in-process, on studies written with Optuna directly as `sweep run`
records them: the order by the study's direction, the best trial's train line to the letter,
the plots, and bad input in one line."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from ringtrain.cli import main
from ringtrain.sweep import ledger
from ringtrain.sweep.space import as_record, parse_space
from ringtrain.sweep.storage import OBJECTIVE_ATTR, SPACE_ATTR, TRAIN_ARGV_ATTR

SPACE = {
    "lr": {"type": "float", "low": 1e-4, "high": 0.3, "log": True},
    "batch-size": {"type": "int", "low": 32, "high": 256, "step": 32},
    "model-arg.units": {"type": "categorical", "choices": [32, 64, 128]},
}
DISTRIBUTIONS = {
    "lr": FloatDistribution(1e-4, 0.3, log=True),
    "batch-size": IntDistribution(32, 256, step=32),
    "model-arg.units": CategoricalDistribution([32, 64, 128]),
}
SHARED = ["--model", "mlp", "--epochs", "2", "--data", "npz:my data.npz"]
REFUSED = "global batch 256 exceeds the 1797 examples"
# (state, value, lr, batch size, units, user attrs) in the order `sweep run` would number them.
TRIALS = [
    (TrialState.COMPLETE, 0.30, 0.01, 64, 64, {ledger.GROUP: 0, ledger.RANKS: [0, 1]}),
    (TrialState.COMPLETE, 0.10, 0.05, 128, 128, {ledger.GROUP: 1, ledger.RANKS: [2, 3]}),
    (TrialState.PRUNED, 0.05, 1e-4, 32, 32, {ledger.GROUP: 0}),  # its value at the pruning
    (TrialState.FAIL, None, 0.2, 256, 32, {ledger.GROUP: 1, ledger.REASON: REFUSED}),
    (TrialState.COMPLETE, 0.20, 0.2, 256, 32, {ledger.GROUP: 0, ledger.RETRY_OF: 3}),
    (TrialState.RUNNING, None, 0.02, 96, 64, {ledger.GROUP: 1}),
]


def make_study(folder: Path, direction: str, trials=TRIALS) -> str:
    """A study as `sweep run` leaves it, in a sqlite file in `folder`; its storage URL."""
    url = f"sqlite:///{folder / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=url, direction=direction)
    study.set_user_attr(SPACE_ATTR, as_record(parse_space(SPACE)))
    study.set_user_attr(OBJECTIVE_ATTR, "loss")
    study.set_user_attr(TRAIN_ARGV_ATTR, SHARED)
    for state, value, lr, batch, units, attrs in trials:
        done = state not in (TrialState.FAIL, TrialState.RUNNING)
        measured = {ledger.STEPS: 40, ledger.SECONDS: 3.25} if done else {}
        trial = create_trial(
            state=state,
            value=value,
            intermediate_values={1: value} if value is not None else None,
            params={"lr": lr, "batch-size": batch, "model-arg.units": units},
            distributions=DISTRIBUTIONS,
            user_attrs={**attrs, **measured},
        )
        study.add_trial(trial)
    return url


def status(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["sweep", "status", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_table_is_best_first_and_ends_with_the_best_trials_train_line(tmp_path, capsys):
    url = make_study(tmp_path, "minimize")
    code, out, err = status(capsys, "s", "--storage", url)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == [
        *("#", "state", "loss", "batch-size", "lr", "model-arg.units"),
        *("steps", "time", "s", "group", "note"),
    ]
    rows = [line.split() for line in lines[1:7]]
    # Complete by loss, then pruned (its value is from before the end), then the rest by number.
    assert [(r[0], r[1]) for r in rows] == [
        ("1", "complete"),
        ("4", "complete"),
        ("0", "complete"),
        ("2", "pruned"),
        ("3", "fail"),
        ("5", "running"),
    ]
    assert rows[0][2:9] == ["0.1", "128", "0.05", "128", "40", "3.2", "1"]
    assert lines[2].endswith("retry of 3") and lines[5].endswith(REFUSED)
    assert lines[7] == "best: trial 1, loss 0.1; to train it alone:"
    assert lines[8] == (
        "  mpirun -np 2 ringtrain train --model mlp --epochs 2 --data 'npz:my data.npz' "
        "--batch-size 128 --lr 0.05 --model-arg units=128"
    )
    plots = [tmp_path / "history.png", tmp_path / "importances.png"]  # beside the study's file
    assert lines[9:] == [f"plots: {plots[0]}, {plots[1]}"]
    assert all(p.stat().st_size > 0 for p in plots)


def test_json_is_the_same_report_best_first_for_a_maximized_objective(tmp_path, capsys):
    url = make_study(tmp_path, "maximize")
    code, out, _ = status(capsys, "s", "--storage", url, "--json", "--plots", str(tmp_path / "p"))
    assert code == 0
    report = json.loads(out)
    assert (report["study"], report["direction"], report["objective"]) == ("s", "maximize", "loss")
    assert [t["number"] for t in report["trials"]] == [0, 4, 1, 2, 3, 5]
    assert report["trials"][1] == {
        "number": 4,
        "state": "complete",
        "value": 0.2,
        "params": {"lr": 0.2, "batch-size": 256, "model-arg.units": 32},
        "steps": 40,
        "seconds": 3.25,
        "group": 0,
        "reason": None,
        "retry_of": 3,
    }
    assert report["trials"][4]["reason"] == REFUSED
    best = report["best"]
    assert (best["number"], best["value"], best["ranks"]) == (0, 0.3, 2)
    assert best["train"] == (
        "mpirun -np 2 ringtrain train --model mlp --epochs 2 --data 'npz:my data.npz' "
        "--batch-size 64 --lr 0.01 --model-arg units=64"
    )
    assert report["plots"] == {
        "history": str(tmp_path / "p" / "history.png"),
        "importances": str(tmp_path / "p" / "importances.png"),
        "skipped": [],
    }


def test_a_plot_the_study_cannot_make_yet_is_skipped_with_a_line(tmp_path, capsys):
    url = make_study(tmp_path, "minimize", TRIALS[:1])
    code, out, _ = status(capsys, "s", "--storage", url)
    assert code == 0
    assert out.splitlines()[-2:] == [
        f"plots: {tmp_path / 'history.png'}",
        "no plot: importances need 2 complete trials and 2 parameters that vary among them "
        "(the study has 1 and 0)",
    ]
    assert not (tmp_path / "importances.png").exists()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    code, out, _ = status(capsys, "s", "--storage", make_study(fresh, "minimize", TRIALS[5:]))
    assert code == 0
    assert out.splitlines()[-2:] == [
        "no complete trial yet, so no best trial to train",
        "no plot: no complete trial yet",
    ]


@pytest.mark.parametrize(
    "storage, message",
    [
        ("sqlite:///{tmp}/study.db", "no study 'nope' in sqlite:///{tmp}/study.db (it holds: s)"),
        ("study.db", "--storage 'study.db': expected sqlite:///PATH, journal:PATH or a database"),
    ],
)
def test_a_missing_study_or_a_bad_storage_is_one_line(tmp_path, capsys, storage, message):
    make_study(tmp_path, "minimize", TRIALS[:1])
    storage, message = storage.format(tmp=tmp_path), message.format(tmp=tmp_path)
    code, out, err = status(capsys, "nope", "--storage", storage)
    assert (code, out) == (2, "")
    assert err.startswith(f"ringtrain sweep status: error: {message}")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_study_that_sweep_run_did_not_make_is_one_line(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'plain.db'}"
    optuna.create_study(study_name="plain", storage=url)
    code, out, err = status(capsys, "plain", "--storage", url)
    assert (code, out) == (2, "")
    said = "study 'plain' was not made by `ringtrain sweep run`"
    assert err == f"ringtrain sweep status: error: {said}\n"
