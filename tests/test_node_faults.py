"""Node faults on `ringtrain cluster`, injected with `ringtrain cluster fault`.

- A node that goes silent (its link cut, or cut and then every process of it killed, as a
  power loss looks from outside) ends every launcher's run within --comm-timeout + 30 s, with
  a non-zero exit, a line naming the lost rank and its host, and nothing of the job left
  running in any namespace. One fault hits six runs at once: data, pipeline and hybrid under
  mpirun, data under horovodrun, data and pipeline under srun inside sbatch.
- A slow link is no false alarm: runs whose steps take longer than --comm-timeout complete
  with the weights of single-process training.
- A requeued job finishes on the node that is left: the writer of a checkpoint freezes between
  its parts and its manifest (the crash-injection point), its node loses power, the operator
  marks the node DOWN, Slurm requeues the `--nodes=1-2` jobs, and on the other node data
  parallel and hybrid resume from the previous checkpoint and end with the weights of an
  uninterrupted run, while a pipeline that would need more stages is refused in one line.

One cluster (2 nodes, 2 CPUs each, Slurm) serves every test; each test heals the node it hurt,
and the cluster is taken down even when a test failed.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import BIN, ENV, ROOT, compare_weight_files, run

from ringtrain.cluster import layout as cluster_layout
from ringtrain.cluster.system import pids_with_environment
from ringtrain.comm import transfer_time, waited
from ringtrain.launch.network import KEEPALIVE as KEEPALIVE_MCA
from ringtrain.launch.network import mpirun_flags

CLI = str(BIN / "ringtrain")
STATE = cluster_layout.STATE_DIR
CIDR = cluster_layout.DEFAULT_SUBNET
TIMEOUT = 20  # --comm-timeout: above the first step's tracing on a loaded 2-core machine
BOUND = TIMEOUT + 30
JOB_PROGRAMS = ("python", "ringtrain", "orted", "srun", "slurmstepd", "mpirun", "slurm_script")
# A rank on node2 named with its host: by the heartbeat, or by a pipeline wait.
NAMED = re.compile(r"rank \d+ on node2 unreachable|\(rank \d+\) went silent.*runs on node2")
KEEPALIVE = " ".join(f"--mca {k} {v}" for k, v in KEEPALIVE_MCA.items())
FREEZE = "RINGTRAIN_TEST_CRASH_BEFORE_MANIFEST"


def test_a_deadline_adds_the_bytes_at_the_minimum_rate():
    """The rule of comm.py: --comm-timeout plus the message's bytes at --min-link-rate."""
    assert transfer_time(5_000_000, 2.5) == pytest.approx(2.0)
    assert waited(20, transfer_time(5_000_000, 2.5)) == "20 s (+2.0 s for the bytes)"
    assert waited(8, transfer_time(1000)) == "8 s"  # small messages: the timeout alone


# ---- the cluster -------------------------------------------------------------------------


def cluster(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([CLI, "cluster", *args], timeout=timeout)


def fault(node: str, kind: str) -> None:
    done = cluster("fault", node, kind, timeout=90)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def slurm_env() -> Iterator[dict[str, str]]:
    """A 2-node cluster with Slurm, and the environment its clients need."""
    done = cluster("up", "--nodes", "2", "--cpus-per-node", "2", "--slurm")
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        pytest.fail(f"ringtrain cluster up --nodes 2 --slurm failed: {lines[-1]}")
    try:
        yield {**ENV, "SLURM_CONF": str(STATE / "slurm" / "etc" / "slurm.conf")}
    finally:
        cluster("down")


def node_pids(node: str) -> list[int]:
    ns = f"{cluster_layout.PREFIX}{node}"
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()]


def program(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def job_left(nodes=("node1", "node2"), wait: float = 15) -> list[str]:
    """Processes of a job still running on the nodes, after giving them `wait` s to end."""
    deadline = time.monotonic() + wait
    while True:
        left = [
            f"{n}: {name}"
            for n in nodes
            for name in map(program, node_pids(n))
            if name.startswith(JOB_PROGRAMS)
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


def slurm(env: dict[str, str], *argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30).stdout


def sbatch(env, script: Path, log: Path, *args: str, options=(), extra_env=None) -> str:
    """Submit; the job id."""
    done = subprocess.run(
        ["sbatch", "--parsable", f"--output={log}", *options, str(script), *args],
        capture_output=True,
        text=True,
        env={**env, "RINGTRAIN_HOME": str(ROOT), **(extra_env or {})},
        cwd=log.parent,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def rendered(tmp_path: Path, strategy: str, nodes: str, per_node: int, *extra: str) -> Path:
    """A batch script from `ringtrain slurm render`, as a user would write one."""
    script = tmp_path / f"{strategy}.sbatch"
    done = run(
        [CLI, "slurm", "render", "--strategy", strategy, "--nodes", nodes]
        + ["--ntasks-per-node", str(per_node), "--time", "15", "--output", str(script), *extra]
    )
    assert done.returncode == 0, done.stderr
    return script


# ---- one fault, six runs -------------------------------------------------------------------

STRATEGY_ARGS = {
    "data": [],
    "pipeline": ["--microbatches", "4"],
    "hybrid": ["--pp-size", "2", "--microbatches", "2"],
}


def train_args(strategy: str) -> list[str]:
    return [
        *(CLI, "train", "--strategy", strategy, *STRATEGY_ARGS[strategy]),
        *("--steps", "100000", "--comm-timeout", str(TIMEOUT)),
        *("--batch-size", "256"),  # short epochs: "held-out accuracy" soon says it trains
    ]


@dataclass
class Run:
    """One launch that a fault hits: a launcher on this host, or a batch job."""

    name: str
    log: Path  # where its progress and its error line appear
    process: subprocess.Popen | None = None
    job_id: str | None = None
    ended_after: float | None = None

    def running(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        # the batch script and its step, on the batch host node1
        return any(pid in node_pids("node1") for pid in self.job_pids())

    def job_pids(self) -> list[int]:
        return pids_with_environment(f"SLURM_JOB_ID={self.job_id}")

    def failed(self) -> bool:
        if self.process is not None:
            return self.process.returncode != 0
        return "ringtrain job: step exited 3" in self.text()

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, env) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.job_id is not None:
            subprocess.run(["scancel", self.job_id], env=env, check=False)


def starters(tmp_path: Path, env: dict[str, str]) -> list[Callable[[], Run]]:
    """The six runs, paired in waves of one mpirun-style launch and one more."""
    pair = ["-H", "node1:1,node2:1"]
    commands = {
        "mpirun data": ["mpirun", "-np", "2", *pair, *mpirun_flags(CIDR), *train_args("data")],
        "mpirun pipeline": [
            *("mpirun", "-np", "2", *pair, *mpirun_flags(CIDR), *train_args("pipeline"))
        ],
        "mpirun hybrid": [
            *("mpirun", "-np", "4", "-H", "node1:2,node2:2", *mpirun_flags(CIDR)),
            *train_args("hybrid"),
        ],
        "horovodrun data": [  # the line `ringtrain cluster up` prints
            *("horovodrun", "-np", "2", *pair, "--network-interface", "eth0"),
            *(f"--mpi-args=--mca oob_tcp_if_include {CIDR} {KEEPALIVE}", *train_args("data")),
        ],
    }

    def launcher(name: str) -> Run:
        log = tmp_path / f"{name.replace(' ', '-')}.log"
        with log.open("w") as out:
            process = subprocess.Popen(commands[name], stdout=out, stderr=out, env=ENV)
        return Run(name, log, process=process)

    def batch_job(strategy: str) -> Run:
        template = {"data": "data-multinode.sbatch", "pipeline": "pipeline.sbatch"}[strategy]
        log = tmp_path / f"srun-{strategy}.log"
        job = sbatch(
            env,
            ROOT / "slurm" / template,
            log,
            *train_args(strategy)[4:],  # the template names the strategy
            options=["--nodes=2", "--ntasks-per-node=1"],
            extra_env={"CKPT_DIR": str(tmp_path / f"ckpt-{strategy}")},
        )
        return Run(f"srun {strategy}", log, job_id=job)

    return [
        *(lambda: launcher("mpirun data"), lambda: batch_job("data")),
        *(lambda: launcher("mpirun pipeline"), lambda: batch_job("pipeline")),
        *(lambda: launcher("mpirun hybrid"), lambda: launcher("horovodrun data")),
    ]


def start_all(starts: list[Callable[[], Run]], runs: list[Run]) -> None:
    """Fourteen ranks tracing their first step at once on two cores take longer than
    --comm-timeout: --startup-timeout covers it, while every peer is heard from."""
    runs.extend(start() for start in starts)
    wait_until_training(runs)


def wait_until_training(runs: list[Run], timeout: float = 300) -> None:
    """Until every run has finished its first epoch."""
    deadline = time.monotonic() + timeout
    waiting = runs
    while waiting and time.monotonic() < deadline:
        for r in waiting:
            assert r.process is None or r.running(), f"{r.name} ended early: {r.text()[-2000:]}"
        waiting = [r for r in waiting if "held-out accuracy" not in r.text()]
        time.sleep(1)
    assert not waiting, f"never trained: {[(r.name, r.text()[-1500:]) for r in waiting]}"


def one_fault_hits_six_runs(tmp_path: Path, env: dict[str, str], kind: str) -> None:
    runs: list[Run] = []
    try:
        start_all(starters(tmp_path, env), runs)
        fault("node2", kind)
        cut = time.monotonic()
        while any(r.ended_after is None for r in runs) and time.monotonic() - cut < BOUND + 60:
            for r in runs:
                if r.ended_after is None and not r.running():
                    r.ended_after = time.monotonic() - cut
            time.sleep(0.5)
        fault("node2", "heal")
        for r in runs:
            text = r.text()
            assert r.ended_after is not None and r.ended_after <= BOUND, (r.name, text[-2000:])
            assert r.failed(), (r.name, text[-2000:])
            assert NAMED.search(text), (r.name, text[-3000:])
            assert "Traceback" not in text, r.name
        assert job_left() == []
    finally:
        for r in runs:
            r.stop(env)


def test_a_partition_ends_every_launcher_s_run_and_names_a_lost_rank(slurm_env, tmp_path):
    one_fault_hits_six_runs(tmp_path, slurm_env, "partition")


def test_a_power_loss_ends_every_launcher_s_run_and_names_a_lost_rank(slurm_env, tmp_path):
    one_fault_hits_six_runs(tmp_path, slurm_env, "power-off")


# ---- a slow link ---------------------------------------------------------------------------


def cap(rate: str) -> None:
    """Both directions of node2's link, as `ringtrain cluster up --link` caps them."""
    tbf = ["root", "tbf", "rate", rate, "burst", "4kb", "latency", "1s"]
    veth = f"{cluster_layout.PREFIX}node2"
    subprocess.run(["tc", "qdisc", "replace", "dev", veth, *tbf], check=True)
    subprocess.run(["tc", "-n", veth, "qdisc", "replace", "dev", "eth0", *tbf], check=True)


def uncap() -> None:
    veth = f"{cluster_layout.PREFIX}node2"
    subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], check=False)
    subprocess.run(["tc", "-n", veth, "qdisc", "del", "dev", "eth0", "root"], check=False)


def test_a_slow_link_is_no_false_alarm(slurm_env, tmp_path):
    """node2's link at 512 kbit/s (64 kB/s, shared by both runs): a data-parallel step's
    gradient allreduce (about 135 kB each way for the mlp) and a pipeline step's 8 messages
    (32 kB each at batch 256, M = 4) take 4 s or more, beyond --comm-timeout 2. With
    --min-link-rate below the link's rate both complete, with the weights of single-process
    training."""
    flags = ["--model", "mlp", "--steps", "6", "--seed", "3", "--batch-size", "256"]
    single = tmp_path / "single.npz"
    done = run([CLI, "train", "--strategy", "single", *flags, "--weights-out", str(single)])
    assert done.returncode == 0, done.stderr[-2000:]
    jobs = {}
    cap("512kbit")
    try:
        for strategy in ("data", "pipeline"):
            cmd = [
                *("mpirun", "-np", "2", "-H", "node1:1,node2:1", *mpirun_flags(CIDR)),
                *(CLI, "train", "--strategy", strategy, *STRATEGY_ARGS[strategy], *flags),
                *("--comm-timeout", "2", "--min-link-rate", "0.02"),
                *("--weights-out", str(tmp_path / f"{strategy}.npz")),
            ]
            log = (tmp_path / f"{strategy}.log").open("w")
            jobs[strategy] = subprocess.Popen(cmd, stdout=log, stderr=log, env=ENV)
        for job in jobs.values():
            job.wait(timeout=400)
    finally:
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
        uncap()
    for strategy, job in jobs.items():
        text = (tmp_path / f"{strategy}.log").read_text()
        assert job.returncode == 0, (strategy, text[-2000:])
        comparison = compare_weight_files(tmp_path / f"{strategy}.npz", single, "mlp", 3)
        assert comparison.passed, (strategy, comparison)


# ---- requeue on fewer nodes ----------------------------------------------------------------

FROZEN_AT = 40  # the writer freezes in its second checkpoint: the first is the one to resume
FLAGS = ["--model", "mlp", "--seed", "5", "--steps", "60"]
REQUEUE_ARGS = {"data": [], "pipeline": ["--microbatches", "4"], "hybrid": ["--microbatches", "2"]}


@dataclass
class Requeued:
    """A `--nodes=1-2 --requeue` job whose checkpoint writer freezes on node1."""

    strategy: str
    job_id: str
    log: Path
    ckpt: Path
    weights: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def frozen(self) -> bool:
        """Its writer stopped itself between the parts and the manifest."""
        for pid in pids_with_environment(f"SLURM_JOB_ID={self.job_id}"):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            if "\nState:\tT" in status and pid in node_pids("node1"):
                return True
        return False


def submit_requeued(tmp_path, env, strategy: str, per_node: int, *extra: str) -> Requeued:
    script = rendered(tmp_path, strategy, "1-2", per_node, *extra)
    ckpt, weights = tmp_path / f"ckpt-{strategy}", tmp_path / f"{strategy}.npz"
    log = tmp_path / f"{strategy}.log"
    args = [*FLAGS, *REQUEUE_ARGS[strategy], "--checkpoint-every", "20"]
    args += ["--comm-timeout", str(TIMEOUT)]
    job = sbatch(
        env,
        script,
        log,
        *args,
        "--weights-out",
        str(weights),
        extra_env={"CKPT_DIR": str(ckpt), FREEZE: f"freeze:node1:{FROZEN_AT}"},
    )
    return Requeued(strategy, job, log, ckpt, weights)


def lose_node1_while_frozen(env, jobs: list[Requeued], timeout: float = 300) -> None:
    """Wait for every writer to freeze mid-checkpoint; node1 loses power; the operator marks
    it DOWN, so Slurm requeues its jobs."""
    deadline = time.monotonic() + timeout
    while not all(j.frozen() for j in jobs):
        assert time.monotonic() < deadline, [(j.strategy, j.text()[-1500:]) for j in jobs]
        time.sleep(0.5)
    for j in jobs:
        assert "manifest" not in " ".join(p.name for p in j.ckpt.glob(f"*{FROZEN_AT}*"))
    fault("node1", "power-off")
    slurm(env, "scontrol", "update", "NodeName=node1", "State=DOWN", "Reason=power-loss")


def wait_for_end(env, job: Requeued, timeout: float = 400) -> str:
    """Until Slurm no longer lists the job as pending or running; its last state."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = slurm(env, "squeue", "-h", "-j", job.job_id, "-o", "%T").strip()
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED", "COMPLETING"):
            return state
        time.sleep(1)
    raise AssertionError(f"job {job.strategy} still {state}: {job.text()[-2000:]}")


def single_weights(tmp_path: Path, strategy: str) -> Path:
    """The uninterrupted run: one process, the same global batch and steps."""
    out = tmp_path / f"single-{strategy}.npz"
    done = run([CLI, "train", "--strategy", "single", *FLAGS, "--weights-out", str(out)])
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def folder_digest(folder: Path) -> dict[str, str]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def assert_resumed_exactly(tmp_path: Path, job: Requeued) -> None:
    text = job.text()
    assert "slurm task 0 of step 0 on node2" in text, text[-3000:]  # the requeued run
    assert re.search(r"resumed from .* at step 20\b", text), text[-3000:]
    assert job.weights.exists(), text[-3000:]
    comparison = compare_weight_files(job.weights, single_weights(tmp_path, job.strategy), "mlp", 5)
    assert comparison.passed, (job.strategy, comparison)


def test_a_requeued_job_resumes_on_the_node_left_and_a_pipeline_is_refused(slurm_env, tmp_path):
    """Data parallel resumes at one rank with the global batch unchanged and ends with the
    uninterrupted run's weights; the 2-stage pipeline, requeued onto one node, is refused in
    one line and its checkpoint folder is left exactly as the power loss left it."""
    data = submit_requeued(tmp_path, slurm_env, "data", 1)
    pipeline = submit_requeued(tmp_path, slurm_env, "pipeline", 1)
    try:
        lose_node1_while_frozen(slurm_env, [data, pipeline])
        before = folder_digest(pipeline.ckpt)
        wait_for_end(slurm_env, data)
        wait_for_end(slurm_env, pipeline)
        assert_resumed_exactly(tmp_path, data)
        errors = [line for line in pipeline.text().splitlines() if "error:" in line]
        assert any("stage" in line for line in errors), pipeline.text()[-3000:]
        assert "Traceback" not in pipeline.text()
        assert folder_digest(pipeline.ckpt) == before
    finally:
        for job in (data, pipeline):
            subprocess.run(["scancel", job.job_id], env=slurm_env, check=False)
        fault("node1", "heal")


def test_a_requeued_hybrid_job_resumes_with_fewer_replicas(slurm_env, tmp_path):
    """2 replicas of 2 stages on 2 nodes; requeued onto one node, 1 replica of the same 2
    stages resumes and ends with the uninterrupted run's weights."""
    hybrid = submit_requeued(tmp_path, slurm_env, "hybrid", 2, "--pp-size", "2")
    try:
        lose_node1_while_frozen(slurm_env, [hybrid])
        wait_for_end(slurm_env, hybrid)
        assert_resumed_exactly(tmp_path, hybrid)
    finally:
        subprocess.run(["scancel", hybrid.job_id], env=slurm_env, check=False)
        fault("node1", "heal")
