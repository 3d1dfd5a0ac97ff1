"""Naming a rank that the node's memory limit killed.

The kernel ends a process that takes its cgroup over the limit with SIGKILL, which no handler
sees: the rank cannot say why it went, and its peers only see it gone. So a rank that runs
under a memory cgroup tighter than the machine forks before MPI and TensorFlow load. The child
is the rank; the parent (Python without MPI or TensorFlow: about 45 MiB VmHWM, most of it
shared) waits for it, passes on the signals a launcher or scheduler sends, and exits as the
child did. When the child dies of SIGKILL that nobody sent through the parent, and the cgroup's
OOM record has grown meanwhile, the parent says so in one line before the launcher tears the
job down.

Ranks sharing a node share its record, and a launcher tearing the job down may SIGKILL their
process groups: each kill in the record is claimed once, by a file made exclusively, and the
rank it killed died first, so its parent is first to claim it.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

from ringtrain.errors import report
from ringtrain.memory_limit import MIB, MOUNT, cgroup_limit, oom_kills, own_memory_group

PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
SUPERVISED = "RINGTRAIN_RANK_SUPERVISED"  # set in the child: never a supervisor twice


def machine_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def killed_line(rank: int, host: str, limit: int) -> str:
    return f"rank {rank} on {host} was killed by the node's memory limit ({limit // MIB} MiB)"


def group_oom_kills(group: Path, version: str) -> int:
    """OOM kills recorded by the group and every group above it (whichever limit was hit)."""
    top = MOUNT / "memory" if version == "v1" else MOUNT
    return sum(oom_kills(f) for f in [group, *group.parents] if f.is_relative_to(top))


def supervise_rank(rank: int, prog: str) -> None:
    """Returns in the rank (at once, where no memory cgroup caps it below the machine's
    memory); in the supervising parent, never returns."""
    group = own_memory_group()
    limit = cgroup_limit(*group) if group else None
    if group is None or limit is None or limit >= machine_bytes() or os.environ.get(SUPERVISED):
        return
    before = group_oom_kills(*group)
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[SUPERVISED] = "1"
    child = os.fork()
    if child == 0:
        return
    sent: list[int] = []

    def pass_on(signum: int, _frame) -> None:
        sent.append(signum)
        os.kill(child, signum)

    for signum in PASSED_ON:
        signal.signal(signum, pass_on)
    _, status = os.waitpid(child, 0)  # retried after each passed-on signal (PEP 475)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        kills = group_oom_kills(*group)
        if signum == signal.SIGKILL and not sent and kills > before and _claimed(group[0], kills):
            report(prog, killed_line(rank, socket.gethostname(), limit), rank)
        os._exit(128 + signum)
    os._exit(os.WEXITSTATUS(status))


def _claimed(group: Path, kill: int) -> bool:
    """Whether this rank is first to claim the group's `kill`-th OOM kill. A group made anew
    under the same path (a node brought up again) counts from zero: its inode and creation
    time tell it from the old one, whose claims are left behind."""
    made = os.stat(group)
    identity = f"{group} {made.st_ino} {made.st_ctime_ns}"
    key = hashlib.sha1(identity.encode()).hexdigest()[:16]  # alike in every process
    try:
        claim = Path(tempfile.gettempdir()) / f"ringtrain-oom-{key}-{kill}"
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    return True
