"""Node faults on `ringtrain cluster`: a node that goes silent (its link cut, or cut and then
every process of it killed, as a power loss looks from outside) ends the job within
--comm-timeout + 30 s, with a non-zero exit, a line naming the lost rank and its host, and
nothing of the job left running in any namespace; and a slow link is no false alarm.

One cluster serves the partitions, whose link comes back afterwards, the slow link and, last,
the power loss (it kills node2's daemons too). The cluster is taken down even when a test
failed; a cluster that was already up (another session's) makes the tests fail in one line and
is left alone.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import BIN, ENV, ROOT, compare_weight_files, run

from ringtrain.cluster import layout as cluster_layout
from ringtrain.comm import transfer_time, waited
from ringtrain.launch.network import KEEPALIVE as KEEPALIVE_MCA
from ringtrain.launch.network import mpirun_flags

CLI = str(BIN / "ringtrain")
STATE = cluster_layout.STATE_DIR
CIDR = cluster_layout.DEFAULT_SUBNET
TIMEOUT = 20  # --comm-timeout: above the first step's tracing on a loaded 2-core machine
BOUND = TIMEOUT + 30
LOST = "node2"
JOB_PROGRAMS = ("python", "ringtrain", "orted", "srun", "slurmstepd", "mpirun", "slurm_script")
# A rank on node2 named with its host: by the heartbeat, or by a pipeline wait.
NAMED = re.compile(r"rank \d+ on node2 unreachable|\(rank \d+\) went silent.*runs on node2")
KEEPALIVE = " ".join(f"--mca {k} {v}" for k, v in KEEPALIVE_MCA.items())


def test_a_deadline_adds_the_bytes_at_the_minimum_rate():
    """The rule of comm.py: --comm-timeout plus the message's bytes at --min-link-rate."""
    assert transfer_time(5_000_000, 2.5) == pytest.approx(2.0)
    assert waited(20, transfer_time(5_000_000, 2.5)) == "20 s (+2.0 s for the bytes)"
    assert waited(8, transfer_time(1000)) == "8 s"  # small messages: the timeout alone


# ---- the cluster -------------------------------------------------------------------------


def cluster(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([CLI, "cluster", *args], timeout=timeout)


@pytest.fixture(scope="module")
def slurm_env() -> Iterator[dict[str, str]]:
    """A 2-node cluster with Slurm, and the environment its clients need."""
    done = cluster("up", "--nodes", "2", "--slurm")
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        pytest.fail(f"ringtrain cluster up --nodes 2 --slurm failed: {lines[-1]}")
    try:
        yield {**ENV, "SLURM_CONF": str(STATE / "slurm" / "etc" / "slurm.conf")}
    finally:
        subprocess.run(["ip", "link", "set", f"{cluster_layout.PREFIX}{LOST}", "up"], check=False)
        cluster("down")


def node_programs(node: str) -> list[str]:
    """The names of the processes running in a node's network namespace."""
    pids = subprocess.run(
        ["ip", "netns", "pids", f"{cluster_layout.PREFIX}{node}"], capture_output=True, text=True
    ).stdout.split()
    names = []
    for pid in pids:
        try:
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            continue
    return names


def job_left(nodes=("node1", "node2"), wait: float = 15) -> list[str]:
    """Processes of the job still running on the nodes, after giving them `wait` s to end."""
    deadline = time.monotonic() + wait
    while True:
        left = [f"{n}: {p}" for n in nodes for p in node_programs(n) if p.startswith(JOB_PROGRAMS)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


def cut(power_loss: bool) -> None:
    """The link down; for a power loss, then every process of the node killed."""
    subprocess.run(["ip", "link", "set", f"{cluster_layout.PREFIX}{LOST}", "down"], check=True)
    if power_loss:
        pids = subprocess.run(
            ["ip", "netns", "pids", f"{cluster_layout.PREFIX}{LOST}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        subprocess.run(["kill", "-9", *pids], check=False)


def restore() -> None:
    subprocess.run(["ip", "link", "set", f"{cluster_layout.PREFIX}{LOST}", "up"], check=True)


def wait_for(path: Path, needle: str, running: Callable[[], bool], timeout: float = 240) -> None:
    """Until `needle` appears in the file (the run is mid-training), or the job ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and running():
        if path.exists() and needle in path.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise AssertionError(f"never saw {needle!r}: {path.read_text(errors='replace')[-2000:]}")


STRATEGY_ARGS = {
    "data": [],
    "pipeline": ["--microbatches", "4"],
    "hybrid": ["--pp-size", "2", "--microbatches", "2"],
}


def train_args(strategy: str) -> list[str]:
    return [CLI, "train", "--strategy", strategy, *STRATEGY_ARGS[strategy], "--steps", "100000"]


def mpirun(strategy: str) -> list[str]:
    """ringtrain's documented mpirun line (a pipeline stage or replica per node)."""
    hosts = "node1:2,node2:2" if strategy == "hybrid" else "node1:1,node2:1"
    ranks = "4" if strategy == "hybrid" else "2"
    return ["mpirun", "-np", ranks, "-H", hosts, *mpirun_flags(CIDR), *train_args(strategy)]


def horovodrun() -> list[str]:
    """The horovodrun line `ringtrain cluster up` prints."""
    mpi_args = f"--mca oob_tcp_if_include {CIDR} {KEEPALIVE}"
    return [
        *("horovodrun", "-np", "2", "-H", "node1:1,node2:1", "--network-interface", "eth0"),
        *(f"--mpi-args={mpi_args}", *train_args("data")),
    ]


def fault(tmp_path: Path, launch: list[str], power_loss: bool):
    """Start a 2-node run, cut node2 mid-training, and return (seconds from the cut to the
    end, exit code, stderr)."""
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    cmd = [*launch, "--comm-timeout", str(TIMEOUT)]
    with out.open("w") as stdout, err.open("w") as stderr:
        job = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=ENV, cwd=ROOT)
        try:
            wait_for(out, "held-out accuracy", lambda: job.poll() is None)
            cut(power_loss)
            started = time.monotonic()
            job.wait(timeout=BOUND + 60)
            return time.monotonic() - started, job.returncode, err.read_text()
        finally:
            if job.poll() is None:
                job.kill()
            if not power_loss:
                restore()


def assert_bounded_and_named(seconds: float, code: int, stderr: str) -> None:
    assert code != 0, stderr[-2000:]
    assert seconds <= BOUND, f"{seconds:.0f} s: {stderr[-2000:]}"
    assert NAMED.search(stderr), stderr[-3000:]
    assert "Traceback" not in stderr


@pytest.mark.parametrize("strategy", ["pipeline", "hybrid"])
def test_a_partition_ends_a_run_under_mpirun_and_names_a_lost_rank(slurm_env, tmp_path, strategy):
    seconds, code, stderr = fault(tmp_path, mpirun(strategy), power_loss=False)
    assert_bounded_and_named(seconds, code, stderr)
    assert job_left() == []


def test_a_partition_ends_a_data_parallel_run_under_horovodrun(slurm_env, tmp_path):
    seconds, code, stderr = fault(tmp_path, horovodrun(), power_loss=False)
    assert_bounded_and_named(seconds, code, stderr)
    assert job_left() == []


def cap(rate: str) -> None:
    """Both directions of node2's link, as `ringtrain cluster up --link` caps them."""
    tbf = ["root", "tbf", "rate", rate, "burst", "4kb", "latency", "1s"]
    veth = f"{cluster_layout.PREFIX}{LOST}"
    subprocess.run(["tc", "qdisc", "replace", "dev", veth, *tbf], check=True)
    subprocess.run(["tc", "-n", veth, "qdisc", "replace", "dev", "eth0", *tbf], check=True)


def uncap() -> None:
    veth = f"{cluster_layout.PREFIX}{LOST}"
    subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], check=False)
    subprocess.run(["tc", "-n", veth, "qdisc", "del", "dev", "eth0", "root"], check=False)


def test_a_slow_link_is_no_false_alarm(slurm_env, tmp_path):
    """Mid-run, node2's link drops to 128 kbit/s: each step's gradient allreduce (about 135 kB
    each way for the mlp) then takes about 8 s, beyond --comm-timeout 5. With --min-link-rate
    below the link's rate the run completes, with the weights of single-process training."""
    flags = ["--model", "mlp", "--steps", "30", "--seed", "3"]
    single = tmp_path / "single.npz"
    done = run([CLI, "train", "--strategy", "single", *flags, "--weights-out", str(single)])
    assert done.returncode == 0, done.stderr[-2000:]
    out, weights = tmp_path / "out.txt", tmp_path / "w.npz"
    cmd = [
        *("mpirun", "-np", "2", "-H", "node1:1,node2:1", *mpirun_flags(CIDR)),
        *(CLI, "train", "--strategy", "data", *flags, "--weights-out", str(weights)),
        *("--comm-timeout", "5", "--min-link-rate", "0.005"),
    ]
    err = tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        job = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=ENV)
        try:
            wait_for(out, "held-out accuracy", lambda: job.poll() is None)  # step 28 of 30
            cap("128kbit")
            job.wait(timeout=300)
        finally:
            if job.poll() is None:
                job.kill()
            uncap()
    assert job.returncode == 0, err.read_text()[-2000:]
    comparison = compare_weight_files(weights, single, "mlp", 3)
    assert comparison.passed, comparison


def test_a_partition_ends_a_data_parallel_sbatch_job_under_srun(slurm_env, tmp_path):
    """srun --kill-on-bad-exit (the templates' launcher) ends the step once the rank that
    named the silent peer aborts; the batch script ends with its code 3."""
    log = tmp_path / "job.out"
    submitted = subprocess.run(
        [
            *("sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", f"--output={log}"),
            str(ROOT / "slurm" / "data-multinode.sbatch"),
            *("--steps", "100000", "--comm-timeout", str(TIMEOUT)),
        ],
        capture_output=True,
        text=True,
        env={**slurm_env, "RINGTRAIN_HOME": str(ROOT), "CKPT_DIR": str(tmp_path / "ckpt")},
        cwd=tmp_path,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        wait_for(log, "held-out accuracy", lambda: True)
        cut(power_loss=False)
        started = time.monotonic()
        script_ended = None
        while script_ended is None and time.monotonic() - started < BOUND + 60:
            if job_left(("node1",), wait=0) == []:  # the batch script and its step are gone
                script_ended = time.monotonic() - started
            time.sleep(1)
    finally:
        restore()
    info = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=slurm_env
    ).stdout
    text = log.read_text(errors="replace")
    assert script_ended is not None and script_ended <= BOUND, text[-2000:]
    assert "ExitCode=3:0" in info, info
    assert NAMED.search(text), text[-3000:]
    subprocess.run(["scancel", job_id], env=slurm_env, check=False)
    assert job_left() == []


def test_a_power_loss_ends_a_data_parallel_run_under_mpirun(slurm_env, tmp_path):
    """Last: it kills node2's sshd and slurmd along with the job."""
    seconds, code, stderr = fault(tmp_path, mpirun("data"), power_loss=True)
    assert_bounded_and_named(seconds, code, stderr)
    assert job_left() == []
