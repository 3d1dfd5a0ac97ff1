"""`ringtrain sweep run`: trials packed into groups of ranks under a real mpirun, recorded in
a real Optuna study; pruning, a trial equal to its configuration trained alone, a launch
killed midway and continued, and bad inputs in one line."""

from __future__ import annotations

import json
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

from ringtrain.errors import UserError
from ringtrain.sweep import ledger
from ringtrain.sweep.storage import load_study, parse_storage

SPACE = """\
lr: {type: float, low: 1.0e-7, high: 0.5, log: true}
batch-size: {type: categorical, choices: [32, 64]}
strategy: {type: categorical, choices: [data, pipeline]}
"""
# The end-to-end sweep's space also holds a batch larger than the digits: a refused trial.
E2E_SPACE = SPACE.replace("[32, 64]", "[32, 64, 4096]")
LOSING_LR = 1e-7  # an update this small leaves the digits at chance after an epoch
ORDER = [(0.05, 32), (0.1, 64), (0.02, 32), (0.2, 64), (LOSING_LR, 64), (0.05, 64), (0.1, 32)]
ORDER.append((0.03, 4096))  # more than the digits hold: refused, so the trial fails
SHARED = ["--model", "mlp", "--epochs", "2", "--seed", "3"]
SHARED += ["--optimizer", "sgd"]


def sweep(space: Path, storage: str, study: str, out: Path, *flags: str) -> list[str]:
    return [
        *("sweep", "run", str(space), "--study", study, "--storage", storage),
        *("--objective", "val_accuracy", "--direction", "maximize", "--out", str(out)),
        *flags,
    ]


def trials_of(storage: str, study: str) -> list:
    """Read through ringtrain's opener: it makes a new file's tables under the sweep's lock,
    so this poll and a starting launch never both make them."""
    return load_study(parse_storage(storage), study).get_trials(deepcopy=False)


def session_ranks(sid: int, ranks_only: bool = True) -> list[int]:
    """The processes of mpirun's session `sid` (mpirun and the ranks it started: they share
    its session, not its group), or its ranks only."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone already
            continue
        if int(stat.rsplit(")", 1)[1].split()[3]) != sid:
            continue
        is_rank = b"sweep" in command and Path(command[0].decode()).name != "mpirun"
        if is_rank or not ranks_only:
            found.append(int(entry.name))
    return found


def rank_of(pid: int) -> int | None:
    for line in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if line.startswith(b"OMPI_COMM_WORLD_RANK="):
            return int(line.split(b"=")[1])
    return None


def kill_session(sid: int, sig: int = signal.SIGKILL, ranks_only: bool = False) -> None:
    """`sig` to mpirun and every rank it started, or to the ranks only, as Slurm signals a
    job step's tasks."""
    for pid in session_ranks(sid, ranks_only):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue


@pytest.fixture
def space(tmp_path: Path) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(SPACE)
    return path


@pytest.mark.mpi
def test_eight_trials_on_two_groups_of_two_prune_the_loser_and_match_training_alone(tmp_path):
    """8 trials queued in a known order, run by 2 groups of 2 ranks, data parallel or a
    pipeline within the group. The losing learning rate comes fifth: by the time a group asks
    for it, at least three trials have finished, so the median pruner (one start-up trial)
    judges it after its first epoch. The last asks for a batch larger than the data: it fails
    with its reason, and the sweep goes on."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    space = tmp_path / "space.yaml"
    space.write_text(E2E_SPACE)
    study = optuna.create_study(study_name="e2e", storage=storage, direction="maximize")
    for i, (lr, batch) in enumerate(ORDER):
        strategy = "pipeline" if i % 2 else "data"
        study.enqueue_trial({"lr": lr, "batch-size": batch, "strategy": strategy})
    argv = sweep(space, storage, "e2e", tmp_path / "out", "--trials", "8", "--group-size", "2")
    argv += ["--startup-trials", "1", "--tensorboard", str(tmp_path / "board"), *SHARED]
    done = ringtrain(*argv, ranks=4, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    trials = trials_of(storage, "e2e")
    assert len(trials) == 8
    refused = trials[7]
    assert refused.state == TrialState.FAIL
    assert "global batch 4096 exceeds" in refused.user_attrs[ledger.REASON]
    others = trials[:7]
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in others), trials
    by_lr = {t.params["lr"]: t for t in trials}
    loser = by_lr[LOSING_LR]
    assert loser.state == TrialState.PRUNED, loser
    assert loser.user_attrs[ledger.STEPS] < max(t.user_attrs[ledger.STEPS] for t in others)
    # Each group's trials on its own ranks, and every trial's line names its group and ranks.
    said = done.stdout + done.stderr
    for t in trials:
        group = t.user_attrs[ledger.GROUP]
        ranks = [2 * group, 2 * group + 1]
        assert t.user_attrs[ledger.RANKS] == ranks
        assert f"trial {t.number}: group {group}, ranks {ranks[0]},{ranks[1]} on " in said
    assert {t.user_attrs[ledger.GROUP] for t in trials} == {0, 1}
    # TensorBoard: a run per trial that trained, with its hyperparameters.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for t in others:
        board = EventAccumulator(str(tmp_path / "board" / f"trial-{t.number:05d}"))
        tags = board.Reload().Tags()["tensors"]
        assert "_hparams_/session_start_info" in tags and "loss" in tags, (t.number, tags)
    # A finished pipeline trial's weights are its configuration's, trained alone on one process.
    chosen = next(t for t in trials if t.state == TrialState.COMPLETE and t.number % 2)
    assert chosen.params["strategy"] == "pipeline"
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


def launched(argv: list[str], ranks: int) -> subprocess.Popen:
    """A sweep under mpirun in a session of its own, so that the test can signal its ranks."""
    cmd = [*MPIRUN, str(ranks), str(BIN / "ringtrain"), *argv]
    out = subprocess.DEVNULL
    return subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=out, stderr=out, start_new_session=True)


def wait_until(storage: str, study: str, ready, what: str) -> list:
    """Poll the study until `ready(trials)`; the trials then."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            trials = trials_of(storage, study)
        except UserError:  # the launch has not made the study yet
            trials = []
        if trials and ready(trials):
            return trials
        time.sleep(0.2)
    pytest.fail(f"no {what} within 300 s")


def running(trials: list, launches: set[str]) -> bool:
    """A trial of a new launch (not one of `launches`) is training."""
    return any(
        t.state == TrialState.RUNNING and t.user_attrs.get(ledger.LAUNCH) not in launches
        for t in trials
    )


@pytest.mark.mpi
def test_a_sweep_killed_then_preempted_continues_without_losing_or_repeating_a_trial(
    space, tmp_path
):
    """Two groups of one rank. The first launch is killed (SIGKILL, no checkpoint) once two
    trials are done; the second gets SIGUSR1, as Slurm's preemption warning, while it trains
    (it checkpoints, exits 75); the third finishes the study. Killed trials are failed and
    retried once; preempted ones are retried from their checkpoints; no completed trial runs
    again, and --trials counts a trial and its retries once."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    argv = sweep(space, storage, "cont", tmp_path / "out", "--trials", "6", "--group-size", "1")
    argv += ["--sampler", "random", "--pruner", "none", "--trial-heartbeat", "1", *SHARED]
    argv += ["--epochs", "6", "--checkpoint-every", "20"]
    first = launched(argv, 2)
    try:

        def two_done(trials):
            states = [t.state for t in trials]
            return states.count(TrialState.COMPLETE) >= 2 and TrialState.RUNNING in states

        wait_until(storage, "cont", two_done, "two finished trials and one running")
    finally:
        kill_session(first.pid)
        first.wait(60)
    before = {t.number: t for t in trials_of(storage, "cont")}
    completed = {n for n, t in before.items() if t.state == TrialState.COMPLETE}
    killed = {n for n, t in before.items() if t.state == TrialState.RUNNING}
    launches = {t.user_attrs.get(ledger.LAUNCH) for t in before.values()}  # None: killed asking
    second = launched(argv, 2)
    try:
        wait_until(storage, "cont", lambda trials: running(trials, launches), "new trial")
        time.sleep(1.0)  # past its first checkpoint
        kill_session(second.pid, signal.SIGUSR1, ranks_only=True)
        assert second.wait(120) == 75  # EXIT_CHECKPOINTED: requeue me
    finally:
        kill_session(second.pid)
    middle = trials_of(storage, "cont")
    preempted = {t.number for t in middle if "stop signal" in t.user_attrs.get(ledger.REASON, "")}
    assert preempted, [(t.number, t.state, t.user_attrs) for t in middle]
    last = ringtrain(*argv, ranks=2, timeout=600)
    assert last.returncode == 0, last.stdout[-2000:] + last.stderr[-3000:]
    assert "resumed from" in last.stdout  # a preempted trial's retry took up its checkpoint
    after = trials_of(storage, "cont")
    assert ledger.counted(after) == 6
    assert all(t.state != TrialState.RUNNING for t in after)
    for n in completed:  # kept as it was
        assert after[n].state == TrialState.COMPLETE
        assert after[n].user_attrs == before[n].user_attrs
        assert after[n].value == before[n].value
    retries: dict[int, list] = {}
    for t in after:
        if ledger.RETRY_OF in t.user_attrs:
            retries.setdefault(t.user_attrs[ledger.RETRY_OF], []).append(t)
    interrupted = killed | preempted
    originals = {ledger.original_number(after[n]) for n in interrupted}
    assert set(retries) == originals  # only interrupted trials run again
    for n in interrupted:
        assert after[n].state == TrialState.FAIL
        assert "interrupted" in after[n].user_attrs[ledger.REASON]
        again = retries[ledger.original_number(after[n])]
        assert again[-1].state == TrialState.COMPLETE, again
        for r in again:
            if ledger.LAUNCH in after[n].user_attrs:  # asked whole: the same parameters
                assert r.params == after[n].params, (n, r.params, after[n].params)
            else:  # killed while its parameters were drawn: those drawn are kept
                assert after[n].params.items() <= r.params.items(), (n, r.params)
    for n in killed:  # a crash is retried once; a preemption each time
        assert len(retries[n]) == 1 + len(preempted & {r.number for r in retries[n]})


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
    listed = tmp_path / "grid.yaml"
    listed.write_text("lr: {type: categorical, choices: [0.01, 0.1]}\n")
    grid = sweep(listed, storage, "grid", tmp_path / "out", "--trials", "3", "--sampler", "grid")
    one_line_error(ringtrain(*grid), "--trials 3 is more than the grid's 2 points")
    unwritable = sweep(space, "sqlite:////sys/s.db", "x", tmp_path / "out", "--trials", "2")
    one_line_error(ringtrain(*unwritable), "/sys is not writable")
    nobody = sweep(space, "postgresql://u:pw@127.0.0.1:1/db", "x", tmp_path / "o", "--trials", "2")
    done = ringtrain(*nobody)
    one_line_error(done, "--storage postgresql://u:***@127.0.0.1:1/db: connection failed")
    assert "pw" not in done.stderr


def test_a_study_with_another_space_or_direction_is_refused(space, tmp_path):
    """The study as a sweep over `space` left it (made here without training: the refusal
    comes before any), with a finished trial that must survive the refusals."""
    from ringtrain.sweep.space import as_record, load_space
    from ringtrain.sweep.storage import open_study, parse_storage

    storage = f"sqlite:///{tmp_path / 's.db'}"
    kept = open_study(
        parse_storage(storage),
        "kept",
        "maximize",
        as_record(load_space(str(space))),
        "val_accuracy",
        ["--model", "mlp"],
    )
    kept.enqueue_trial({"lr": 0.1, "batch-size": 32, "strategy": "data"})
    kept.tell(kept.ask(), 0.9)
    first = sweep(space, storage, "kept", tmp_path / "out", "--trials", "1", "--model", "mlp")
    minimize = [a if a != "maximize" else "minimize" for a in first]
    one_line_error(ringtrain(*minimize), "exists with --direction maximize")
    other = tmp_path / "other.yaml"
    other.write_text("lr: {type: float, low: 0.01, high: 0.5}\n")
    one_line_error(
        ringtrain(*sweep(other, storage, "kept", tmp_path / "o", "--trials", "1")),
        "exists with a different search space",
    )
    assert [t.state for t in trials_of(storage, "kept")] == [TrialState.COMPLETE]


def test_a_space_reads_as_train_flags_and_records_canonically():
    from ringtrain.sweep.space import as_record, parse_space

    space = parse_space(
        {
            "lr": {"type": "float", "low": 1e-4, "high": 0.3, "log": True},
            "batch-size": {"type": "int", "low": 32, "high": 128, "step": 32},
            "shuffle": {"type": "categorical", "choices": [True, False]},
            "model-arg.units": {"type": "categorical", "choices": [32, [64, 64]]},
        }
    )
    lr, batch, shuffle, units = space
    assert lr.flags(0.01) == ["--lr", "0.01"]
    assert batch.grid_values() == [32, 64, 96, 128]
    assert shuffle.flags(True) == ["--shuffle"] and shuffle.flags(False) == ["--no-shuffle"]
    assert units.flags([64, 64]) == ["--model-arg", "units=[64, 64]"]
    same = parse_space({p.name: json.loads(as_record([p]))[p.name] for p in reversed(space)})
    assert as_record(same) == as_record(space)  # the order of the file does not matter
    from ringtrain.sweep.flags import WITH_CHECKPOINTS, without

    shared = ["--keep", "2", "--lr", "0.1", "--checkpoint-every=5", "--epochs", "3"]
    assert without(shared, WITH_CHECKPOINTS) == ["--lr", "0.1", "--epochs", "3"]


@pytest.mark.mpi
def test_a_group_whose_rank_stops_ends_the_launch_naming_it(space, tmp_path):
    """A group of one rank stopped mid-trial (SIGSTOP: no connection breaks, so MPI never
    fails): the other group, done with the study, sees its trial stop beating and ends the
    launch in one line instead of waiting at the last barrier forever."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    argv = sweep(space, storage, "stuck", tmp_path / "out", "--trials", "3", "--group-size", "1")
    argv += ["--sampler", "random", "--pruner", "none", "--trial-heartbeat", "1", *SHARED]
    argv += ["--epochs", "6"]
    cmd = [*MPIRUN, "2", str(BIN / "ringtrain"), *argv]
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    launch = subprocess.Popen(cmd, env=ENV, cwd=ROOT, start_new_session=True, **out)
    try:

        def group_one(trials):
            return any(t.user_attrs.get(ledger.GROUP) == 1 for t in trials)

        wait_until(storage, "stuck", group_one, "a trial of group 1")
        stopped = [p for p in session_ranks(launch.pid) if rank_of(p) == 1]
        assert len(stopped) == 1
        os.kill(stopped[0], signal.SIGSTOP)
        output, _ = launch.communicate(timeout=300)
    finally:
        kill_session(launch.pid)
    assert launch.returncode == 3, output[-3000:]  # EXIT_SILENT_PEER
    assert "group 1 on " in output and "fell silent: no heartbeat for" in output, output[-3000:]
    assert "Traceback" not in output
