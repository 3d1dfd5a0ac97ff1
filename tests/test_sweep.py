"""`ringtrain sweep run`: trials packed into groups of ranks under a real mpirun, recorded in
a real Optuna study; pruning, a trial equal to its configuration trained alone, a launch
killed midway and continued, and bad inputs in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import optuna
import pytest
from conftest import BIN, ENV, MPIRUN, ROOT, load_npz, one_line_error, ringtrain
from optuna.trial import TrialState

from ringtrain.sweep import ledger

SPACE = """\
lr: {type: float, low: 1.0e-7, high: 0.5, log: true}
batch-size: {type: categorical, choices: [32, 64]}
"""
LOSING_LR = 1e-7  # an update this small leaves the digits at chance after an epoch
ORDER = [(0.05, 32), (0.1, 64), (0.02, 32), (0.2, 64), (LOSING_LR, 64), (0.05, 64), (0.1, 32)]
ORDER.append((0.03, 32))
SHARED = ["--model", "mlp", "--strategy", "data", "--epochs", "2", "--seed", "3"]
SHARED += ["--optimizer", "sgd"]


def sweep(space: Path, storage: str, study: str, out: Path, *flags: str) -> list[str]:
    return [
        *("sweep", "run", str(space), "--study", study, "--storage", storage),
        *("--objective", "val_accuracy", "--direction", "maximize", "--out", str(out)),
        *flags,
    ]


def trials_of(storage: str, study: str) -> list:
    return optuna.load_study(study_name=study, storage=storage).get_trials(deepcopy=False)


def kill_session(sid: int) -> None:
    """SIGKILL to mpirun and every rank it started: they share its session, not its group."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone already
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                os.kill(int(entry.name), signal.SIGKILL)


@pytest.fixture
def space(tmp_path: Path) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(SPACE)
    return path


@pytest.mark.mpi
def test_eight_trials_on_two_groups_of_two_prune_the_loser_and_match_training_alone(
    space, tmp_path
):
    """8 trials queued in a known order, run by 2 groups of 2 ranks. The losing learning rate
    comes fifth: by the time a group asks for it, at least three trials have finished, so the
    median pruner (one start-up trial) judges it after its first epoch."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="e2e", storage=storage, direction="maximize")
    for lr, batch in ORDER:
        study.enqueue_trial({"lr": lr, "batch-size": batch})
    argv = sweep(space, storage, "e2e", tmp_path / "out", "--trials", "8", "--group-size", "2")
    argv += ["--startup-trials", "1", *SHARED]
    done = ringtrain(*argv, ranks=4, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    trials = trials_of(storage, "e2e")
    assert len(trials) == 8
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials), trials
    by_lr = {t.params["lr"]: t for t in trials}
    loser = by_lr[LOSING_LR]
    assert loser.state == TrialState.PRUNED, loser
    assert loser.user_attrs[ledger.STEPS] < max(t.user_attrs[ledger.STEPS] for t in trials)
    # Each group's trials on its own ranks, and every trial's line names its group and ranks.
    said = done.stdout + done.stderr
    for t in trials:
        group = t.user_attrs[ledger.GROUP]
        ranks = [2 * group, 2 * group + 1]
        assert t.user_attrs[ledger.RANKS] == ranks
        assert f"trial {t.number}: group {group}, ranks {ranks[0]},{ranks[1]} on " in said
    assert {t.user_attrs[ledger.GROUP] for t in trials} == {0, 1}
    # A finished trial's weights are its configuration's, trained alone on one process.
    chosen = next(t for t in trials if t.state == TrialState.COMPLETE and t.number % 2)
    alone = tmp_path / "alone.npz"
    flags = [*SHARED, "--lr", str(chosen.params["lr"]), "--batch-size"]
    flags += [str(chosen.params["batch-size"]), "--strategy", "single", "--weights-out", str(alone)]
    single = ringtrain("train", *flags)
    assert single.returncode == 0, single.stderr[-2000:]
    swept = load_npz(tmp_path / "out" / f"trial-{chosen.number:05d}" / "weights.npz")
    reference = load_npz(alone)
    assert swept.keys() == reference.keys()
    for name, value in reference.items():
        np.testing.assert_allclose(swept[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.mpi
def test_a_sweep_killed_midway_continues_without_losing_or_repeating_a_trial(space, tmp_path):
    """Two groups of one rank; the launch is killed (SIGKILL, no checkpoint) once two trials
    are done. The same command then finishes the study: the interrupted trials are failed
    and retried once each, and no completed trial runs again."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    argv = sweep(space, storage, "cont", tmp_path / "out", "--trials", "6", "--group-size", "1")
    argv += ["--sampler", "random", "--pruner", "none", "--trial-heartbeat", "1", *SHARED]
    argv += ["--epochs", "3"]
    cmd = [*MPIRUN, "2", str(BIN / "ringtrain"), *argv]
    first = subprocess.Popen(
        cmd,
        env=ENV,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if os.path.exists(tmp_path / "study.db"):
                states = [t.state for t in trials_of(storage, "cont")]
                if states.count(TrialState.COMPLETE) >= 2 and TrialState.RUNNING in states:
                    break
            time.sleep(0.2)
        else:
            pytest.fail("the first launch finished no two trials in 300 s")
    finally:
        kill_session(first.pid)
        first.wait(60)
    before = {t.number: t for t in trials_of(storage, "cont")}
    completed = {n for n, t in before.items() if t.state == TrialState.COMPLETE}
    interrupted = {n for n, t in before.items() if t.state == TrialState.RUNNING}
    assert interrupted, before
    again = ringtrain(*argv, ranks=2, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    after = trials_of(storage, "cont")
    assert ledger.counted(after) == 6
    for t in after:
        if t.number in completed:  # kept as it was: same state, same launch, same value
            assert t.state == TrialState.COMPLETE
            assert t.user_attrs == before[t.number].user_attrs | {}
            assert t.value == before[t.number].value
    retries = {t.user_attrs[ledger.RETRY_OF]: t for t in after if ledger.RETRY_OF in t.user_attrs}
    assert set(retries) == interrupted  # each interrupted trial retried once, nothing else
    for number in interrupted:
        failed = after[number]
        assert failed.state == TrialState.FAIL
        assert "interrupted" in failed.user_attrs[ledger.REASON]
        assert retries[number].state == TrialState.COMPLETE
        assert retries[number].params == failed.params
    assert all(t.state != TrialState.RUNNING for t in after)


BAD_SPACES = [
    ("lr: {type: real, low: 0.1, high: 1}", "unknown type 'real'"),
    ("lr: {type: float, low: 1, high: 0.1}", "low 1 is above high 0.1"),
    ("batch-size: {type: categorical, choices: []}", "choices must be a non-empty list"),
    ("learning-rate: {type: float, low: 0.1, high: 1}", "learning-rate names no"),
    ("checkpoint-dir: {type: categorical, choices: [a, b]}", "set by the sweep"),
    ("lr: {type: float, low: 0.1, high: 1}", "needs listed values"),  # under --sampler grid
]


@pytest.mark.parametrize(("text", "needle"), BAD_SPACES)
def test_a_bad_search_space_is_one_line(tmp_path, text, needle):
    path = tmp_path / "space.yaml"
    path.write_text(text + "\n")
    argv = sweep(path, f"sqlite:///{tmp_path / 's.db'}", "bad", tmp_path / "out", "--trials", "2")
    done = ringtrain(*argv, "--sampler", "grid" if "listed" in needle else "tpe")
    one_line_error(done, needle)
    assert not (tmp_path / "s.db").exists()  # refused before the storage is touched


def test_bad_sweep_flags_and_storages_are_one_line(space, tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    argv = sweep(space, storage, "flags", tmp_path / "out", "--trials", "2")
    cases = [
        (["--group-size", "2"], "--group-size 2 does not divide the 1 ranks"),
        (["--objective", "accuracy"], "want loss or val_METRIC"),
        (["--checkpoint-dir", str(tmp_path)], "--checkpoint-dir is set by the sweep"),
        (["--lr", "x"], "--lr"),
    ]
    for extra, needle in cases:
        one_line_error(ringtrain(*argv, *extra), needle)
    unwritable = sweep(space, "sqlite:////sys/s.db", "x", tmp_path / "out", "--trials", "2")
    one_line_error(ringtrain(*unwritable), "/sys is not writable")
    nobody = sweep(space, "postgresql://u:pw@127.0.0.1:1/db", "x", tmp_path / "o", "--trials", "2")
    done = ringtrain(*nobody)
    one_line_error(done, "--storage postgresql://u:***@127.0.0.1:1/db: connection failed")
    assert "pw" not in done.stderr


def test_a_study_with_another_space_or_direction_is_refused(space, tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    first = sweep(space, storage, "kept", tmp_path / "out", "--trials", "1", "--model", "mlp")
    done = ringtrain(*first, "--steps", "2", "--strategy", "single")
    assert done.returncode == 0, done.stderr[-2000:]
    minimize = [a if a != "maximize" else "minimize" for a in first]
    one_line_error(ringtrain(*minimize), "exists with --direction maximize")
    other = tmp_path / "other.yaml"
    other.write_text("lr: {type: float, low: 0.01, high: 0.5}\n")
    one_line_error(
        ringtrain(*sweep(other, storage, "kept", tmp_path / "o", "--trials", "1")),
        "exists with a different search space",
    )
    assert [t.state for t in trials_of(storage, "kept")] == [TrialState.COMPLETE]
