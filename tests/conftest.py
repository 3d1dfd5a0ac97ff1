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
# Open MPI's own 1 s between a failed job's SIGTERM and SIGKILL. ringtrain's installed 5 s
# (time for a rank on a loaded node to name a silent peer) makes mpirun take about 10 s to end
# any failed job, which launches about what the ranks said before they left need not wait.
OPEN_MPI_TEARDOWN = ("--mca", "odls_base_sigkill_timeout", "1")


def run(cmd: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run a command; a hang fails the test by the timeout instead of stalling CI."""
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT, **kwargs
    )


def ringtrain(*args: str, ranks: int | None = None, timeout: float = 300):
    cli = [str(BIN / "ringtrain"), *args]
    return run(
        cli if ranks is None else [*MPIRUN, str(ranks), *OPEN_MPI_TEARDOWN, *cli], timeout=timeout
    )


def mpi_checks(ranks: int, resume_dir: Path) -> list[dict]:
    """One mpirun whose ranks check every strategy that fits this world size against the
    independent reference (tests/mpi_checks.py), then stop and resume runs in resume_dir.
    Returns rank 0's JSON lines: one per configuration, and resume checks ("check": "resume")."""
    script = [sys.executable, str(ROOT / "tests" / "mpi_checks.py"), str(resume_dir)]
    done = run([*MPIRUN, str(ranks), *script], timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


class GridChecks:
    """mpi_checks once per world size per session: the test files share those runs."""

    def __init__(self, tmp_path_factory):
        self.tmp, self.lines = tmp_path_factory, {}

    def _lines(self, ranks: int) -> list[dict]:
        if ranks not in self.lines:
            self.lines[ranks] = mpi_checks(ranks, self.tmp.mktemp(f"resume-{ranks}-ranks"))
        return self.lines[ranks]

    def results(self, ranks: int, *strategies: str) -> list[dict]:
        """The configurations of these strategies that ran on this many ranks."""
        return [
            r
            for r in self._lines(ranks)
            if "check" not in r and r["config"]["strategy"] in strategies
        ]

    def keras(self, ranks: int) -> list[dict]:
        """The user-model zoo's runs on this many ranks, against Keras's own fit."""
        return [r for r in self._lines(ranks) if r.get("check") == "keras"]

    def resumes(self, ranks: int, strategy: str) -> list[dict]:
        return [
            r
            for r in self._lines(ranks)
            if r.get("check") == "resume" and r["config"]["strategy"] == strategy
        ]


@pytest.fixture(scope="session")
def grid_checks(tmp_path_factory) -> GridChecks:
    return GridChecks(tmp_path_factory)


def assert_matches_reference(results: list[dict]) -> None:
    """Every configuration's update and loss curve within its bound; prints each case's worst
    tensor, so a run with -s shows the figures."""
    assert results
    for r in results:
        c, u = r["config"], r["update"]
        print(
            f"{c['strategy']} on {r['world_size']} rank(s), {c['model']} {c['optimizer']} "
            f"lr {c['lr']}, M={c['microbatches']} {c['schedule']}: worst {u['worst_tensor']} "
            f"{u['worst_relative']:.2e} ({u['worst_ratio']:.3f} of its allowance), "
            f"loss diff {r['loss_diff']:.1e}"
        )
    for r in results:
        assert r["update"]["passed"] and r["update"]["worst_ratio"] <= 1.0, r
        assert r["losses_passed"] and r["loss_diff"] <= r["loss_atol"], r


def assert_exact_resume(checks: list[dict]) -> None:
    """S steps == S/2 steps, checkpoint, stop, resume to S: the same losses and weights, bit
    for bit (same strategy, world size and thread count)."""
    assert checks
    for c in checks:
        assert c["stopped_finished"] is False, c
        assert c["stopped_steps"] == c["steps"][0] // 2, c
        assert c["steps"][0] == c["steps"][1] > c["stopped_steps"], c
        assert c["same_weight_names"], c
        assert c["resumed_from_the_stop"], c  # --initial-weights-out wrote the restored weights
        assert c["weights_max_abs_diff"] == 0.0 and c["losses_max_abs_diff"] == 0.0, c


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as stored:
        return {k: stored[k] for k in stored.files}


def compare_weight_files(run: Path, reference: Path, initial: Path):
    """Two --weights-out files of one model, compared by their updates from the weights in
    `initial`: an --initial-weights-out file one of the runs wrote (reference.compare_updates)."""
    from reference import compare_updates

    return compare_updates(load_npz(initial), load_npz(run), load_npz(reference))


def one_line_error(done: subprocess.CompletedProcess, needle: str) -> None:
    """A bad input: non-zero exit, a line naming the problem, and no traceback."""
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert lines, done.stderr[-2000:]
    assert any(needle in line for line in lines), lines


class CliReference:
    """The independent reference for the shared CLI runs (REFERENCE_FLAGS), trained once: from
    the initial weights the first run wrote. Every later run must have started from the very
    same weights, whatever its strategy, or it is not comparable (and something is wrong)."""

    def __init__(self):
        self.digest: str | None = None
        self.trained = None

    def starting_from(self, initial: Path):
        from reference import load_digits, train_reference, weights_digest

        digest = weights_digest(initial)
        if self.trained is None:
            self.digest = digest
            self.trained = train_reference(load_digits(), initial, **REFERENCE_RUN)
        assert digest == self.digest, (
            f"{initial} holds other initial weights than the first run's: "
            f"{differing_tensors(load_npz(initial), self.trained.initial)}"
        )
        return self.trained


def differing_tensors(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    """Names held by one only, or with other values."""
    return sorted(
        k for k in a.keys() | b.keys() if k not in a or k not in b or not np.array_equal(a[k], b[k])
    )


@pytest.fixture(scope="session")
def cli_reference() -> CliReference:
    return CliReference()


def train_matches_reference(
    reference: CliReference, folder: Path, *args: str, ranks: int | None = None, fp16: bool = False
) -> tuple[subprocess.CompletedProcess, dict]:
    """`ringtrain train ARGS REFERENCE_FLAGS`: its --weights-out and its per-step losses held to
    the independent reference, trained from the run's --initial-weights-out. Returns the run
    and its --metrics-out report."""
    from reference import compare_with

    initial, weights, metrics = folder / "initial.npz", folder / "w.npz", folder / "m.json"
    done = ringtrain(
        "train",
        *args,
        *REFERENCE_FLAGS,
        "--initial-weights-out",
        str(initial),
        "--weights-out",
        str(weights),
        "--metrics-out",
        str(metrics),
        ranks=ranks,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(metrics.read_text())
    result = compare_with(
        reference.starting_from(initial), load_npz(weights), report["losses"], fp16
    )
    print(result)
    assert result["update"]["passed"] and result["losses_passed"], result
    return done, report


# A short run under plain SGD, whose update scales with the gradient: a gradient summed where it
# should be averaged, or counted twice, moves the weights by that factor (Adam's update would hide
# it). REFERENCE_RUN is the same run spelled out.
REFERENCE_FLAGS = ["--model", "mlp", "--steps", "5", "--batch-size", "48", "--seed", "1"]
REFERENCE_FLAGS += ["--optimizer", "sgd", "--lr", "0.1"]
REFERENCE_RUN = {
    "model": "mlp",
    "optimizer": "sgd",
    "lr": 0.1,
    "batch_size": 48,
    "steps": 5,
    "seed": 1,
}


@pytest.fixture(scope="session")
def before_tensorflow(tmp_path_factory):
    """`ringtrain ARGS` where importing TensorFlow fails (exit 70): a bad input it still
    refuses with its own line was refused before TensorFlow loaded, seconds sooner."""
    shadow = tmp_path_factory.mktemp("shadow")
    (shadow / "tensorflow").mkdir()
    (shadow / "tensorflow" / "__init__.py").write_text("raise ImportError('TensorFlow loaded')")
    path = os.pathsep.join(p for p in (str(shadow), ENV.get("PYTHONPATH")) if p)

    def ringtrain_without_tensorflow(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "ringtrain"), *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env={**ENV, "PYTHONPATH": path},
        )

    return ringtrain_without_tensorflow
