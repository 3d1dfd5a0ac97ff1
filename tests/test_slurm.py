"""The Slurm templates under a real single-node Slurm: each one trains and completes, a rendered
copy does too, a killed rank ends its srun step, a preempted job checkpoints, is requeued and
resumes to the weights of an uninterrupted run, and a cancelled one checkpoints and stays
cancelled.

The cluster (ringtrain/cluster/slurm.py, the harness `ringtrain cluster up --slurm` uses too) is
started once for the session and always stopped.
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
from conftest import BIN, ENV, ROOT, compare_weight_files

from ringtrain.cluster.slurm import JobRecord, SlurmCluster, Submission

pytestmark = pytest.mark.slurm

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
TINY = ["--steps", "3", "--batch-size", "32"]
JOB_TIMEOUT = 240  # seconds for one `sbatch --wait`; a job also carries --time as a backstop
JOB_LIMIT = "--time=10"  # minutes: Slurm itself ends a job that went wrong
# Jobs are submitted without the venv on PATH, as from a fresh login shell: the batch script
# must activate it itself (slurm/common.sh).
SYSTEM_PATH = os.pathsep.join(p for p in ENV["PATH"].split(os.pathsep) if Path(p) != BIN)
# The templates find slurm/common.sh and the venv through RINGTRAIN_HOME; the tests submit
# from a temporary folder (where %x-%j.out lands), so it is set to this checkout.
HOME = {"RINGTRAIN_HOME": str(ROOT), "PATH": SYSTEM_PATH}
DATA_1NODE = str(ROOT / "slurm" / "data-1node.sbatch")


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """One real cluster for the session; its daemons are stopped even if a test failed."""
    path = f"/usr/sbin:/sbin:{ENV['PATH']}"
    missing = [name for name in DAEMONS if shutil.which(name, path=path) is None]
    if missing:
        pytest.fail(f"no {', '.join(missing)}: scripts/setup.sh installs Slurm and munge")
    cluster = SlurmCluster(ENV)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        cluster.remove()


def output_of(record: JobRecord) -> str:
    """The job's %x-%j.out (stdout and stderr of the batch script and every rank)."""
    return read(Path(record.fields["StdOut"]))


def run_job(
    slurm: SlurmCluster,
    argv: list[str],
    cwd: Path,
    env: Mapping[str, str] | None = None,
) -> tuple[JobRecord, str]:
    """sbatch --wait one job; return its final record and output, having checked sbatch's exit
    code agrees with the record (it does not for a job cancelled while pending)."""
    record, returncode = slurm.sbatch_wait(
        [JOB_LIMIT, *argv], cwd=cwd, env=env, timeout=JOB_TIMEOUT
    )
    output = output_of(record)
    assert record.final, (record, output[-3000:])
    assert returncode == record.exit_code, (returncode, record, output[-3000:])
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
        # Four tasks on two cores: slurm.conf claims CPUs=8 (ringtrain/cluster/slurm.py).
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
        assert "pipeline 1: ranks [2, 3]" in output, output[-3000:]


def test_sweep_template_runs_a_study_in_groups_under_sbatch(slurm, tmp_path):
    """slurm/sweep.sbatch: two tasks as two groups of one rank, the study in its journal under
    SWEEP_DIR (named after the job), every trial recorded."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    space = tmp_path / "space.yaml"
    space.write_text("lr: {type: float, low: 0.01, high: 0.3, log: true}\n")
    sweep = [str(space), "--trials", "3", "--objective", "val_accuracy", "--direction", "maximize"]
    sweep += ["--sampler", "random", "--model", "mlp", *TINY]
    options = ["--ntasks-per-node=2", "--job-name=search"]
    template = str(ROOT / "slurm" / "sweep.sbatch")
    record, output = run_job(slurm, [*options, template, *sweep], cwd=tmp_path, env=HOME)
    assert (record.state, record.exit_code, record.restarts) == ("COMPLETED", 0, 0), output[-3000:]
    journal = JournalStorage(JournalFileBackend(str(tmp_path / "sweeps" / "search.journal")))
    trials = optuna.load_study(study_name="search", storage=journal).get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3, output[-3000:]
    assert {t.user_attrs["group"] for t in trials} == {0, 1}
    assert "study search: 3 complete" in output, output[-3000:]
    assert "Traceback" not in output


def test_rendered_script_runs_under_sbatch_from_any_folder(slurm, tmp_path):
    """A rendered copy carries this checkout's path: it needs no RINGTRAIN_HOME, and finds
    slurm/common.sh and the venv from a folder that has neither."""
    script, metrics = tmp_path / "job.sbatch", tmp_path / "metrics.json"
    train_args = [*TINY, "--metrics-out", str(metrics)]
    render = [
        *("slurm", "render", "--strategy", "data", "--nodes", "1", "--ntasks-per-node", "2"),
        *("--time", "00:05:00", "--job-name", "rendered", "--output", str(script)),
    ]
    done = slurm.client([str(BIN / "ringtrain"), *render, "--", *train_args], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    record, output = run_job(slurm, [str(script)], cwd=tmp_path, env={"PATH": SYSTEM_PATH})
    assert_trained(record, output, metrics, "data", 2)
    assert record.fields["JobName"] == "rendered"
    assert (tmp_path / f"rendered-{record.job_id}.out").exists()


SRUN_STRATEGIES = {  # strategy: (tasks, train arguments)
    "data": (2, ["--strategy", "data"]),
    "pipeline": (2, ["--strategy", "pipeline"]),
    "hybrid": (4, ["--strategy", "hybrid", "--pp-size", "2", "--microbatches", "2"]),
}


@pytest.mark.parametrize("strategy", sorted(SRUN_STRATEGIES))
@pytest.mark.parametrize("sig,bound", [(signal.SIGKILL, 30), (signal.SIGSTOP, 8 + 30)])
def test_killed_or_stopped_rank_ends_the_srun_step(slurm, tmp_path, strategy, sig, bound):
    """SIGKILL on one rank mid-training: srun ends the step, non-zero, well within 30 s.
    SIGSTOP (no launcher notices): ringtrain's watchdog ends it within --comm-timeout + 30 s."""
    tag = f"kill-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "srun.out"
    tasks, train_args = SRUN_STRATEGIES[strategy]
    argv = ["srun", "--mpi=pmix", "-n", str(tasks), f"--comment={tag}", JOB_LIMIT]
    argv += ["ringtrain", "train", *train_args, "--steps", "100000", "--comm-timeout", "8"]
    watch = slurm.watch(tag)
    try:
        with open(log, "w") as out:
            step = subprocess.Popen(
                argv, cwd=tmp_path, env=slurm.env, stdout=out, stderr=subprocess.STDOUT
            )
        try:
            wait_for_text(log, "epoch 1/", step, timeout=120)
            job_id = watch.wait_for_id()
            victims = rank_pids(slurm, job_id, rank=1)
            assert victims, slurm.client(["scontrol", "listpids", str(job_id)]).stdout
            for pid in victims:
                os.kill(pid, sig)
            killed = time.monotonic()
            try:
                returncode = step.wait(timeout=bound)
            except subprocess.TimeoutExpired:
                pytest.fail(f"srun still running {bound} s after rank 1 got {sig!r}:\n{read(log)}")
            assert time.monotonic() - killed < bound
            assert returncode != 0, read(log)
            record = watch.record()
            assert record.state != "COMPLETED", record
        finally:
            if step.poll() is None:
                step.kill()
                step.wait(timeout=10)
    finally:
        watch.close()


def test_preempted_job_checkpoints_requeues_and_resumes_to_the_uninterrupted_weights(
    slurm, tmp_path
):
    """USR1 to the batch shell mid-training: the step checkpoints and exits 75, common.sh
    requeues the job, and the rerun resumes; the final weights equal an uninterrupted run's."""
    # Long enough that the signal lands well before the end; the order of Horovod's sums is
    # fixed (no fusion buffer) so the two runs can agree bit for bit.
    steps = 1000  # 23 epochs of the digits data; the signal comes after the first
    flags = ["--steps", str(steps), "--batch-size", "32", "--seed", "3"]
    env = {**HOME, "HOROVOD_FUSION_THRESHOLD": "0"}
    whole, cut = tmp_path / "whole", tmp_path / "preempted"
    whole.mkdir()
    cut.mkdir()
    whole_argv = [JOB_LIMIT, DATA_1NODE, *flags, "--weights-out", str(whole / "w.npz")]
    whole_argv += ["--initial-weights-out", str(whole / "initial.npz")]
    cut_argv = [JOB_LIMIT, DATA_1NODE, *flags, "--weights-out", str(cut / "w.npz")]
    # The uninterrupted run shares the cluster with the preempted one (4 of its 8 CPUs).
    with (
        slurm.submit(whole_argv, cwd=whole, env=env) as uninterrupted,
        slurm.submit(cut_argv, cwd=cut, env=env) as preempted,
    ):
        job_id, out = started(preempted)
        slurm.client(["scancel", "--batch", "--signal=USR1", str(job_id)])
        returncode = preempted.process.wait(timeout=JOB_TIMEOUT)
        record = preempted.watch.record()
        whole_out = output_path(uninterrupted)
        assert uninterrupted.process.wait(timeout=JOB_TIMEOUT) == 0, read(whole_out)
    output = read(out)
    assert (record.state, record.exit_code, returncode) == ("COMPLETED", 0, 0), (record, output)
    assert record.restarts == 1, (record, output)
    assert f"requeueing job {job_id}" in output, output
    stopped = [line for line in output.splitlines() if line.startswith("stopped after step ")]
    resumed = [line for line in output.splitlines() if line.startswith("resumed from ")]
    assert len(stopped) == 1 and len(resumed) == 1, output
    step = int(stopped[0].split()[3])
    assert 0 < step < steps and resumed[0].endswith(f"at step {step}"), output
    assert "stopped after" not in read(whole_out), read(whole_out)
    comparison = compare_weight_files(cut / "w.npz", whole / "w.npz", whole / "initial.npz")
    assert comparison.passed, comparison


def test_cancelled_job_checkpoints_and_stays_cancelled(slurm, tmp_path):
    """scancel sends TERM to the batch shell and the ranks alike: the step checkpoints and
    exits 75, but a job Slurm is ending must not be requeued, or it could never be cancelled."""
    argv = [JOB_LIMIT, DATA_1NODE, "--steps", "100000"]
    with slurm.submit(argv, cwd=tmp_path, env=HOME) as job:
        job_id, out = started(job)
        slurm.client(["scancel", str(job_id)])
        record = job.watch.record(timeout=60)
    output = read(out)
    # Once cancelled the job only completes: it never runs again (PENDING, RUNNING).
    after = record.states[record.states.index("RUNNING") + 1 :]
    assert set(after) <= {"COMPLETING", "CANCELLED"}, (record, output)
    assert record.restarts == 0, (record, output)
    assert f"JOB {job_id} ON localhost CANCELLED AT" in output, output
    assert "stopped after step" in output, output
    assert f"job {job_id} is ending" in output and "requeueing" not in output, output
    assert list((tmp_path / f"ckpt-{record.fields['JobName']}").glob("step-*/manifest.json"))


# --- helpers ----------------------------------------------------------------------------------


def output_path(job: Submission, timeout: float = 30) -> Path:
    """Where the job writes (%x-%j.out in its submit folder), once Slurm has the job."""
    job.watch.wait_for_id(timeout)
    deadline = time.monotonic() + timeout
    while job.watch.last is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.watch.last is not None, read(job.log)
    return Path(job.watch.last["StdOut"])


def started(job: Submission) -> tuple[int, Path]:
    """(job id, output file) once the job has finished its first epoch of training."""
    out = output_path(job)
    wait_for_text(out, "epoch 1/", job.process, timeout=120)
    assert job.watch.job_id is not None
    return job.watch.job_id, out


def wait_for_text(path: Path, text: str, process: subprocess.Popen, timeout: float) -> None:
    """Until `text` appears in the file; fail early if the process watched already ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in read(path):
            return
        if process.poll() is not None:
            pytest.fail(f"ended ({process.returncode}) before printing {text!r}:\n{read(path)}")
        time.sleep(0.2)
    pytest.fail(f"no {text!r} in {path} after {timeout} s")


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"(no {path.name})"


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
