"""Model and pipeline parallelism over mpi4py equal single-process training."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    BIN,
    ENV,
    MPIRUN,
    REFERENCE_FLAGS,
    ROOT,
    assert_exact_resume,
    load_npz,
    mpi_checks,
    one_line_error,
    ringtrain,
)

from ringtrain.weights import relative_difference

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_gpipe_and_1f1b_equal_single_process_for_every_configuration(stages, tmp_path):
    everything = mpi_checks("pipeline", stages, tmp_path if stages == 2 else None)
    results = [r for r in everything if "check" not in r]
    assert_exact_resume([r for r in everything if r.get("check") == "resume"], stages == 2)
    assert len(results) == 28
    for r in results:
        assert r["rel_diff"] <= 1e-5, r
        assert r["loss_diff"] <= 1e-5, r
        c, m = r["config"], r["config"]["microbatches"]
        # Memory: 1F1B holds at most min(P - s, M) microbatches at stage s, GPipe holds M.
        expected = [m if c["schedule"] == "gpipe" else min(stages - s, m) for s in range(stages)]
        assert r["peak_inflight"] == expected, r
    seen = {
        (r["config"]["strategy"], r["config"]["schedule"], r["config"]["microbatches"])
        for r in results
    }
    assert ("model", "1f1b", 1) in seen and ("pipeline", "gpipe", 8) in seen
    assert any(r["config"]["sync_sends"] for r in results)  # Ssend: no reliance on buffering
    assert any(r["config"]["clip_norm"] for r in results)


@pytest.mark.parametrize(
    "strategy,schedule", [("pipeline", "gpipe"), ("pipeline", "1f1b"), ("model", "1f1b")]
)
def test_cli_pipeline_weights_equal_single_process(tmp_path, single_reference, strategy, schedule):
    weights, metrics = tmp_path / "w.npz", tmp_path / "m.json"
    trace, gantt = tmp_path / "trace.json", tmp_path / "gantt.png"
    micro = "1" if strategy == "model" else "4"
    done = ringtrain(
        "train",
        "--strategy",
        strategy,
        "--schedule",
        schedule,
        "--microbatches",
        micro,
        *REFERENCE_FLAGS,
        "--weights-out",
        str(weights),
        "--metrics-out",
        str(metrics),
        "--trace",
        str(trace),
        "--gantt",
        str(gantt),
        ranks=2,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert relative_difference(load_npz(weights), single_reference) <= 1e-5
    report = json.loads(metrics.read_text())
    assert report["partition"] == [[0, 2], [2, 4]]
    assert 0.0 <= report["bubble_measured"] < 1.0
    expected_bubble = 1 / (int(micro) + 1)  # (P-1)/(M+P-1) with P=2
    assert report["bubble_predicted"] == pytest.approx(expected_bubble)
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events} == {0, 1}
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_more_stages_than_layers_is_refused_on_every_rank():
    done = ringtrain("train", "--strategy", "pipeline", "--steps", "1", ranks=5, timeout=120)
    one_line_error(done, "5 pipeline stages but model 'mlp' has only 4 layers")


def _rank_pid(rank: int, launcher_pid: int) -> int:
    """The pid of the ringtrain process that Open MPI started as `rank`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ringtrain" in cmdline and f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no process for rank {rank} under launcher {launcher_pid}")


def test_a_stopped_stage_ends_the_job_within_the_comm_timeout_naming_the_stage(tmp_path):
    timeout = 5
    cmd = [
        *MPIRUN,
        "2",
        str(BIN / "ringtrain"),
        "train",
        "--strategy",
        "pipeline",
        "--steps",
        "100000",
        "--comm-timeout",
        str(timeout),
    ]
    job = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "partition" not in line and time.monotonic() < deadline:
            line = job.stdout.readline()
        time.sleep(3)  # well inside the training steps
        os.kill(_rank_pid(1, job.pid), signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = job.communicate(timeout=timeout + 30)
        assert time.monotonic() - stopped <= timeout + 30
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert "stage 1 (rank 1) went silent" in stderr
