"""Node faults on `ringtrain cluster`, injected with `ringtrain cluster fault`.

- A node that goes silent (its link cut, or cut and then every process of it killed, as a
  power loss looks from outside) gets a line naming the lost rank and its host within
  --comm-timeout + 30 s, and ends every launcher's run within that bound (srun's: plus Slurm's
  own step teardown), with a non-zero exit and nothing of the job left running in any
  namespace. Six launches (data, pipeline and hybrid under mpirun, data under
  horovodrun, data and pipeline under srun inside sbatch) each meet both faults. horovodrun
  is started bare from the activated venv, with no keepalive flag or variable of its own: the
  venv's default bounds it.
- A slow link is no false alarm: runs whose steps take longer than --comm-timeout complete
  with the weights of single-process training.
- A requeued job finishes on the node that is left: the writer of a checkpoint freezes between
  its parts and its manifest (the crash-injection point), its node loses power, the operator
  marks the node DOWN, Slurm requeues the `--nodes=1-2` jobs, and on the other node data
  parallel and hybrid resume from the previous checkpoint and end with the weights of an
  uninterrupted run, while a pipeline that would need more stages is refused in one line.

One cluster (24 nodes, 2 CPUs each, Slurm) serves every test: the twelve fault runs take a
pair each; the requeue test uses node1 to node4 as two pairs, and the slow-link runs go on in
the background on node5 to node8 while Slurm requeues.
Each test heals the nodes it hurt, and the cluster is taken down even when a test failed.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import BIN, ENV, ROOT, compare_weight_files, run

from ringtrain.cluster import layout as cluster_layout
from ringtrain.cluster.slurm import KILL_WAIT
from ringtrain.cluster.system import netns_pids, pids_with_environment
from ringtrain.deadline import transfer_time, waited
from ringtrain.launch.network import mpirun_flags

CLI = str(BIN / "ringtrain")
STATE = cluster_layout.STATE_DIR
CIDR = cluster_layout.DEFAULT_SUBNET
TIMEOUT = 20  # --comm-timeout, above the launchers' 11 s keepalive (see the README)
BOUND = TIMEOUT + 30  # from the fault to ringtrain's line naming the lost rank, and to the end
# srun's own teardown after that line: it waits KillWait + 2 s for the silent node's tasks, and
# its signal to that node's slurmd waits a MessageTimeout (10 s, Slurm's default).
SRUN_TEARDOWN = KILL_WAIT + 2 + 10
JOB_PROGRAMS = ("python", "ringtrain", "orted", "srun", "slurmstepd", "mpirun", "slurm_script")
FREEZE = "RINGTRAIN_TEST_CRASH_BEFORE_MANIFEST"
NODES = 24  # a pair for each of twelve runs: six launches, each partitioned and powered off
ALL_NODES = tuple(f"node{n}" for n in range(1, NODES + 1))
STARTING = 4  # runs starting at once in the fault test (see there)


def test_a_deadline_adds_the_bytes_at_the_minimum_rate():
    """The rule of deadline.py: --comm-timeout plus the message's bytes at --min-link-rate."""
    assert transfer_time(5_000_000, 2.5) == pytest.approx(2.0)
    assert waited(20, transfer_time(5_000_000, 2.5)) == "20 s (+2.0 s for the bytes)"
    assert waited(8, transfer_time(1000)) == "8 s"  # small messages: the timeout alone


# ---- the cluster -------------------------------------------------------------------------


def cluster(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([CLI, "cluster", *args], timeout=timeout)


def fault(node: str, kind: str) -> None:
    done = cluster("fault", node, kind, timeout=90)
    assert done.returncode == 0, done.stderr


def fault_started(node: str, kind: str) -> subprocess.Popen:
    """`ringtrain cluster fault`, left to run while the caller goes on. It runs ahead of the
    ranks on the cores (nice -15): a fault that waits for a starting rank's CPU time lets the
    run it hits train on meanwhile, starving the other runs' start."""
    return subprocess.Popen(["nice", "-n", "-15", CLI, "cluster", "fault", node, kind], env=ENV)


@pytest.fixture(scope="module")
def slurm_env() -> Iterator[dict[str, str]]:
    """The 24-node cluster with Slurm, and the environment its clients need."""
    done = cluster("up", "--nodes", str(NODES), "--cpus-per-node", "2", "--slurm")
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        pytest.fail(f"ringtrain cluster up --nodes 4 --slurm failed: {lines[-1]}")
    try:
        yield {**ENV, "SLURM_CONF": str(STATE / "slurm" / "etc" / "slurm.conf")}
    finally:
        cluster("down")


@pytest.fixture(scope="module")
def launcher_env() -> Iterator[Callable[[], dict[str, str]]]:
    """An environment with a TMPDIR of its own, for each launcher started beside others: Open
    MPI launchers started in the same instant race to create this host's session directory
    (/tmp/ompi.<host>.<uid>), and the loser fails at start-up with 'File exists' (seen with the
    two slow-link runs)."""
    made: list[str] = []

    def fresh() -> dict[str, str]:
        made.append(tempfile.mkdtemp(prefix="ompi-"))  # short: MPI's sockets live under it
        return {**ENV, "TMPDIR": made[-1]}

    yield fresh
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


def node_pids(node: str) -> list[int]:
    return netns_pids(f"{cluster_layout.PREFIX}{node}")


def program(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def job_left(nodes: tuple[str, ...], wait: float = 15) -> list[str]:
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

# A fault run is about the fault: its pipelines split uniformly rather than time each element
# on rank 0 first, which would add seconds of start-up to every one of them.
STRATEGY_ARGS = {
    "data": [],
    "pipeline": ["--microbatches", "4", "--partition", "uniform"],
    "hybrid": ["--pp-size", "2", "--microbatches", "2", "--partition", "uniform"],
}


def train_args(strategy: str) -> list[str]:
    return [
        *(CLI, "train", "--strategy", strategy, *STRATEGY_ARGS[strategy]),
        *("--steps", "100000", "--comm-timeout", str(TIMEOUT)),
        *("--batch-size", "256"),  # short epochs: "held-out accuracy" soon says it trains
    ]


def named(node: str) -> re.Pattern:
    """A rank on `node` named with its host: by the heartbeat, or by a pipeline wait."""
    return re.compile(rf"rank \d+ on {node} unreachable|\(rank \d+\) went silent.*runs on {node}")


@dataclass
class Run:
    """One launch that a fault hits: a launcher on this host, or a batch job."""

    name: str
    log: Path  # where its progress and its error line appear
    batch_host: str
    process: subprocess.Popen | None = None
    job_id: str | None = None
    lost: str = ""  # the node its fault takes
    fault: str = ""  # partition or power-off
    faulted_at: float | None = None
    named_after: float | None = None  # seconds from the fault to the line naming the lost rank
    ended_after: float | None = None
    injector: subprocess.Popen | None = None  # `ringtrain cluster fault`, then its heal
    healing: bool = False

    def running(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        pids = node_pids(self.batch_host)  # the batch script and its step
        return any(pid in pids for pid in pids_with_environment(f"SLURM_JOB_ID={self.job_id}"))

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


# horovodrun first: before its mpirun it checks, in a process that imports TensorFlow, that
# Horovod was built with MPI, so its runs are the last to train.
LAUNCHES = ("horovodrun data", "mpirun data", "mpirun pipeline", "mpirun hybrid")
BATCH_LAUNCHES = (("srun data", "data-multinode.sbatch"), ("srun pipeline", "pipeline.sbatch"))


def start_run(
    tmp_path: Path,
    env: dict[str, str],
    launcher_env: Callable[[], dict[str, str]],
    name: str,
    first: str,
    second: str,
) -> Run:
    """One launch across `first` and `second`, its ranks split between them: mpirun or
    horovodrun (the lines `ringtrain cluster up` prints) on this host, in an environment of
    its own from `launcher_env`, or srun in sbatch."""
    log = tmp_path / f"{name.replace(' ', '-')}-{second}.log"
    strategy = name.split()[1]
    if name.startswith("srun"):
        template = dict(BATCH_LAUNCHES)[name]
        job = sbatch(
            env,
            ROOT / "slurm" / template,
            log,
            *train_args(strategy)[4:],  # the template names the strategy
            options=["--nodes=2", "--ntasks-per-node=1", f"--nodelist={first},{second}"],
            extra_env={"CKPT_DIR": str(tmp_path / f"ckpt-{second}")},
        )
        return Run(name, log, first, job_id=job)
    per_node = 2 if strategy == "hybrid" else 1
    hosts = ["-H", f"{first}:{per_node},{second}:{per_node}"]
    env = launcher_env()
    if name.startswith("horovodrun"):
        # As the docs start it: a bare horovodrun in the activated venv, no flag on the line
        # and no Open MPI variable of the test's, so the bound comes from the venv's default.
        bare = shlex.join(["horovodrun", "-np", "2", *hosts, *train_args(strategy)])
        command = ["bash", "-c", f"source {ROOT}/.venv/bin/activate && exec {bare}"]
        env = {k: v for k, v in env.items() if not k.startswith("OMPI_MCA_")}
    else:
        command = ["mpirun", *mpirun_flags(CIDR), "-np", str(2 * per_node), *hosts]
        command += train_args(strategy)
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=out, env=env)
    return Run(name, log, first, process=process)


def note_ends(runs: list[Run]) -> None:
    """When each faulted run first names the lost rank, and when it has ended."""
    for r in runs:
        if r.faulted_at is None:
            continue
        if r.named_after is None and named(r.lost).search(r.text()):
            r.named_after = time.monotonic() - r.faulted_at
        if r.ended_after is None and not r.running():
            r.ended_after = time.monotonic() - r.faulted_at


def heal_ended(runs: list[Run]) -> bool:
    """Heal each node whose run has ended once its fault is in; whether all are healed. A node
    healed early is one fewer slurmstepd left waiting on its next retry at the end."""
    for r in runs:
        if r.ended_after is not None and r.injector.poll() is not None:
            assert r.injector.returncode == 0, (r.lost, r.fault, r.healing)
            if not r.healing:
                r.injector, r.healing = fault_started(r.lost, "heal"), True
    return all(r.healing and r.injector.poll() is not None for r in runs)


def assert_ended_and_named(r: Run) -> None:
    """ringtrain names the lost rank within the bound; the launcher ends the run within it too,
    srun after its own teardown, which Slurm's settings decide."""
    text = r.text()
    assert named(r.lost).search(text), (r.name, text[-3000:])
    assert r.named_after is not None and r.named_after <= BOUND, (r.name, r.named_after)
    bound = BOUND + SRUN_TEARDOWN if r.name.startswith("srun") else BOUND
    assert r.ended_after is not None and r.ended_after <= bound, (r.name, r.lost, text[-2000:])
    assert r.failed(), (r.name, text[-2000:])
    assert "Traceback" not in text, r.name


def test_a_partition_and_a_power_loss_end_every_launcher_s_run_and_name_the_lost_rank(
    slurm_env, launcher_env, tmp_path
):
    """Each of the six launches runs twice, each run on a pair of nodes of its own: on one
    pair the second node is partitioned, on the other it loses its power, as soon as that run
    trains, without waiting for another run's fault. (Faulting each run the moment it trains
    keeps runs from training, and taking the two cores, while other ranks still start.) At
    most STARTING runs start at once: all twelve at once put 28 ranks' start-up on two cores
    while the first faults were timed, and in the whole suite their bound was missed by up
    to 11 s, starved, not hung. Each node is healed as soon as its run has ended."""
    names = [*LAUNCHES, *(name for name, _ in BATCH_LAUNCHES)]
    plan = [(name, kind) for kind in ("partition", "power-off") for name in names]
    runs: list[Run] = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            while len(runs) < len(plan) and sum(r.faulted_at is None for r in runs) < STARTING:
                (name, kind), k = plan[len(runs)], len(runs)
                first, second = f"node{2 * k + 1}", f"node{2 * k + 2}"
                runs.append(start_run(tmp_path, slurm_env, launcher_env, name, first, second))
                runs[-1].lost, runs[-1].fault = second, kind
            for r in runs:
                if r.faulted_at is None:
                    assert r.process is None or r.running(), f"{r.name} ended: {r.text()[-2000:]}"
                    if "held-out accuracy" in r.text():
                        r.faulted_at = time.monotonic()
                        r.injector = fault_started(r.lost, r.fault)
            note_ends(runs)
            heal_ended(runs)
            if len(runs) == len(plan) and all(r.ended_after is not None for r in runs):
                break
            time.sleep(0.5)
        assert len(runs) == len(plan) and all(r.faulted_at is not None for r in runs), [
            (r.name, r.text()[-1500:]) for r in runs if r.faulted_at is None
        ]
        deadline = time.monotonic() + 120
        while not heal_ended(runs):
            assert time.monotonic() < deadline, [r.lost for r in runs if r.injector.poll() is None]
            time.sleep(0.5)
        for r in runs:
            print(
                f"{r.name}, {r.fault}: named after {r.named_after} s, ended after {r.ended_after} s"
            )
        for r in runs:
            assert_ended_and_named(r)
        # After the heal, slurmctld reaches a partitioned node's slurmd only at its next
        # message retry (MessageTimeout 10 s a try); then slurmstepd ends the steps there.
        assert job_left(ALL_NODES, wait=60) == []
    finally:
        for r in runs:
            r.stop(slurm_env)


# ---- a slow link ---------------------------------------------------------------------------


def cap(node: str, rate: str) -> None:
    """Both directions of a node's link, as `ringtrain cluster up --link` caps them."""
    tbf = ["root", "tbf", "rate", rate, "burst", "4kb", "latency", "1s"]
    veth = f"{cluster_layout.PREFIX}{node}"
    subprocess.run(["tc", "qdisc", "replace", "dev", veth, *tbf], check=True)
    subprocess.run(["tc", "-n", veth, "qdisc", "replace", "dev", "eth0", *tbf], check=True)


def uncap(node: str) -> None:
    veth = f"{cluster_layout.PREFIX}{node}"
    subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], check=False)
    subprocess.run(["tc", "-n", veth, "qdisc", "del", "dev", "eth0", "root"], check=False)


SLOW_FLAGS = ["--model", "mlp", "--steps", "3", "--seed", "3", "--batch-size", "256"]
SLOW_PAIRS = {"data": ("node5", "node6"), "pipeline": ("node7", "node8")}
# A sixth of the cap's 64 kB/s. Both directions carry bulk bytes at once, so each one's ACKs
# wait in the other's 1 s tbf queue; TCP's retransmission timeout grows to about 2 s there
# (seen with `ss -ti`), and a lost retransmission doubles it. At 0.02 MB/s, two CI runs
# under the requeue test's load stopped a data run after 15.5 s without progress.
MIN_LINK_RATE = "0.01"


@pytest.fixture(scope="module")
def slow_link_runs(slurm_env, launcher_env, tmp_path_factory) -> Iterator[tuple[Path, dict]]:
    """The slow-link runs, started in the background: the requeue test asks for them first,
    so they share its minutes of waiting for Slurm instead of adding their own."""
    folder, jobs = tmp_path_factory.mktemp("slow-link"), {}
    try:
        for strategy, (first, second) in SLOW_PAIRS.items():
            cap(second, "512kbit")
            cmd = [
                *("mpirun", "-np", "2", "-H", f"{first}:1,{second}:1", *mpirun_flags(CIDR)),
                *(CLI, "train", "--strategy", strategy, *STRATEGY_ARGS[strategy], *SLOW_FLAGS),
                *("--comm-timeout", "2", "--min-link-rate", MIN_LINK_RATE),
                *("--weights-out", str(folder / f"{strategy}.npz")),
            ]
            log = (folder / f"{strategy}.log").open("w")
            jobs[strategy] = subprocess.Popen(cmd, stdout=log, stderr=log, env=launcher_env())
        yield folder, jobs
    finally:
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
        for _, second in SLOW_PAIRS.values():
            uncap(second)


# ---- requeue on fewer nodes ----------------------------------------------------------------

FROZEN_AT = 40  # the writer freezes in its second checkpoint: the first is the one to resume
FLAGS = ["--model", "mlp", "--seed", "5", "--steps", "60"]
REQUEUE_ARGS = {"data": [], "pipeline": ["--microbatches", "4"], "hybrid": ["--microbatches", "2"]}


@dataclass
class Requeued:
    """A `--nodes=1-2 --requeue` job on a pair of nodes whose checkpoint writer freezes on the
    first; `survivor` is the node it must finish on."""

    strategy: str
    job_id: str
    log: Path
    ckpt: Path
    weights: Path
    lost: str
    survivor: str

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def frozen(self) -> bool:
        """Its writer stopped itself between the parts and the manifest."""
        for pid in pids_with_environment(f"SLURM_JOB_ID={self.job_id}"):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            if "\nState:\tT" in status and pid in node_pids(self.lost):
                return True
        return False


def submit_requeued(tmp_path, env, strategy: str, pair: tuple[str, str]) -> Requeued:
    per_node, extra = (2, ["--pp-size", "2"]) if strategy == "hybrid" else (1, [])
    script = rendered(tmp_path, strategy, "1-2", per_node, *extra)
    ckpt, weights = tmp_path / f"ckpt-{strategy}", tmp_path / f"{strategy}.npz"
    log = tmp_path / f"{strategy}.log"
    args = [*FLAGS, *REQUEUE_ARGS[strategy], "--checkpoint-every", "20"]
    others = sorted(set(ALL_NODES) - set(pair))
    job = sbatch(
        env,
        script,
        log,
        *args,
        # Slurm, told by the operator, ends the frozen jobs; ringtrain's deadline must not
        # fire first, while the other jobs' writers are still on their way to freezing.
        *("--comm-timeout", "300", "--weights-out", str(weights)),
        options=[f"--exclude={','.join(others)}"],  # this pair, now and after the requeue
        extra_env={"CKPT_DIR": str(ckpt), FREEZE: f"freeze:{pair[0]}:{FROZEN_AT}"},
    )
    return Requeued(strategy, job, log, ckpt, weights, *pair)


def lose_nodes_while_frozen(env, jobs: list[Requeued], timeout: float = 300) -> None:
    """Wait for every writer to freeze mid-checkpoint; their nodes lose power; the operator
    marks them DOWN, so Slurm requeues their jobs."""
    deadline = time.monotonic() + timeout
    while not all(j.frozen() for j in jobs):
        assert time.monotonic() < deadline, [(j.strategy, j.text()[-1500:]) for j in jobs]
        time.sleep(0.5)
    for lost in sorted({j.lost for j in jobs}):
        fault(lost, "power-off")
        slurm(env, "scontrol", "update", f"NodeName={lost}", "State=DOWN", "Reason=power-loss")


def wait_for_end(env, job: Requeued, timeout: float = 400) -> None:
    """Until Slurm no longer lists the job as pending or running."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = slurm(env, "squeue", "-h", "-j", job.job_id, "-o", "%T").strip()
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED", "COMPLETING"):
            return
        time.sleep(1)
    raise AssertionError(f"job {job.strategy} still {state}: {job.text()[-2000:]}")


def folder_digest(folder: Path) -> dict[str, str]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def assert_resumed_exactly(job: Requeued, uninterrupted: Path, start: Path) -> None:
    text = job.text()
    assert f"slurm task 0 of step 0 on {job.survivor}" in text, text[-3000:]  # the requeue
    assert re.search(r"resumed from .* at step 20\b", text), text[-3000:]
    assert job.weights.exists(), text[-3000:]
    comparison = compare_weight_files(job.weights, uninterrupted, start)
    assert comparison.passed, (job.strategy, comparison)


def test_requeued_jobs_resume_on_the_nodes_left_and_a_pipeline_is_refused(
    slurm_env, tmp_path, slow_link_runs
):
    """Three `--nodes=1-2` jobs: data and a 2-stage pipeline on node1+node2, hybrid (2
    replicas x 2 stages) on node3+node4. Each writer freezes at step 40 between its parts
    and its manifest on node1 or node3, which then lose power. Requeued onto node2, data
    resumes at one rank from step 20 with the global batch unchanged; onto node4, hybrid
    resumes as one replica of the same 2 stages; both end with the uninterrupted run's
    weights. The pipeline, now one rank, is refused in one line, its checkpoint untouched."""
    data = submit_requeued(tmp_path, slurm_env, "data", ("node1", "node2"))
    pipeline = submit_requeued(tmp_path, slurm_env, "pipeline", ("node1", "node2"))
    hybrid = submit_requeued(tmp_path, slurm_env, "hybrid", ("node3", "node4"))
    jobs = [data, pipeline, hybrid]
    try:
        uninterrupted, start = tmp_path / "uninterrupted.npz", tmp_path / "initial.npz"
        outputs = ["--weights-out", str(uninterrupted), "--initial-weights-out", str(start)]
        done = run([CLI, "train", "--strategy", "single", *FLAGS, *outputs])
        assert done.returncode == 0, done.stderr[-2000:]
        lose_nodes_while_frozen(slurm_env, jobs)
        before = folder_digest(pipeline.ckpt)
        for job in jobs:
            wait_for_end(slurm_env, job)
        assert_resumed_exactly(data, uninterrupted, start)
        assert_resumed_exactly(hybrid, uninterrupted, start)
        errors = [line for line in pipeline.text().splitlines() if "error:" in line]
        assert any(
            "into 2 stages, but this run has 4 elements in 1 stage" in line for line in errors
        ), pipeline.text()
        assert "Traceback" not in pipeline.text()
        assert folder_digest(pipeline.ckpt) == before
    finally:
        for job in jobs:
            subprocess.run(["scancel", job.job_id], env=slurm_env, check=False)
        fault("node1", "heal")
        fault("node3", "heal")


def test_a_slow_link_is_no_false_alarm(slow_link_runs):
    """node6's and node8's links at 512 kbit/s (64 kB/s): a data-parallel step's gradient
    allreduce across node5+node6 (about 135 kB each way for the mlp) and a pipeline step's 8
    messages across node7+node8 (32 kB each at batch 256, M = 4) take 2.5 s or more,
    beyond --comm-timeout 2. With --min-link-rate below the link's rate both complete, with the
    weights of single-process training. (Each run has a capped link of its own: another
    job's bulk transfer ahead in the same queue is not this rank's bytes.)"""
    folder, jobs = slow_link_runs
    single, start = folder / "single.npz", folder / "initial.npz"
    outputs = ["--weights-out", str(single), "--initial-weights-out", str(start)]
    done = run([CLI, "train", "--strategy", "single", *SLOW_FLAGS, *outputs])
    assert done.returncode == 0, done.stderr[-2000:]
    for strategy, job in jobs.items():
        job.wait(timeout=400)
        text = (folder / f"{strategy}.log").read_text()
        said = [line for line in text.splitlines() if "error:" in line]  # before MPI's notice
        assert job.returncode == 0, (strategy, said, text[-1000:])
        comparison = compare_weight_files(folder / f"{strategy}.npz", single, start)
        assert comparison.passed, (strategy, comparison)
