"""When things go wrong: killed and stopped ranks end the job in bounded time, a crash while
writing a checkpoint loses nothing, and a stop signal checkpoints all ranks at one step."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN, ENV, MPIRUN, ROOT, compare_weight_files, load_npz, ringtrain

from ringtrain.checkpoint import MANIFEST

pytestmark = pytest.mark.mpi

KILL_BOUND = 30  # seconds, generous: Open MPI ends the job within a few
STRATEGY_ARGS = {
    "data": (2, ["--strategy", "data"]),
    "pipeline": (2, ["--strategy", "pipeline", "--microbatches", "4"]),
    "hybrid": (4, ["--strategy", "hybrid", "--pp-size", "2", "--microbatches", "2"]),
}


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def rank_pid(rank: int, launcher: int) -> int:
    """The pid of the process the launcher (an ancestor) started as `rank`."""
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"OMPI_COMM_WORLD_RANK={rank}".encode() not in environ:
                continue
            ancestor = pid
            while ancestor > 1 and ancestor != launcher:
                ancestor = _parent(ancestor)
        except (OSError, ValueError, IndexError):
            continue
        if ancestor == launcher:
            return pid
    raise AssertionError(f"no process for rank {rank} under launcher {launcher}")


def start_training(ranks: int, args: list[str]) -> subprocess.Popen:
    """Start a long run and return once rank 0 has finished its first epoch: mid-training."""
    cmd = [*MPIRUN, str(ranks), str(BIN / "ringtrain"), "train", *args, "--steps", "100000"]
    job = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT
    )
    deadline = time.monotonic() + 120
    line = ""
    while "held-out accuracy" not in line and job.poll() is None and time.monotonic() < deadline:
        line = job.stdout.readline()
    # The fault must hit training, not start-up: a whole epoch of steps is behind it.
    assert "held-out accuracy" in line and job.poll() is None, (line, job.returncode)
    return job


def wait_bounded(job: subprocess.Popen, bound: float) -> tuple[float, str]:
    started = time.monotonic()
    try:
        _, stderr = job.communicate(timeout=bound + 30)
    finally:
        if job.poll() is None:
            job.kill()
    return time.monotonic() - started, stderr


@pytest.mark.parametrize("strategy", ["data", "pipeline", "hybrid"])
def test_a_killed_rank_ends_the_job_within_30_seconds(strategy):
    ranks, args = STRATEGY_ARGS[strategy]
    job = start_training(ranks, args)
    os.kill(rank_pid(1, job.pid), signal.SIGKILL)
    seconds, _ = wait_bounded(job, KILL_BOUND)
    assert job.returncode != 0
    assert seconds <= KILL_BOUND


@pytest.mark.parametrize("strategy", ["data", "pipeline", "hybrid"])
def test_a_stopped_rank_ends_the_job_within_the_timeout_plus_30_seconds(strategy):
    timeout = 8
    ranks, args = STRATEGY_ARGS[strategy]
    job = start_training(ranks, [*args, "--comm-timeout", str(timeout)])
    os.kill(rank_pid(1, job.pid), signal.SIGSTOP)
    seconds, stderr = wait_bounded(job, timeout + 30)
    assert job.returncode != 0
    assert seconds <= timeout + 30
    assert "no progress for 8 s" in stderr
    if strategy == "pipeline":  # the stage that went silent is named
        assert "stage 1 (rank 1) went silent" in stderr


def test_a_crash_between_parts_and_manifest_keeps_the_previous_checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    common = ["--strategy", "single", "--steps", "6", "--checkpoint-dir", str(folder)]
    good = ringtrain("train", *common, "--stop-after", "2")
    assert good.returncode == 75, good.stderr[-1000:]
    crashed = subprocess.run(
        [str(BIN / "ringtrain"), "train", *common, "--resume", "--stop-after", "4"],
        env={**ENV, "RINGTRAIN_TEST_CRASH_BEFORE_MANIFEST": "1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert crashed.returncode == 9
    assert (folder / "step-00000004" / "model.npz").exists()
    assert not (folder / "step-00000004" / MANIFEST).exists()
    resumed = ringtrain("train", *common, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-1000:]
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout


def test_sigusr1_checkpoints_every_rank_at_one_step_and_exits_75_then_resume_finishes(tmp_path):
    folder, weights = tmp_path / "ckpt", tmp_path / "w.npz"
    flags = [
        "--strategy",
        "data",
        "--model",
        "mlp",
        "--optimizer",
        "adam",
        "--batch-size",
        "32",
        "--seed",
        "4",
        "--epochs",
        "40",
        "--checkpoint-dir",
        str(folder),
    ]
    cmd = [*MPIRUN, "2", str(BIN / "ringtrain"), "train", *flags]
    job = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT
    )
    line = ""
    while "epoch 1/40" not in line:
        line = job.stdout.readline()
        assert line or job.poll() is None, "the run ended before its first epoch"
    job.send_signal(signal.SIGUSR1)  # mpirun forwards SIGUSR1 to every rank
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 75, stderr[-2000:]
    saved = sorted(folder.glob("step-*"))
    assert len(saved) == 1 and (saved[0] / MANIFEST).exists()
    stopped_at = int(saved[0].name.split("-")[1])
    total = 40 * (1437 // 32)
    assert 0 < stopped_at < total
    finish = ringtrain(
        "train", *flags, "--resume", "--weights-out", str(weights), ranks=2, timeout=600
    )
    assert finish.returncode == 0, finish.stderr[-2000:]
    assert f"resumed from {folder} at step {stopped_at}" in finish.stdout
    assert load_npz(weights)


def test_a_data_parallel_checkpoint_resumes_as_single_process_with_the_same_weights(tmp_path):
    folder, a, b = tmp_path / "ckpt", tmp_path / "a.npz", tmp_path / "b.npz"
    flags = ["--model", "mlp", "--optimizer", "adam", "--steps", "6", "--batch-size", "32"]
    stop = ringtrain(
        "train",
        "--strategy",
        "data",
        *flags,
        "--stop-after",
        "3",
        "--checkpoint-dir",
        str(folder),
        ranks=2,
    )
    assert stop.returncode == 75, stop.stderr[-2000:]
    single = ringtrain(
        "train",
        "--strategy",
        "single",
        *flags,
        "--resume",
        "--checkpoint-dir",
        str(folder),
        "--weights-out",
        str(a),
    )
    assert single.returncode == 0, single.stderr[-2000:]
    start = tmp_path / "initial.npz"  # the uninterrupted run's, which the updates are from
    outputs = ["--weights-out", str(b), "--initial-weights-out", str(start)]
    whole = ringtrain("train", "--strategy", "single", *flags, *outputs)
    assert whole.returncode == 0, whole.stderr[-2000:]
    comparison = compare_weight_files(a, b, start)
    assert comparison.passed, comparison


def test_only_the_last_k_checkpoints_are_kept(tmp_path):
    folder = tmp_path / "ckpt"
    done = ringtrain(
        "train",
        "--strategy",
        "single",
        "--steps",
        "5",
        "--checkpoint-dir",
        str(folder),
        "--checkpoint-every",
        "1",
        "--keep",
        "2",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000004", "step-00000005"]
    assert all((p / MANIFEST).exists() for p in folder.iterdir())
