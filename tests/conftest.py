"""Shared helpers: run the real CLI, under mpirun or horovodrun, and read what rank 0 wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
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
        assert c["weights_max_abs_diff"] == 0.0 and c["losses_max_abs_diff"] == 0.0, c


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as stored:
        return {k: stored[k] for k in stored.files}


def compare_weight_files(run: Path, reference: Path, model: str, seed: int):
    """Two --weights-out files of digits runs, compared by their updates from the initial
    weights the seed gives (ringtrain.weights.compare_updates)."""
    from ringtrain.data import load_digits
    from ringtrain.models import BUILTIN
    from ringtrain.weights import compare_updates, named_weights

    data = load_digits()
    spec = BUILTIN[model](data.input_shape, data.n_classes)
    initial = named_weights(spec.build(range(len(spec)), seed))
    return compare_updates(initial, load_npz(run), load_npz(reference))


def one_line_error(done: subprocess.CompletedProcess, needle: str) -> None:
    """A bad input: non-zero exit, a line naming the problem, and no traceback."""
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert lines, done.stderr[-2000:]
    assert any(needle in line for line in lines), lines


@pytest.fixture(scope="session")
def cli_reference():
    """The independent reference (tests/reference.py) for the shared CLI runs."""
    from reference import train_reference

    from ringtrain.data import load_digits

    return train_reference(load_digits(), **REFERENCE_RUN)


def train_matches_reference(
    reference, folder: Path, *args: str, ranks: int | None = None, fp16: bool = False
) -> tuple[subprocess.CompletedProcess, dict]:
    """`ringtrain train ARGS REFERENCE_FLAGS`: its --weights-out and its per-step losses held to
    the independent reference. Returns the run and its --metrics-out report."""
    from reference import compare_with

    weights, metrics = folder / "w.npz", folder / "m.json"
    done = ringtrain(
        "train",
        *args,
        *REFERENCE_FLAGS,
        "--weights-out",
        str(weights),
        "--metrics-out",
        str(metrics),
        ranks=ranks,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(metrics.read_text())
    result = compare_with(reference, load_npz(weights), report["losses"], fp16)
    print(result)
    assert result["update"]["passed"] and result["losses_passed"], result
    return done, report


# The CLI's defaults (Adam, --lr 0.003) on a short run; REFERENCE_RUN is the same run spelled out.
REFERENCE_FLAGS = ["--model", "mlp", "--steps", "5", "--batch-size", "48", "--seed", "1"]
REFERENCE_RUN = {
    "model": "mlp",
    "optimizer": "adam",
    "lr": 0.003,
    "batch_size": 48,
    "steps": 5,
    "seed": 1,
}


# ---- the rehearsal cluster every cluster test shares --------------------------------------

# One `ringtrain cluster up` per session: 24 nodes (a pair for each of test_node_faults'
# twelve fault runs), 2 CPUs each, Slurm, every link capped at 1gbit (test_cluster measures
# the cap). Its node names are fixed, so one cluster at a time: the tests that take it down or
# bring up a cluster of their own run after every test that shares it (see the ordering below).
REHEARSAL_NODES = 24
REHEARSAL_LINK = "1gbit"
REHEARSAL_UP = [
    *("--nodes", str(REHEARSAL_NODES), "--link", REHEARSAL_LINK),
    *("--slurm", "--cpus-per-node", "2"),
]


def cluster(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([str(BIN / "ringtrain"), "cluster", *args], timeout=timeout)


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the cluster tests need root: they create network namespaces and veths")


def bring_up(*args: str) -> subprocess.CompletedProcess:
    """`ringtrain cluster up`; a machine that cannot make namespaces fails here, in one line.
    No `down` after a failure: a failed `up` removed what it made, and a refused one must
    leave the cluster already running (another session's) alone."""
    require_root()
    done = cluster("up", *args)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        pytest.fail(f"ringtrain cluster up {' '.join(args)} failed: {lines[-1]}")
    return done


@dataclass
class Rehearsal:
    """The shared cluster: what `up` printed, and the environment its Slurm clients need."""

    output: str
    env: dict[str, str]
    running: bool = True

    def down(self) -> subprocess.CompletedProcess:
        self.running = False
        return cluster("down")


_shared: list[Rehearsal] = []  # the session's cluster, once brought up


def take_down_shared_cluster() -> None:
    """Before a test brings up a cluster of its own: the shared one goes, if it is up."""
    if _shared and _shared[0].running:
        _shared[0].down()


@pytest.fixture(scope="session")
def rehearsal_cluster() -> Iterator[Rehearsal]:
    """The cluster the cluster tests share; down at the session's end even when a test failed.
    A test that damages a node heals it before it ends."""
    from ringtrain.cluster.layout import STATE_DIR

    done = bring_up(*REHEARSAL_UP)
    slurm_conf = STATE_DIR / "slurm" / "etc" / "slurm.conf"
    _shared.append(Rehearsal(done.stdout, {**ENV, "SLURM_CONF": str(slurm_conf)}))
    try:
        yield _shared[0]
    finally:
        take_down_shared_cluster()


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "ends_shared_cluster: takes the shared cluster down, after its users"
    )
    config.addinivalue_line(
        "markers", "own_cluster: brings up a cluster of its own (runs after the shared one is down)"
    )


def pytest_collection_modifyitems(items) -> None:
    """The shared cluster's users run together at the end, so it is up once; then the test
    that takes it down, then the tests with a cluster of their own. Otherwise the order stays."""

    def rank(item) -> int:
        if item.get_closest_marker("own_cluster"):
            return 3
        if item.get_closest_marker("ends_shared_cluster"):
            return 2
        return 1 if "rehearsal_cluster" in item.fixturenames else 0

    items.sort(key=rank)
