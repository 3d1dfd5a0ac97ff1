"""Shared helpers: run the real CLI, under mpirun or horovodrun, and read what rank 0 wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {
    **os.environ,
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
}
MPIRUN = ["mpirun", "--oversubscribe", "-np"]


def run(cmd: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run a command; a hang fails the test by the timeout instead of stalling CI."""
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT, **kwargs
    )


def ringtrain(*args: str, ranks: int | None = None, timeout: float = 300):
    cli = [str(BIN / "ringtrain"), *args]
    return run(cli if ranks is None else [*MPIRUN, str(ranks), *cli], timeout=timeout)


def mpi_checks(suite: str, ranks: int, resume_dir: Path | None = None) -> list[dict]:
    """One mpirun that checks many configurations inside the ranks (tests/mpi_checks.py);
    with resume_dir it also checks stop-and-resume against uninterrupted runs there (asserted
    here). Returns the per-configuration results."""
    script = [sys.executable, str(ROOT / "tests" / "mpi_checks.py"), suite]
    done = run(
        [*MPIRUN, str(ranks), *script, *([str(resume_dir)] if resume_dir else [])], timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert_exact_resume([r for r in results if r.get("check") == "resume"], resume_dir is not None)
    return [r for r in results if "check" not in r]


def assert_exact_resume(checks: list[dict], expected: bool) -> None:
    """S steps == S/2 steps, checkpoint, stop, resume to S: losses and weights, SGD and Adam."""
    if not expected:
        assert checks == []
        return
    assert sorted(c["optimizer"] for c in checks) == ["adam", "sgd"]
    for c in checks:
        assert c["stopped_finished"] is False and c["stopped_steps"] == 3, c
        assert c["steps"] == [6, 6], c
        assert c["rel_diff"] <= 1e-6 and c["loss_diff"] <= 1e-6, c


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as stored:
        return {k: stored[k] for k in stored.files}


def one_line_error(done: subprocess.CompletedProcess, needle: str) -> None:
    """A bad input: non-zero exit, a line naming the problem, and no traceback."""
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert lines, done.stderr[-2000:]
    assert any(needle in line for line in lines), lines


@pytest.fixture(scope="session")
def single_reference(tmp_path_factory) -> dict:
    """Single-process weights for the shared CLI comparison runs (mlp, SGD, 5 steps)."""
    out = tmp_path_factory.mktemp("single") / "weights.npz"
    done = ringtrain("train", "--strategy", "single", *REFERENCE_FLAGS, "--weights-out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    return load_npz(out)


REFERENCE_FLAGS = [
    "--model",
    "mlp",
    "--optimizer",
    "sgd",
    "--lr",
    "0.05",
    "--steps",
    "5",
    "--batch-size",
    "48",
    "--seed",
    "1",
]
