"""Across nodes, on `ringtrain cluster`: namespaces with their own hostnames, sshd and slurmd,
joined by capped veths. Every strategy trains across two nodes over TCP (the veth byte counters
show the bytes crossed) to the weights of single-process training; the Slurm templates run on
two nodes; doctor checks hosts; bad inputs cost one line.

One cluster (2 nodes, 1gbit, Slurm, 2 cores each) serves the tests in the first part and is
always taken down; a test that breaks a node brings up its own afterwards (one cluster at a
time: the node names are fixed). The tests send traffic only to loopback and to the
namespaces they created.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import BIN, ENV, REFERENCE_FLAGS, ROOT, compare_weight_files, load_npz, run
from test_memory_check import WIDE_MODEL

from ringtrain.cluster import layout as cluster_layout
from ringtrain.cluster.memory import groups_folder
from ringtrain.cluster.slurm import SlurmCluster
from ringtrain.cluster.system import alive, netns_pids
from ringtrain.memory_limit import oom_kills

CLI = str(BIN / "ringtrain")
STATE = cluster_layout.STATE_DIR
NODES = ("node1", "node2")
CIDR = cluster_layout.DEFAULT_SUBNET
LINK_BITS = 10**9
SHARED_UP = ["--nodes", "2", "--link", "1gbit", "--slurm", "--cpus-per-node", "2"]
NETWORK_FLAGS = [
    *("--bind-to", "none", "--mca", "btl_tcp_if_include", CIDR),
    *("--mca", "oob_tcp_if_include", CIDR),
]
# Each rank says where it runs before it becomes `ringtrain train` (found on the node's PATH).
WHERE = ["sh", "-c", 'echo "rank $OMPI_COMM_WORLD_RANK on $(hostname)"; exec "$@"', "where"]
CORES = ["sh", "-c", "taskset -pc $$"]  # the CPU mask a process started on the node gets
SINGLE_FLAGS = REFERENCE_FLAGS  # mlp, 5 steps, global batch 48, seed 1
START = "initial.npz"  # the single run's --initial-weights-out, beside its weights
STEPS = 5
BATCH = 48
JOB_TIMEOUT = 300


def cluster(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([CLI, "cluster", *args], timeout=timeout)


def run_with(env: dict[str, str], cmd: list[str], timeout: float = 120, **kwargs):
    """Like conftest.run, with another environment (the cluster's SLURM_CONF, a bad network)."""
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, **{"cwd": ROOT, **kwargs}
    )


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


@dataclass(frozen=True)
class Up:
    output: str
    env: dict[str, str]


@pytest.fixture(scope="module")
def shared() -> Iterator[Up]:
    """The cluster the first tests share; down even when a test failed."""
    done = bring_up(*SHARED_UP)
    try:
        env = {**ENV, "SLURM_CONF": str(STATE / "slurm" / "etc" / "slurm.conf")}
        yield Up(done.stdout, env)
    finally:
        cluster("down")


def veth_bytes() -> dict[str, tuple[int, int]]:
    """Per node: (bytes the node sent, bytes it received), read at the host's end of its veth."""
    counters = {}
    for node in NODES:
        stats = Path(f"/sys/class/net/{cluster_layout.PREFIX}{node}/statistics")
        counters[node] = (
            int((stats / "rx_bytes").read_text()),
            int((stats / "tx_bytes").read_text()),
        )
    return counters


def crossed(before: dict, after: dict) -> dict[str, tuple[int, int]]:
    return {n: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in NODES}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """Single-process training's weights: what every run across nodes must reproduce. Its
    initial weights (START beside it) are where every run's update is measured from."""
    out = tmp_path_factory.mktemp("single") / "w.npz"
    outputs = ["--weights-out", str(out), "--initial-weights-out", str(out.with_name(START))]
    done = run([CLI, "train", "--strategy", "single", *SINGLE_FLAGS, *outputs])
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def assert_same_training(weights: Path, single: Path) -> None:
    comparison = compare_weight_files(weights, single, single.with_name(START))
    print(comparison)
    assert comparison.passed, comparison


def param_bytes(weights: Path, prefixes: tuple[str, ...] = ("",)) -> int:
    """float32 bytes of the weights whose names start with one of `prefixes`."""
    return sum(a.size * 4 for name, a in load_npz(weights).items() if name.startswith(prefixes))


def ranks_on(output: str) -> dict[int, str]:
    return {int(r): h for r, h in re.findall(r"rank (\d+) on (\S+)", output)}


# --- the cluster itself ---------------------------------------------------------------------


def test_nodes_answer_to_their_names_by_exec_and_ssh_and_slurm_has_them_idle(shared):
    for node in NODES:
        done = cluster("exec", node, "--", "hostname")
        assert (done.returncode, done.stdout.strip()) == (0, node), done.stderr
        done = run(["ssh", node, "hostname"], timeout=30)  # as mpirun and horovodrun will
        assert (done.returncode, done.stdout.strip()) == (0, node), done.stderr
    done = cluster("exec", "node2", "--", *CORES)
    assert done.stdout.strip().endswith(": 0,1"), done.stdout  # --cpus-per-node 2
    sinfo = run_with(shared.env, ["sinfo", "-h", "-N", "-o", "%N %t %c"])
    assert sinfo.stdout.split("\n")[:2] == ["node1 idle 2", "node2 idle 2"], sinfo
    status = cluster("status")
    assert status.returncode == 0 and status.stdout.count("sshd running") == 2, status.stdout
    for needle in (
        str(STATE / "hostfile.mpirun"),
        str(STATE / "hostfile.horovod"),
        f"export SLURM_CONF={shared.env['SLURM_CONF']}",
        f"export RINGTRAIN_NETWORK={CIDR}",
        " ".join(NETWORK_FLAGS),
        "--mca oob_tcp_keepalive_time 5 --mca oob_tcp_keepalive_intvl 2",
    ):
        assert needle in shared.output, shared.output
    assert (STATE / "hostfile.mpirun").read_text() == "node1 slots=2\nnode2 slots=2\n"


P2P = """
import socket, time
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
buf = np.ones(32 * 2**20, dtype=np.uint8)
comm.Sendrecv(buf[:1], 1 - comm.rank, recvbuf=buf[1:2], source=1 - comm.rank)  # connect first
best = 0.0
for _ in range(3):  # the best of three: the link's rate when the shared CPUs let it run
    comm.Barrier()
    start = time.perf_counter()
    comm.Send(buf, 1) if comm.rank == 0 else comm.Recv(buf, 0)
    comm.Barrier()
    best = max(best, buf.nbytes * 8 / (time.perf_counter() - start))
print(f"rank {comm.rank} on {socket.gethostname()} rate {best:.0f}", flush=True)
"""


def test_point_to_point_between_nodes_runs_at_the_link_cap(shared, tmp_path):
    script = tmp_path / "p2p.py"
    script.write_text(P2P)
    mpirun = ["mpirun", "-np", "2", "-H", "node1:1,node2:1", *NETWORK_FLAGS]
    done = run([*mpirun, str(BIN / "python"), str(script)], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ranks_on(done.stdout) == {0: "node1", 1: "node2"}, done.stdout
    rates = {int(r): float(x) for r, x in re.findall(r"rank (\d) on \S+ rate (\d+)", done.stdout)}
    received = rates[1]  # the receiver's clock: its Recv returns once the bytes have arrived
    print(f"point to point over a 1gbit link: {received / 1e9:.3f} Gbit/s")
    assert 0.8 * LINK_BITS <= received <= 1.2 * LINK_BITS, rates


# --- every strategy across nodes ------------------------------------------------------------


def train_across(launcher: list[str], strategy: list[str], out: Path):
    """One training run; returns (rank -> host, bytes crossed per node, output)."""
    before = veth_bytes()
    argv = [*launcher, *WHERE, "ringtrain", "train", *strategy, *SINGLE_FLAGS]
    done = run([*argv, "--weights-out", str(out)], timeout=JOB_TIMEOUT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return ranks_on(done.stdout), crossed(before, veth_bytes()), done.stdout


def test_data_parallel_by_horovodrun_across_two_nodes_equals_single_process(
    shared, single, tmp_path
):
    """horovodrun -H launches over ssh; the gradients' allreduce crosses the link every step."""
    out = tmp_path / "w.npz"
    # The nodes call their link eth0: naming it spares horovodrun its interface probe.
    horovodrun = ["horovodrun", "-np", "2", "-H", "node1:1,node2:1", "--network-interface", "eth0"]
    horovodrun += ["--mpi-args", f"--mca oob_tcp_if_include {CIDR}"]
    hosts, bytes_, _ = train_across(horovodrun, ["--strategy", "data"], out)
    assert hosts == {0: "node1", 1: "node2"}
    assert_same_training(out, single)
    # A 2-rank allreduce sends each rank's whole gradient at least once per step, each way.
    required = STEPS * param_bytes(out)
    assert all(sent >= required and got >= required for sent, got in bytes_.values()), (
        bytes_,
        required,
    )


def test_data_parallel_by_mpirun_hostfile_with_real_names_equals_single_process(
    shared, single, tmp_path
):
    hostfile = tmp_path / "hosts"
    convert = run([CLI, "hostfile", "convert", "node[1-2]", "--slots", "1", "--format", "mpirun"])
    hostfile.write_text(convert.stdout)
    assert convert.stdout == "node1 slots=1\nnode2 slots=1\n", convert
    out = tmp_path / "w.npz"
    launcher = ["mpirun", "-np", "2", "--hostfile", str(hostfile), *NETWORK_FLAGS]
    hosts, bytes_, _ = train_across(launcher, ["--strategy", "data"], out)
    assert hosts == {0: "node1", 1: "node2"}
    assert_same_training(out, single)
    required = STEPS * param_bytes(out)
    assert all(sent >= required and got >= required for sent, got in bytes_.values()), bytes_


def test_pipeline_one_stage_per_node_equals_single_process(shared, single, tmp_path):
    """Stage 0 (layer00-01) on node1, stage 1 on node2: activations go over the link forward,
    their gradients come back."""
    out = tmp_path / "w.npz"
    launcher = ["mpirun", "-np", "2", "-H", "node1:1,node2:1", *NETWORK_FLAGS]
    hosts, bytes_, _ = train_across(launcher, ["--strategy", "pipeline"], out)
    assert hosts == {0: "node1", 1: "node2"}
    assert_same_training(out, single)
    boundary = load_npz(out)["layer01/bias"].size  # the width stage 0 hands on
    required = STEPS * BATCH * boundary * 4
    node1_sent, node1_got = bytes_["node1"]
    assert node1_sent >= required and node1_got >= required, (bytes_, required)


def test_hybrid_2x2_keeps_each_pipeline_on_a_node_and_crosses_with_replicas(
    shared, single, tmp_path
):
    """4 ranks, 2 per node: pipeline 0 is ranks 0-1 on node1, pipeline 1 ranks 2-3 on node2;
    each stage's replicas average their gradients across the link."""
    out = tmp_path / "w.npz"
    hostfile = str(STATE / "hostfile.mpirun")
    launcher = ["mpirun", "-np", "4", "--hostfile", hostfile, *NETWORK_FLAGS]
    strategy = ["--strategy", "hybrid", "--pp-size", "2", "--microbatches", "2"]
    hosts, bytes_, output = train_across(launcher, strategy, out)
    assert hosts == {0: "node1", 1: "node1", 2: "node2", 3: "node2"}, output
    assert "pipeline 1: ranks [2, 3]" in output, output
    assert_same_training(out, single)
    required = STEPS * param_bytes(out)  # every stage's gradients, once per step
    assert all(sent >= required and got >= required for sent, got in bytes_.values()), bytes_


# --- Slurm across nodes ---------------------------------------------------------------------


def sbatch(shared: Up, argv: list[str], cwd: Path):
    harness = SlurmCluster(shared.env, STATE / "slurm")
    system_path = os.pathsep.join(p for p in ENV["PATH"].split(os.pathsep) if Path(p) != BIN)
    # slurm/common.sh turns RINGTRAIN_NETWORK into the ranks' Open MPI and Horovod settings.
    env = {"RINGTRAIN_HOME": str(ROOT), "PATH": system_path, "RINGTRAIN_NETWORK": CIDR}
    record, returncode = harness.sbatch_wait(
        ["--time=10", *argv], cwd=cwd, env=env, timeout=JOB_TIMEOUT
    )
    output = Path(record.fields["StdOut"]).read_text(errors="replace")
    return record, returncode, output


@pytest.mark.parametrize(
    "template, per_node, pp_size",
    [("data-multinode.sbatch", 1, None), ("hybrid.sbatch", 2, "2")],
)
def test_slurm_template_on_two_nodes_equals_single_process(
    shared, single, tmp_path, template, per_node, pp_size
):
    """--nodes=2: Slurm allocates both nodes and srun starts the ranks there (hybrid: one
    pipeline per node)."""
    out = tmp_path / "w.npz"
    options = ["--nodes=2", f"--ntasks-per-node={per_node}"]
    if pp_size:
        options.append(f"--export=ALL,PP_SIZE={pp_size}")
    argv = [*options, str(ROOT / "slurm" / template), *SINGLE_FLAGS, "--weights-out", str(out)]
    record, returncode, output = sbatch(shared, argv, tmp_path)
    assert (record.state, record.exit_code, returncode) == ("COMPLETED", 0, 0), output[-3000:]
    assert record.fields["NodeList"] == "node[1-2]", record.fields
    # Each task says where it runs (the cluster's TaskProlog), before ringtrain starts.
    tasks = {int(r): h for r, h in re.findall(r"slurm task (\d+) of step 0 on (\S+)", output)}
    assert tasks == {r: NODES[r // per_node] for r in range(2 * per_node)}, output[-3000:]
    assert "held-out accuracy" in output and "Traceback" not in output, output[-3000:]
    assert_same_training(out, single)


def test_slurm_refuses_more_tasks_per_node_than_a_node_has_cpus(shared, tmp_path):
    """Node CPU counts and tasks per node must agree, or the job is refused at submission."""
    script = str(ROOT / "slurm" / "data-multinode.sbatch")
    done = run_with(
        shared.env, ["sbatch", "--nodes=2", "--ntasks-per-node=3", script], cwd=tmp_path
    )
    assert done.returncode != 0
    assert "Batch job submission failed" in done.stderr, done.stderr


# --- plan across nodes ----------------------------------------------------------------------


def test_plan_calibrates_across_the_nodes_and_its_recommended_line_trains_there(shared, tmp_path):
    """`plan calibrate --hosts` measures both link kinds; `plan` for 2 nodes of a rank each
    ranks the candidates and its recommended line, pasted after the cluster's mpirun flags,
    trains across the nodes. How close the prediction comes is the benchmark's to say
    (`ringtrain bench plan`); it is printed here, not asserted."""
    # one thread a rank in the calibration and in the run alike (the nodes share 2 cores)
    env = {**shared.env, "RINGTRAIN_NETWORK": CIDR, "RINGTRAIN_THREADS": "1"}
    calibration, metrics = tmp_path / "calibration.json", tmp_path / "metrics.json"
    common = ["--calibration", str(calibration)]
    done = run_with(env, [CLI, "plan", "calibrate", "--hosts", "node1,node2", *common], 400)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    figures = json.loads(calibration.read_text())
    assert set(figures["p2p"]) == set(figures["allreduce"]) == {"intra", "inter"}
    assert figures["compute_measured"] == "inter"
    done = run_with(env, [CLI, "plan", "--nodes", "2", "--ranks-per-node", "1", *common, "--json"])
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads(done.stdout)
    first = table["candidates"][0]
    assert table["recommended"].startswith("mpirun -np 2 ringtrain train --model mlp"), table
    assert {row["stages"] for row in table["candidates"]} == {1, 2}
    launcher = ["mpirun", "-np", "2", "-H", "node1:1,node2:1", *NETWORK_FLAGS]
    launcher += ["-x", "RINGTRAIN_THREADS"]
    recommended = table["recommended"].split()[3:]  # after `mpirun -np 2`
    argv = [*launcher, *recommended, "--steps", "40", "--progress", "none"]
    done = run_with(env, [*argv, "--metrics-out", str(metrics)], timeout=JOB_TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(metrics.read_text())["samples_per_sec"]
    print(
        f"{first['configuration']} across 2 nodes: predicted {first['samples_per_sec']:.0f}, "
        f"measured {measured:.0f} samples/s"
    )


# --- a sweep across the nodes ---------------------------------------------------------------


def test_two_sweeps_at_once_share_one_journal_study_across_the_nodes(shared, tmp_path):
    """Two launches at once on one study, each 2 groups of 1 rank (one per node), sharing
    Optuna's journal file on the shared path: the study gets exactly --trials trials, each run
    once by one group, and none is lost."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    from ringtrain.sweep import ledger

    space = tmp_path / "space.yaml"
    space.write_text("lr: {type: float, low: 0.01, high: 0.3, log: true}\n")
    journal = tmp_path / "study.journal"
    sweep = [*("sweep", "run", str(space), "--study", "both", "--storage", f"journal:{journal}")]
    sweep += [*("--trials", "6", "--objective", "val_accuracy", "--direction", "maximize")]
    sweep += [*("--sampler", "random", "--pruner", "none", "--out", str(tmp_path / "out"))]
    sweep += [*("--model", "mlp", "--epochs", "2", "--strategy", "single", "--seed", "1")]
    launcher = ["mpirun", "-np", "2", "-H", "node1:1,node2:1", *NETWORK_FLAGS]
    argv = [*launcher, *WHERE, "ringtrain", *sweep]
    options = {"env": ENV, "cwd": ROOT, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    both = [subprocess.Popen(argv, text=True, **options) for _ in range(2)]
    said = [p.communicate(timeout=JOB_TIMEOUT)[0] for p in both]
    assert [p.returncode for p in both] == [0, 0], said[0][-2000:] + said[1][-2000:]
    for output in said:
        assert ranks_on(output) == {0: "node1", 1: "node2"}
    study = optuna.load_study(
        study_name="both", storage=JournalStorage(JournalFileBackend(str(journal)))
    )
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 6 and ledger.counted(trials) == 6
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials), trials
    assert {tuple(t.user_attrs[ledger.HOSTS]) for t in trials} == {("node1",), ("node2",)}
    assert len({t.user_attrs[ledger.LAUNCH] for t in trials}) == 2  # both launches took trials
    done = [line for output in said for line in output.splitlines() if " done: " in line]
    numbers = sorted(int(line.split("trial ")[1].split()[0]) for line in done)
    assert numbers == list(range(6)), done  # each trial trained once, by one group


# --- doctor across hosts, and what one cluster at a time means ------------------------------


def test_doctor_across_the_nodes_passes(shared):
    hostfile = STATE / "hostfile.mpirun"
    env = {**ENV, "RINGTRAIN_NETWORK": CIDR}  # doctor's mpirun keeps to the cluster's subnet
    done = run_with(env, [CLI, "doctor", "--hostfile", str(hostfile)], timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "host node1: ok" in done.stdout and "host node2: ok" in done.stdout, done.stdout
    assert "(across node1 and node2)" in done.stdout, done.stdout


def test_second_cluster_up_is_refused_in_one_line(shared):
    done = cluster("up", "--nodes", "2")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "a cluster is already up" in done.stderr, done.stderr


def test_doctor_and_hostfile_check_with_a_host_that_does_not_exist(shared, tmp_path):
    """Run from node1, whose only network is the cluster's: the failed lookup stays inside."""
    on_node1 = [CLI, "cluster", "exec", "node1", "--", CLI]
    done = run([*on_node1, "doctor", "--hosts", "no-such-node.invalid"], timeout=120)
    problems = [line for line in done.stderr.splitlines() if line.startswith("problem:")]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert problems == [
        "problem: host no-such-node.invalid does not resolve: not in DNS or /etc/hosts "
        "(typo in the hostfile?)"
    ], done.stderr
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node2 slots=1\nno-such-node.invalid slots=2\n")
    done = run([*on_node1, "hostfile", "check", str(hostfile)], timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done
    assert done.stdout.splitlines() == [
        "host no-such-node.invalid does not resolve: not in DNS or /etc/hosts "
        "(typo in the hostfile?)"
    ], done.stdout


def assert_no_trace_of_a_cluster(node_pids: list[int]) -> None:
    assert not [n for n in os.listdir("/var/run/netns") if n.startswith("rtc-")]
    links = run(["ip", "-o", "link", "show"]).stdout
    assert "rtc-" not in links, links
    assert "ringtrain-cluster" not in Path("/etc/hosts").read_text()
    assert not Path("/etc/ssh/ssh_config.d/ringtrain-cluster.conf").exists()
    assert not STATE.exists()
    assert node_pids and not any(alive(pid) for pid in node_pids)
    leftovers = run(["pgrep", "-f", str(STATE)]).stdout.split()
    assert leftovers == [], leftovers


def processes_on_nodes() -> list[int]:
    return [pid for n in NODES for pid in netns_pids(f"{cluster_layout.PREFIX}{n}")]


def test_down_removes_every_namespace_link_process_and_line_up_created(shared):
    on_nodes = processes_on_nodes()  # each node's sshd and slurmd
    assert len(on_nodes) >= 4, on_nodes
    done = cluster("down")
    assert done.returncode == 0, done.stderr
    assert_no_trace_of_a_cluster(on_nodes)


def test_down_after_a_crashed_up_finds_what_it_created_by_name():
    """The state file lost (as if `up` was killed): a new `up` is refused while the nodes'
    processes run, `down` still removes everything by its rtc- names and /etc/hosts marker.
    Once every process of it is dead too (its session killed), the next `up` removes it."""
    require_root()
    bring_up("--nodes", "2")
    try:
        on_nodes = processes_on_nodes()
        (STATE / "state.json").unlink()
        done = cluster("up", "--nodes", "2")
        assert done.returncode == 2 and "leftovers of an earlier cluster" in done.stderr, done
        for pid in on_nodes:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in on_nodes) and time.monotonic() < deadline:
            time.sleep(0.1)
        done = cluster("up", "--nodes", "2")
        assert done.returncode == 0, done.stderr
        assert "removed an abandoned cluster" in done.stderr, done.stderr
        on_nodes = processes_on_nodes()
    finally:
        done = cluster("down")
    assert done.returncode == 0, done.stderr
    assert_no_trace_of_a_cluster(on_nodes)


# --- a cluster of its own: broken nodes --------------------------------------------------------


def test_doctor_names_the_node_whose_ssh_path_lacks_ringtrain_and_the_one_refusing_ssh():
    """node2's sshd is restarted with another PATH for its sessions (a per-node setting on a
    shared filesystem, like a node whose shell profile does not activate the venv); node3's
    sshd is stopped, so it refuses connections."""
    require_root()
    done = bring_up("--nodes", "3")
    try:
        # Default pinning: a distinct core per node, cycling past the machine's cores.
        cores = sorted(os.sched_getaffinity(0))
        for k, node in enumerate(("node1", "node2", "node3")):
            mask = cluster("exec", node, "--", *CORES).stdout.strip()
            assert mask.endswith(f": {cores[k % len(cores)]}"), (node, mask)
        config = STATE / "node2" / "sshd_config"
        broken = f"{config}.plain-path"
        text = config.read_text()
        Path(broken).write_text(re.sub(r'SetEnv "PATH=[^"]*"', 'SetEnv "PATH=/usr/bin:/bin"', text))
        for node in ("node2", "node3"):
            pid = (STATE / node / "sshd.pid").read_text().strip()
            assert cluster("exec", node, "--", "kill", pid).returncode == 0
        assert cluster("exec", "node2", "--", "/usr/sbin/sshd", "-f", broken).returncode == 0
        done = run([CLI, "doctor", "--hosts", "node1,node2"], timeout=400)
        assert done.returncode == 1, done.stdout + done.stderr
        problems = [line for line in done.stderr.splitlines() if line.startswith("problem:")]
        assert len(problems) == 1 and "node2" in problems[0], done.stderr
        assert "`ringtrain` is not on the PATH" in problems[0], problems
        done = run([CLI, "doctor", "--hosts", "node1,node3"], timeout=400)
        problems = [line for line in done.stderr.splitlines() if line.startswith("problem:")]
        assert done.returncode == 1 and len(problems) == 1, done.stderr
        assert "host node3: not reachable by ssh" in problems[0], problems
        assert "Connection refused" in problems[0], problems
    finally:
        cluster("down")


# --- a cluster of its own: memory-capped nodes ------------------------------------------------

CAP_MIB = 300
ALLOCATE = """
import sys
print("memory cgroup", open("/proc/self/cgroup").read().split("memory:")[-1].split()[0])
held = []
for step in range(int(sys.argv[1])):
    held.append(bytearray(50 * 2**20))  # zero-filled: every page is touched
    print(f"holding {50 * (step + 1)} MiB", flush=True)
print("done", flush=True)
"""


def test_memory_capped_node_kills_what_goes_over_and_slurm_refuses_more_than_the_cap(tmp_path):
    """--mem-per-node 300M: the node's sshd and slurmd are in its memory cgroup, so a process
    started over ssh that grows past the cap is killed by the kernel (SIGKILL, an OOM kill in
    the cgroup's record) while one below it finishes; Slurm knows the node as RealMemory=300,
    refuses a job asking for more at submission and runs one asking for less, inside the
    cgroup. A `ringtrain train` rank killed there is named, with its node and the cap, in one
    line. A group left over from an earlier cluster is made anew; `down` removes it."""
    require_root()
    script = tmp_path / "allocate.py"
    script.write_text(ALLOCATE)
    group = groups_folder() / "node1"
    group.mkdir(parents=True)  # a leftover, without a cap
    bring_up("--nodes", "1", "--slurm", "--mem-per-node", f"{CAP_MIB}M")
    try:
        assert json.loads((STATE / "state.json").read_text())["memory_groups"] == str(group.parent)
        inside = (group / "cgroup.procs").read_text().split()
        for daemon in ("node1/sshd.pid", "slurm/run/slurmd-node1.pid"):
            assert (STATE / daemon).read_text().strip() in inside, (daemon, inside)
        over = run(["ssh", "node1", f"python3 {script} 10; echo exit=$?"], timeout=60)
        print(over.stdout)
        assert "exit=137" in over.stdout and "done" not in over.stdout, over  # 128 + SIGKILL
        assert "ringtrain-cluster/node1" in over.stdout, over.stdout
        assert oom_kills(group) == 1
        # A rank over the cap (an MLP whose Adam state alone is 200 MiB), forced past the
        # memory check: its parent names the kill.
        (tmp_path / "wide.py").write_text(WIDE_MODEL)
        forced = f"--model {tmp_path}/wide.py:wide --steps 1 --ignore-memory-check"
        rank = f"{CLI} train --strategy single {forced}; echo exit=$?"
        killed = run(["ssh", "node1", rank], timeout=120)
        assert "exit=137" in killed.stdout and "Traceback" not in killed.stderr, killed
        line = f"rank 0 on node1 was killed by the node's memory limit ({CAP_MIB} MiB)"
        assert killed.stderr.count(line) == 1, killed.stderr
        assert oom_kills(group) == 2
        under = cluster("exec", "node1", "--", "python3", str(script), "2")
        assert under.returncode == 0 and "done" in under.stdout, under
        status = cluster("status").stdout
        assert f"memory cap {CAP_MIB} MiB" in status and "2 OOM kills" in status, status
        env = {**ENV, "SLURM_CONF": str(STATE / "slurm" / "etc" / "slurm.conf")}
        node = run_with(env, ["scontrol", "show", "node", "node1"]).stdout
        assert f"RealMemory={CAP_MIB} " in node, node
        more = ["sbatch", f"--mem={CAP_MIB + 1}M", "--wrap", "true"]
        refused = run_with(env, more, cwd=tmp_path)
        print(refused.stderr)
        assert refused.returncode == 1, refused
        assert "Requested node configuration is not available" in refused.stderr, refused
        job = f'echo "mem $SLURM_MEM_PER_NODE"; python3 {script} 2'
        harness = SlurmCluster(env, STATE / "slurm")
        for asked, given in (["--mem=200M"], 200), ([], CAP_MIB):  # without --mem: the node's
            record, code = harness.sbatch_wait([*asked, "--wrap", job], cwd=tmp_path)
            output = Path(record.fields["StdOut"]).read_text()
            assert (record.state, code) == ("COMPLETED", 0), output
            assert f"mem {given}\n" in output and "ringtrain-cluster/node1" in output, output
    finally:
        cluster("down")
    assert not group.parent.exists()


BIG_CAP_MIB = 2048
# 130 Dense layers of 1024 (521 MiB of weights) under Adam: one process is predicted at 1.22
# times the cap, each of two pipeline stages at 0.93 (a stage's peak anonymous memory measured
# at 0.7 outside the cap)
TOO_BIG = [
    *("--model", f"{ROOT}/tests/user_models.py:tall_mlp"),
    *("--model-arg", "depth=130", "--model-arg", "adam=True"),
    *("--data", f"{ROOT}/tests/user_models.py:digits_split", "--no-shuffle", "--seed", "7"),
    *("--batch-size", "16", "--steps", "2", "--progress", "none"),
]


def predicted_of_cap(text: str) -> float:
    """The memory check's prediction per rank, as a share of the cap."""
    found = re.search(r"predicted ([\d.]+) (GiB|MiB) per rank", text)
    assert found, text[-2000:]
    mib = float(found[1]) * (1024 if found[2] == "GiB" else 1)
    return mib / BIG_CAP_MIB


def test_a_model_no_capped_node_can_hold_trains_as_a_pipeline_across_two_as_keras_fit_does(
    tmp_path,
):
    """--mem-per-node 2048M on 2 nodes, and a model one process is predicted to need more than
    the cap for: `single` and `data` are refused in one line before they train, and `single`
    forced past the check is killed by the cap and named; a 2-stage pipeline, a stage per
    node, trains it within the cap. Each stage rank adds under 60% of the model's weights to
    its memory as it builds its stage, nothing gathers the whole model (the stages' checkpoint
    parts hold the weights), and the updates match Keras's own fit, run here outside the
    cap."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    import user_models
    from reference import compare_updates, keras_fit_updates

    bring_up("--nodes", "2", "--mem-per-node", f"{BIG_CAP_MIB}M")
    try:
        alone = run(["ssh", "node1", f"{CLI} train --strategy single {' '.join(TOO_BIG)}"])
        assert alone.returncode == 2 and "Traceback" not in alone.stderr, alone.stderr
        assert "(cgroup); fits: `--strategy pipeline" in alone.stderr, alone.stderr
        assert "on 2 ranks" in alone.stderr, alone.stderr
        assert predicted_of_cap(alone.stderr) > 1.1
        forced = f"{CLI} train --strategy single {' '.join(TOO_BIG)} --ignore-memory-check"
        killed = run(["ssh", "node1", f"{forced}; echo exit=$?"], timeout=JOB_TIMEOUT)
        assert "exit=137" in killed.stdout and "Traceback" not in killed.stderr, killed
        line = f"rank 0 on node1 was killed by the node's memory limit ({BIG_CAP_MIB} MiB)"
        assert killed.stderr.count(line) == 1, killed.stderr
        launcher = ["mpirun", "-q", "-np", "2", "-H", "node1:1,node2:1", *NETWORK_FLAGS, CLI]
        replicas = run([*launcher, "train", "--strategy", "data", *TOO_BIG])
        assert replicas.returncode != 0 and "Traceback" not in replicas.stderr, replicas
        assert replicas.stderr.count("error: predicted") == 1, replicas.stderr
        metrics, folder = tmp_path / "metrics.json", tmp_path / "checkpoints"
        outputs = ["--metrics-out", str(metrics), "--checkpoint-dir", str(folder)]
        stages = ["--strategy", "pipeline", "--partition", "params", "--microbatches", "2"]
        piped = run([*launcher, "train", *stages, *TOO_BIG, *outputs], timeout=JOB_TIMEOUT)
        assert piped.returncode == 0, piped.stderr[-3000:]
        assert predicted_of_cap(piped.stdout + piped.stderr) < 0.95
    finally:
        cluster("down")
    trained = {}
    for part in sorted((folder / "step-00000002").glob("stage*.npz")):
        with np.load(part) as stage:
            trained |= {k[8:]: stage[k] for k in stage.files if k.startswith("weights/")}
    (x, y), _ = user_models.digits_split()
    fit = keras_fit_updates(user_models.tall_mlp, x, y, 16, 2, seed=7, depth=130, adam=True)
    whole = sum(a.nbytes for a in fit.initial.values())
    comparison = compare_updates(fit.initial, trained, fit.final)
    print(comparison)
    assert comparison.passed, comparison
    added = json.loads(metrics.read_text())["model_resident_bytes"]
    print([f"+{grew / 2**20:.0f} MiB of {whole / 2**20:.0f}" for grew in added])
    assert len(added) == 2 and all(0 < grew < 0.6 * whole for grew in added), (added, whole)


# --- bad input ----------------------------------------------------------------------------


def one_line(done: subprocess.CompletedProcess, code: int, needle: str) -> None:
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert needle in done.stderr, done.stderr


def test_cluster_up_without_root_is_one_line():
    # A user namespace without a uid map: the process is uid 65534 without root's powers, yet
    # still reads the checkout (setpriv to nobody cannot, when the clone sits in a 0700 folder).
    nobody = ["unshare", "--user"]
    done = run([*nobody, CLI, "cluster", "up", "--nodes", "2"], timeout=60)
    one_line(done, 2, "ringtrain cluster: error: `ringtrain cluster up` needs root")
    assert done.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "size, needle",
    [
        ("0", "argument --mem-per-node: a node's memory must be above zero, got '0'"),
        ("abc", "argument --mem-per-node: not a size in bytes: 'abc' (e.g. 2G or 512M)"),
        ("12Q", "argument --mem-per-node: not a size in bytes: '12Q'"),
        ("10M", "--mem-per-node of 10 MiB is too small: give at least 64M"),
    ],
)
def test_bad_memory_cap_is_one_line_before_anything_is_made(size, needle):
    require_root()
    done = cluster("up", "--nodes", "1", "--mem-per-node", size)
    one_line(done, 2, needle)
    assert done.stderr.count("\n") == 1, done.stderr


def test_memory_cap_without_a_memory_controller_is_one_line():
    """A mount namespace whose /sys/fs/cgroup is an empty tmpfs: a host without cgroups."""
    require_root()
    without = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs none /sys/fs/cgroup && "$@"', "-"]
    done = run([*without, CLI, "cluster", "up", "--nodes", "1", "--mem-per-node", "1G"])
    one_line(done, 2, "--mem-per-node needs a memory cgroup controller")
    assert done.stderr.count("\n") == 1, done.stderr


def test_network_matching_no_interface_is_one_line():
    done = run_with({**ENV, "RINGTRAIN_NETWORK": "10.254.254.0/24"}, [CLI, "doctor"])
    one_line(done, 2, "RINGTRAIN_NETWORK=10.254.254.0/24 matches no interface")
    assert done.stderr.count("\n") == 1, done.stderr


def test_layout_pins_a_distinct_core_per_node_cycling_and_checks_its_values():
    from ringtrain.errors import UserError

    laid = cluster_layout.plan(3, cores=[0, 1])
    assert [n.cores for n in laid.nodes] == [(0,), (1,), (0,)]
    assert [n.address for n in laid.nodes] == ["10.77.0.11", "10.77.0.12", "10.77.0.13"]
    assert cluster_layout.plan(2, link="1gbit", cores=[0, 1]).link_bits == 10**9
    for bad in (
        dict(nodes=0),
        dict(nodes=2, link="fast"),
        dict(nodes=2, subnet="10.77.0.0/30"),
        dict(nodes=2, cpus_per_node=3),
    ):
        with pytest.raises(UserError):
            cluster_layout.plan(cores=[0, 1], **bad)


def test_network_variable_becomes_open_mpi_and_horovod_settings_and_a_rendered_default():
    from ringtrain.errors import UserError
    from ringtrain.launch.network import launcher_environment
    from ringtrain.launch.slurm_render import render

    chosen = launcher_environment({"RINGTRAIN_NETWORK": "127.0.0.0/8"})
    assert chosen["OMPI_MCA_btl_tcp_if_include"] == "127.0.0.0/8"
    assert chosen["OMPI_MCA_oob_tcp_if_include"] == "127.0.0.0/8"
    assert chosen["OMPI_MCA_oob_tcp_keepalive_time"] == "5"
    assert chosen["HOROVOD_GLOO_IFACE"] == "lo"
    mine = {"RINGTRAIN_NETWORK": "127.0.0.0/8", "OMPI_MCA_btl_tcp_if_include": "eth9"}
    assert "OMPI_MCA_btl_tcp_if_include" not in launcher_environment(mine)  # the user's wins
    assert launcher_environment({}) == {}
    with pytest.raises(UserError, match="is not a network"):
        launcher_environment({"RINGTRAIN_NETWORK": "eth0"})
    script = render("data", 2, 1, "10", network=CIDR)
    assert f"export RINGTRAIN_NETWORK=${{RINGTRAIN_NETWORK:-{CIDR}}}\nsource " in script
    with pytest.raises(UserError):
        render("data", 2, 1, "10", network="10.77.0.0/99")
