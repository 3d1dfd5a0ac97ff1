"""A real Slurm (Debian's munged, slurmctld and slurmd) under one folder, for tests and
`ringtrain cluster up --slurm`.

The templates in slurm/ are only proven by running them under the scheduler they are written
for: sbatch copies the script, sets the SLURM_* variables, delivers --signal and requeues.
This starts the daemons, gives client commands (sbatch, srun, scontrol) an environment that
points at them, and stops everything it started by PID, even after a failed start.

Two shapes, one harness:
- one node, `localhost` (the test suite's single-node Slurm): CPUs=8 whatever the core count,
  which `SlurmdParameters=config_overrides` allows, so 4-task jobs run on 2 cores;
- several nodes of a rehearsal cluster: one slurmd per node, each started inside its node's
  namespaces (`nsenter --net`, not `ip netns exec`, which remounts /sys and hides
  /sys/fs/cgroup from slurmd), pinned to the node's cores, with the node's real CPU count.
  The controller then runs on the launching host under the name `hostname` prints (any other
  name and slurmctld says "This host not a valid controller"), at its bridge address.

No systemd and no cgroups of Slurm's own: `ProctrackType=proctrack/linuxproc`,
`TaskPlugin=task/none`. A node with a memory cap (`cluster up --mem-per-node`, enforced by the
node's cgroup) declares it as RealMemory, and memory becomes a consumable resource
(CR_Core_Memory), so a job asking for more than a node has is refused at submission. Without a
cap Slurm keeps to CR_Core: with CR_Core_Memory and no RealMemory a node offers Slurm's default
of 1 MB, and every job that asks for memory would be refused.
Every daemon forks into the background itself and writes a PID file.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ringtrain.cluster.system import alive, end_processes, pid_from_file, pids_with_environment

LOCAL_NODE = "localhost"
# Job states after which the job never runs again; COMPLETING is a flag on top of one of these.
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
# Seconds before a requeued job may start again: Slurm 22.05 holds it for the step credential's
# lifetime plus one (AuthInfo cred_expire, default 120, minimum 5), so the slurmd has purged the
# old credential before the new launch. 5 keeps a preemption test's restart to about 6 s.
CRED_EXPIRE = 5
# Seconds a finished job's record stays (up to 10 more: the purge runs every 10 s). No
# accounting runs here, so the record is the only place its state and exit code can be read.
# `sbatch --wait` polls every 2 s while this is below 5 (every 8 s from 5 on, and from 6 on it
# can miss a short job's record altogether), so 4 keeps waits short and records long enough.
MIN_JOB_AGE = 4
# Seconds between the TERM and the KILL of scancel or a time limit: short, so a stuck job ends
# soon, but long enough for the ranks to agree on a step and checkpoint, as they would on a
# real cluster (Slurm's default is 30).
KILL_WAIT = 5


def free_port() -> int:
    """A TCP port nobody listens on now, so concurrent test sessions do not collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


# Slurm writes a TaskProlog's `print ...` lines to the task's own output, on its node.
# The batch script is not a rank: only the tasks of numbered steps announce themselves.
TASK_PROLOG = """#!/bin/sh
case "$SLURM_STEP_ID" in
  [0-9]*) echo "print slurm task $SLURM_PROCID of step $SLURM_STEP_ID on $(hostname)" ;;
esac
"""


@dataclass(frozen=True)
class SlurmNode:
    """One slurmd: its NodeName, NodeAddr, CPUs and RealMemory (MiB, None: not tracked), and
    the command prefix that starts a process on that node (empty: on this host)."""

    name: str
    address: str
    cpus: int
    enter: tuple[str, ...] = ()
    memory_mib: int | None = None


LOCAL = SlurmNode(LOCAL_NODE, "127.0.0.1", 8)


@dataclass(frozen=True)
class JobRecord:
    """What `scontrol show job` said about a job, last and along the way."""

    job_id: int
    state: str  # final, unless the record was purged before the job stopped COMPLETING
    exit_code: int
    signal_number: int  # the signal that ended the batch script, 0 if none
    restarts: int
    states: tuple[str, ...]  # every JobState seen, in order, repeats collapsed
    fields: Mapping[str, str]

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


class SlurmError(RuntimeError):
    """The test cluster did not start, or a job did not reach a final state in time."""


class JobWatch:
    """Follows one job's record from its submission until it is final or purged.

    There is no accounting here: a finished job's record lives only MinJobAge seconds after its
    end time, and a cancelled job's end time is the cancel, before its processes have exited.
    A reader that asks once, after `sbatch --wait` returned, can find nothing; this thread
    asks four times a second from the start and keeps what it saw.
    """

    def __init__(self, cluster: SlurmCluster, tag: str, interval: float = 0.25) -> None:
        self.cluster, self.tag, self.interval = cluster, tag, interval
        self.job_id: int | None = None
        self.last: dict[str, str] | None = None
        self.states: list[str] = []
        self.gone = False
        self.problem = ""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"watch-{tag}")
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                self._poll()
            except (SlurmError, subprocess.TimeoutExpired, OSError) as problem:
                self.problem = str(problem)  # a busy controller: ask again
            if self.gone:
                return
            self._done.wait(self.interval)

    def _poll(self) -> None:
        if self.job_id is None:
            self.job_id = self.cluster.job_with_comment(self.tag)
            if self.job_id is None:
                return
        fields = self.cluster.job_fields(self.job_id)
        if fields is None:
            self.gone = self.last is not None
            return
        self.last = fields
        state = fields.get("JobState", "?")
        if not self.states or self.states[-1] != state:
            self.states.append(state)

    def wait_for_id(self, timeout: float = 30) -> int:
        """The job's id, once Slurm lists it."""
        deadline = time.monotonic() + timeout
        while self.job_id is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.job_id is None:
            raise SlurmError(f"no job with comment {self.tag} after {timeout} s {self.problem}")
        return self.job_id

    def record(self, timeout: float = 60) -> JobRecord:
        """The job's record once it is final and not COMPLETING, or the last one seen if it
        was purged first (then `state` is the last state seen, e.g. COMPLETING)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            last = self.last
            if self.gone or (last and last.get("JobState") in FINAL_STATES):
                break
            time.sleep(0.05)
        else:
            raise SlurmError(f"job {self.job_id} not finished after {timeout} s: {self.states}")
        assert last is not None and self.job_id is not None
        code, _, sig = last.get("ExitCode", "").partition(":")
        return JobRecord(
            self.job_id,
            last.get("JobState", "?"),
            int(code or -1),
            int(sig or 0),
            int(last.get("Restarts", "0")),
            tuple(self.states),
            last,
        )

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=15)


@dataclass(frozen=True)
class Submission:
    """A background `sbatch --wait` (its output in `log`) and the watch on its job."""

    process: subprocess.Popen
    watch: JobWatch
    log: Path


class SlurmCluster:
    """One slurmctld, one slurmd per node and a munged, all under `root`.

    Use it as a context manager, or call start() and stop() yourself; stop() is safe to call
    after a failed or partial start, and from another process (it reads the PID files).
    """

    def __init__(
        self,
        base_env: Mapping[str, str],
        root: Path | None = None,
        nodes: Sequence[SlurmNode] = (LOCAL,),
        controller: tuple[str, str] | None = None,
    ) -> None:
        # A short root: slurmd and PMIx put UNIX sockets under it, and their paths must stay
        # below 108 bytes; pytest's tmp_path is long. /tmp is a+x all the way, as munged wants.
        self.root = Path(root or tempfile.mkdtemp(prefix="rt-slurm-"))
        self.conf = self.root / "etc" / "slurm.conf"
        self.task_prolog = self.root / "etc" / "task_prolog.sh"
        self.nodes = tuple(nodes)
        # (name, address) of the controller; a single local node talks to it over localhost.
        self.controller = controller
        self.ctld_port = free_port()
        self.slurmd_port = free_port()
        while self.slurmd_port == self.ctld_port:
            self.slurmd_port = free_port()
        # Client commands (and the jobs, which inherit sbatch's environment) find this cluster
        # through SLURM_CONF; variables of an enclosing job would confuse sbatch and srun.
        self.env = {
            k: v
            for k, v in base_env.items()
            if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))
        }
        self.env["SLURM_CONF"] = str(self.conf)
        self.pids: dict[str, int] = {}

    # --- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> None:
        """Write the configuration, start the three daemons, and wait until the node is idle."""
        for sub in ("etc", "state", "spool", "log", "run", "munge", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for node in self.nodes:  # %n in slurm.conf: every slurmd has its own
            for sub in ("spool", "tmp"):
                (self.root / sub / node.name).mkdir(exist_ok=True)
        self.root.chmod(0o755)
        (self.root / "munge").chmod(0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.task_prolog.write_text(TASK_PROLOG)
        self.task_prolog.chmod(0o755)
        self.conf.write_text(self.slurm_conf())
        munge = self.root / "munge"
        self._start_daemon(
            "munged",
            [
                "munged",
                f"--socket={munge / 'munge.socket'}",
                f"--key-file={key}",
                f"--log-file={munge / 'munged.log'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
            munge / "munged.pid",
        )
        self._start_daemon(
            "slurmctld", ["slurmctld", "-f", str(self.conf)], self.root / "run" / "slurmctld.pid"
        )
        for node in self.nodes:
            self.start_slurmd(node)
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if len(states) == len(self.nodes) and set(states.values()) == {"idle"}:
                return
            time.sleep(0.2)
        raise SlurmError(f"nodes not idle after {timeout} s (sinfo: {states})\n{self.logs()}")

    def start_slurmd(self, node: SlurmNode) -> None:
        """Also how a node comes back after a power loss: slurmd registers, and with
        ReturnToService=2 a DOWN node returns to service."""
        self._start_daemon(
            f"slurmd-{node.name}",
            [*node.enter, "slurmd", "-f", str(self.conf), "-N", node.name],
            self._slurmd_pid_file(node),
        )

    def slurmd_pid(self, node: SlurmNode) -> int | None:
        return pid_from_file(self._slurmd_pid_file(node), must_mention="slurmd")

    def node_states(self) -> dict[str, str]:
        """Each node's state as `sinfo` abbreviates it (idle, alloc, down*, ...)."""
        sinfo = self.client(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=10)
        pairs = (line.split() for line in sinfo.stdout.splitlines())
        return {pair[0]: pair[1] for pair in pairs if len(pair) == 2}

    def _slurmd_pid_file(self, node: SlurmNode) -> Path:
        return self.root / "run" / f"slurmd-{node.name}.pid"

    def _pid_files(self) -> dict[str, Path]:
        """Every daemon's PID file, slurmds first: the order to stop them in."""
        files = {f"slurmd-{n.name}": self._slurmd_pid_file(n) for n in self.nodes}
        files["slurmctld"] = self.root / "run" / "slurmctld.pid"
        files["munged"] = self.root / "munge" / "munged.pid"
        return files

    def stop(self, timeout: float = 30) -> None:
        """Cancel every job, wait for the queue to drain, then end the daemons by PID.

        Killing slurmd does not end running steps, so the jobs go first; whatever still carries
        this cluster's SLURM_CONF afterwards (a stuck step, a rank) is killed by PID too.
        """
        for name, pid_file in self._pid_files().items():  # started by another process
            pid = pid_from_file(pid_file, must_mention=str(self.root))
            if name not in self.pids and pid is not None:
                self.pids[name] = pid
        # A controller that does not answer: its jobs die with the PID sweep below.
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            if self.pids.get("slurmctld"):
                self._drain(timeout)
        # The slurmds, the controller, then munge; a daemon that ignores TERM gets KILL.
        end_processes([self.pids[n] for n in self._pid_files() if n in self.pids], grace=10)
        # Processes started by this cluster carry its SLURM_CONF (a stuck step, a rank).
        end_processes(pids_with_environment(f"SLURM_CONF={self.conf}"), grace=0)
        self.pids.clear()

    def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not alive(self.pids["slurmctld"]):
                return  # nobody to ask; the PID sweep in stop() ends what is left
            queue = self.client(["squeue", "-h", "-o", "%i"], check=False, timeout=10)
            jobs = queue.stdout.split()
            if queue.returncode == 0 and not jobs:
                return
            if jobs:
                self.client(["scancel", "--full", *jobs], check=False, timeout=10)
            time.sleep(0.5)

    def _start_daemon(self, name: str, argv: list[str], pid_file: Path) -> None:
        """Every daemon forks into the background by itself; its PID comes from its PID file.
        One killed by a signal as it starts is started once more: under load a slurmd healed
        after a fault died of SIGPIPE when munged's socket timed out on it."""
        env = {**self.env, "PATH": f"/usr/sbin:/sbin:{self.env.get('PATH', '')}"}
        for _ in range(2):
            with open(self.root / "log" / f"{name}.start", "w") as out:
                done = subprocess.run(
                    argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, timeout=30
                )
            if done.returncode >= 0:  # it ended by itself: started, or said why not
                break
        if done.returncode != 0:
            raise SlurmError(f"{name} exited {done.returncode}\n{self.logs()}")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            text = pid_file.read_text().strip() if pid_file.exists() else ""
            if text.isdigit():
                self.pids[name] = int(text)
                return
            time.sleep(0.05)
        raise SlurmError(f"{name} wrote no PID file {pid_file}\n{self.logs()}")

    # --- configuration -----------------------------------------------------------------------

    def slurm_conf(self) -> str:
        """The whole slurm.conf.

        - EnforcePartLimits=ALL: an impossible request (more tasks per node than CPUs) fails
          at submission; without it the job pends forever and `sbatch --wait` hangs.
        - MinJobAge below 6: `sbatch --wait` misses a short job's record from 6 on.
        - TaskProlog: every task of a step says where it runs, first thing in the job's
          output (`slurm task R of step S on HOST`), so placement is visible.
        - %n in the slurmd paths and TmpFS: the nodes share the filesystem, and without a
          TmpFS per node PMIx on the second node fails with `Cannot create directory
          "/tmp/spmix_appdir_0_1.0": File exists`.
        """
        t = self.root
        # Jobs of concurrent test sessions must not share /tmp/spmix_appdir_<uid>_<job>.<step>
        # (PMIx puts it under TmpFS) nor Open MPI session names, so job ids start at random.
        first_job_id = 1000 + int.from_bytes(os.urandom(3), "big") % 1_000_000
        if self.controller is None:
            controller = LOCAL_NODE
        else:
            controller = f"{self.controller[0]}({self.controller[1]})"
        node_lines = "\n".join(
            f"NodeName={n.name} NodeAddr={n.address} CPUs={n.cpus}"
            + (f" RealMemory={n.memory_mib}" if n.memory_mib else "")
            + " State=UNKNOWN"
            for n in self.nodes
        )
        capped = sorted(n.memory_mib for n in self.nodes if n.memory_mib)
        consumable = "CR_Core_Memory" if capped else "CR_Core"
        # A job without --mem gets its node's memory, and says so in SLURM_MEM_PER_NODE.
        default_memory = f"DefMemPerNode={capped[0]}\n" if capped else ""
        return f"""\
ClusterName=ringtrain
SlurmctldHost={controller}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={t}/munge/munge.socket,cred_expire={CRED_EXPIRE}
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
StateSaveLocation={t}/state
SlurmdSpoolDir={t}/spool/%n
TmpFS={t}/tmp/%n
SlurmctldPidFile={t}/run/slurmctld.pid
SlurmdPidFile={t}/run/slurmd-%n.pid
SlurmctldLogFile={t}/log/slurmctld.log
SlurmdLogFile={t}/log/slurmd-%n.log
MailProg=/bin/true
MpiDefault=pmix
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters={consumable}
{default_memory}ReturnToService=2
EnforcePartLimits=ALL
SlurmdParameters=config_overrides
FirstJobId={first_job_id}
KillWait={KILL_WAIT}
InactiveLimit=0
MinJobAge={MIN_JOB_AGE}
TaskProlog={self.task_prolog}
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    # --- clients -----------------------------------------------------------------------------

    def client(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 30,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client command (or anything) against this cluster."""
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env={**self.env, **(env or {})},
        )
        if check and done.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def job_fields(self, job_id: int) -> dict[str, str] | None:
        """`scontrol show job` as a dict, or None once the record is gone (MinJobAge)."""
        done = self.client(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if done.returncode != 0:
            if "Invalid job id" in done.stderr:
                return None
            raise SlurmError(f"scontrol show job {job_id}: {done.stderr.strip()}")
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def job_with_comment(self, tag: str) -> int | None:
        """The id of the job submitted with --comment=TAG, if Slurm lists it (finished ones too,
        while their records last)."""
        done = self.client(["squeue", "-h", "--states=all", "-o", "%i %k"], check=False)
        for line in done.stdout.splitlines():
            job_id, _, comment = line.strip().partition(" ")
            if comment == tag:
                return int(job_id)
        return None

    def watch(self, tag: str) -> JobWatch:
        """Start following the job that carries --comment=TAG (submit it next)."""
        return JobWatch(self, tag)

    @contextlib.contextmanager
    def submit(
        self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str] | None = None
    ) -> Iterator[Submission]:
        """`sbatch --wait ARGV` in the background, its job watched from submission on. On the
        way out sbatch is killed if it still runs; the job itself is left to stop()."""
        tag = f"rt-{uuid.uuid4().hex[:12]}"
        watch = self.watch(tag)
        log_path = cwd / f"sbatch-{tag}.log"
        try:
            with open(log_path, "w") as log:
                process = subprocess.Popen(
                    ["sbatch", "--wait", f"--comment={tag}", *argv],
                    cwd=cwd,
                    env={**self.env, **(env or {})},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            try:
                yield Submission(process, watch, log_path)
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=10)
        finally:
            watch.close()

    def sbatch_wait(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        timeout: float = 180,
        env: Mapping[str, str] | None = None,
    ) -> tuple[JobRecord, int]:
        """`sbatch --wait ARGV`: the job's final record and sbatch's exit code. That exit code
        is not the whole story (a job cancelled while pending gives 0), hence the record."""
        with self.submit(argv, cwd=cwd, env=env) as job:
            returncode = job.process.wait(timeout=timeout)
            return job.watch.record(timeout=60), returncode

    def logs(self, tail: int = 40) -> str:
        """The last lines of every daemon log, for a failure message."""
        parts = []
        for log in sorted(self.root.glob("log/*")) + [self.root / "munge" / "munged.log"]:
            if log.exists():
                lines = log.read_text(errors="replace").splitlines()[-tail:]
                parts.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def remove(self) -> None:
        """Delete the cluster's folder (configuration, state, logs)."""
        shutil.rmtree(self.root, ignore_errors=True)
