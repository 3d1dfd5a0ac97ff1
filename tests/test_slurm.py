"""The Slurm templates under a real single-node Slurm: each one trains and completes, a rendered
copy does too, a killed rank ends its srun step, and a preempted job checkpoints, is requeued
and resumes to the weights of an uninterrupted run.

The cluster (tests/slurm_cluster.py) is started once for the session and always stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from conftest import ENV, ROOT, load_npz
from slurm_cluster import JobRecord, SlurmCluster

from ringtrain.weights import relative_difference

pytestmark = pytest.mark.slurm

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
TINY = ["--steps", "3", "--batch-size", "32"]
JOB_TIMEOUT = 240  # seconds for one `sbatch --wait`; a job also carries --time as a backstop
JOB_LIMIT = "--time=10"  # minutes: Slurm itself ends a job that went wrong
# The templates find slurm/common.sh and the venv through RINGTRAIN_HOME; the tests submit
# from a temporary folder (where %x-%j.out lands), so it is set to this checkout.
HOME = {"RINGTRAIN_HOME": str(ROOT)}


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """One real cluster for the session; its daemons are stopped even if a test failed."""
    path = f"/usr/sbin:/sbin:{ENV['PATH']}"
    missing = [name for name in DAEMONS if shutil.which(name, path=path) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)}: scripts/setup.sh installs Slurm and munge")
    cluster = SlurmCluster(ENV)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        cluster.remove()


def output_of(record: JobRecord) -> str:
    """The job's %x-%j.out (stdout and stderr of the batch script and every rank)."""
    path = Path(record.fields["StdOut"])
    return path.read_text(errors="replace") if path.exists() else f"(no {path})"


def run_job(
    slurm: SlurmCluster,
    argv: list[str],
    cwd: Path,
    env: Mapping[str, str] | None = None,
) -> tuple[JobRecord, str]:
    """sbatch --wait one job; return its final record and output, having checked sbatch's exit
    code agrees with the record (it does not for a job cancelled while pending)."""
    job_id, done = slurm.sbatch_wait([JOB_LIMIT, *argv], cwd=cwd, env=env, timeout=JOB_TIMEOUT)
    record = slurm.final_record(job_id)
    output = output_of(record)
    assert done.returncode == record.exit_code, (done.returncode, record, output[-3000:])
    return record, output


def assert_trained(record: JobRecord, output: str, metrics: Path, strategy: str, ranks: int):
    """Finished once, exit 0, and rank 0 reported the result and wrote the metrics."""
    assert (record.state, record.exit_code, record.restarts) == ("COMPLETED", 0, 0), (
        record,
        output[-3000:],
    )
    assert "held-out accuracy" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    report = json.loads(metrics.read_text())
    assert (report["strategy"], report["world_size"], report["steps"]) == (strategy, ranks, 3)
    assert report["finished"] is True
    return report


@pytest.mark.parametrize(
    "template, sbatch_options, env, strategy, ranks",
    [
        ("data-1node.sbatch", [], {}, "data", 2),
        # One node here; the template's --nodes=2 is what an sbatch option overrides.
        ("data-multinode.sbatch", ["--nodes=1"], {}, "data", 2),
        ("pipeline.sbatch", ["--ntasks-per-node=2"], {}, "pipeline", 2),
        # Four tasks on two cores: slurm.conf claims CPUs=8 (SLURM.md).
        ("hybrid.sbatch", [], {"PP_SIZE": "2"}, "hybrid", 4),
    ],
)
def test_template_trains_and_completes_under_sbatch(
    slurm, tmp_path, template, sbatch_options, env, strategy, ranks
):
    metrics = tmp_path / "metrics.json"
    record, output = run_job(
        slurm,
        [*sbatch_options, str(ROOT / "slurm" / template), *TINY, "--metrics-out", str(metrics)],
        cwd=tmp_path,
        env={**HOME, **env},
    )
    report = assert_trained(record, output, metrics, strategy, ranks)
    assert Path(record.fields["StdOut"]).name == f"{record.fields['JobName']}-{record.job_id}.out"
    # The checkpoint folder the template names (CKPT_DIR's default, in the submit folder).
    assert list((tmp_path / f"ckpt-{record.fields['JobName']}").glob("step-*/manifest.json"))
    if strategy == "hybrid":
        assert (report["dp_size"], report["pp_size"]) == (2, 2)


def test_rendered_script_runs_under_sbatch_from_any_folder(slurm, tmp_path):
    """A rendered copy carries this checkout's path, so it needs no RINGTRAIN_HOME."""
    script, metrics = tmp_path / "job.sbatch", tmp_path / "metrics.json"
    train_args = [*TINY, "--metrics-out", str(metrics)]
    render = [
        *("slurm", "render", "--strategy", "data", "--nodes", "1", "--ntasks-per-node", "2"),
        *("--time", "00:05:00", "--job-name", "rendered", "--output", str(script)),
    ]
    done = slurm.client(
        [str(ROOT / ".venv" / "bin" / "ringtrain"), *render, "--", *train_args], cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    record, output = run_job(slurm, [str(script)], cwd=tmp_path)
    assert_trained(record, output, metrics, "data", 2)
    assert record.fields["JobName"] == "rendered"
    assert (tmp_path / f"rendered-{record.job_id}.out").exists()


def test_killed_rank_ends_the_srun_step(slurm, tmp_path):
    """SIGKILL on one rank mid-training: srun ends the step, non-zero, well within 30 s."""
    name = f"kill-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "srun.out"
    argv = ["srun", "--mpi=pmix", "-n", "2", f"--job-name={name}", JOB_LIMIT]
    argv += ["ringtrain", "train", "--strategy", "data", "--steps", "100000"]
    with open(log, "w") as out:
        step = subprocess.Popen(
            argv, cwd=tmp_path, env=slurm.env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_for_text(log, "epoch 1/", step, timeout=120)
        job_id = job_id_of(slurm, name)
        victims = rank_pids(slurm, job_id, rank=1)
        assert victims, slurm.client(["scontrol", "listpids", str(job_id)]).stdout
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            returncode = step.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"srun still running 30 s after rank 1 was killed:\n{log.read_text()}")
        assert time.monotonic() - killed < 30
        assert returncode != 0, log.read_text()
        record = slurm.final_record(job_id)
        assert record.state != "COMPLETED", record
    finally:
        if step.poll() is None:
            step.kill()
            step.wait(timeout=10)


def test_preempted_job_checkpoints_requeues_and_resumes_to_the_uninterrupted_weights(
    slurm, tmp_path
):
    """USR1 to the batch shell mid-training: the step checkpoints and exits 75, common.sh
    requeues the job, and the rerun resumes; the final weights equal an uninterrupted run's."""
    # Long enough that the signal lands well before the end; the order of Horovod's sums is
    # fixed (no fusion buffer) so the two runs can agree bit for bit.
    flags = ["--steps", "2000", "--batch-size", "32", "--seed", "3"]
    env = {**HOME, "HOROVOD_FUSION_THRESHOLD": "0"}
    template = str(ROOT / "slurm" / "data-1node.sbatch")

    whole = tmp_path / "whole"
    whole.mkdir()
    record, output = run_job(
        slurm, [template, *flags, "--weights-out", str(whole / "w.npz")], cwd=whole, env=env
    )
    assert (record.state, record.exit_code, record.restarts) == ("COMPLETED", 0, 0), output

    cut = tmp_path / "preempted"
    cut.mkdir()
    name = f"preempt-{uuid.uuid4().hex[:8]}"
    argv = ["sbatch", "--wait", JOB_LIMIT, f"--job-name={name}", template, *flags]
    argv += ["--weights-out", str(cut / "w.npz")]
    batch = subprocess.Popen(
        argv,
        cwd=cut,
        env={**slurm.env, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        job_id = job_id_of(slurm, name)
        out = cut / f"{name}-{job_id}.out"
        wait_for_text(out, "epoch 1/", batch, timeout=120)
        slurm.client(["scancel", "--batch", "--signal=USR1", str(job_id)])
        returncode = batch.wait(timeout=JOB_TIMEOUT)
    finally:
        if batch.poll() is None:
            batch.kill()
            batch.wait(timeout=10)
    record = slurm.final_record(job_id)
    output = out.read_text(errors="replace")
    assert (record.state, record.exit_code, returncode) == ("COMPLETED", 0, 0), (record, output)
    assert record.restarts == 1, (record, output)
    assert f"requeueing job {job_id}" in output, output
    stopped = [line for line in output.splitlines() if line.startswith("stopped after step ")]
    resumed = [line for line in output.splitlines() if line.startswith("resumed from ")]
    assert len(stopped) == 1 and len(resumed) == 1, output
    step = int(stopped[0].split()[3])
    assert 0 < step < 2000 and resumed[0].endswith(f"at step {step}"), output
    assert relative_difference(load_npz(cut / "w.npz"), load_npz(whole / "w.npz")) <= 1e-6


# --- helpers ----------------------------------------------------------------------------------


def wait_for_text(path: Path, text: str, process: subprocess.Popen, timeout: float) -> None:
    """Until `text` appears in the file; fail early if the process watched already ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if process.poll() is not None:
            content = path.read_text(errors="replace") if path.exists() else "(no output)"
            pytest.fail(f"ended ({process.returncode}) before printing {text!r}:\n{content}")
        time.sleep(0.2)
    pytest.fail(f"no {text!r} in {path} after {timeout} s")


def job_id_of(slurm: SlurmCluster, name: str, timeout: float = 30) -> int:
    """The id of the one job with this (unique) name, once Slurm has it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids = slurm.client(["squeue", "-h", "-n", name, "-o", "%i"]).stdout.split()
        if ids:
            return int(ids[0])
        time.sleep(0.2)
    pytest.fail(f"no job named {name} after {timeout} s")


def rank_pids(slurm: SlurmCluster, job_id: int, rank: int) -> list[int]:
    """PIDs of one rank's `ringtrain train` process, from slurmd's own list of the job's tasks."""
    listing = slurm.client(["scontrol", "listpids", str(job_id)]).stdout.splitlines()[1:]
    pids = []
    for line in listing:
        pid, _job, _step, _local, global_id = line.split()[:5]
        if global_id == str(rank):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"ringtrain" in cmdline:
                pids.append(int(pid))
    return pids
