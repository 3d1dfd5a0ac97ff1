"""How much memory a rank may hold, as the machine it runs on says: the memory cgroup it runs
in (a Slurm node with ConstrainRAMSpace, a container, a rehearsal node of `ringtrain cluster up
--mem-per-node`), else Slurm's job limit. The kernel kills a process whose cgroup goes over its
limit, so `train` and `plan` read the limit the same way, here, to refuse a configuration
before the kill rather than after it.

A cgroup's limit covers every process in it, so the ranks sharing a node (the launcher's local
size) share it. Slurm gives SLURM_MEM_PER_NODE (MiB for each node's tasks) or
SLURM_MEM_PER_CPU (MiB per CPU, times SLURM_CPUS_PER_TASK).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MOUNT = Path("/sys/fs/cgroup")
LIMIT_FILE = {"v1": "memory.limit_in_bytes", "v2": "memory.max"}
# cgroup v1 writes "no limit" as the largest page-aligned count (2**63 less a page); v2 "max"
NO_LIMIT = 2**62
MIB = 2**20
SOURCES = ("--memory-per-rank", "cgroup", "Slurm")  # what may say a rank's limit


@dataclass(frozen=True)
class Limit:
    """Bytes a rank may hold, and what said so."""

    bytes: int
    source: str  # one of SOURCES


def memory_group(proc_cgroup: str, mount: Path = MOUNT) -> tuple[Path, str] | None:
    """The folder of the memory cgroup that `proc_cgroup` (a /proc/PID/cgroup text) names, and
    its version, "v1" or "v2"; None where no memory controller is mounted for it."""
    lines = proc_cgroup.splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = mount / "memory" / path.lstrip("/")
            if (folder / "cgroup.procs").exists():
                return folder, "v1"
    unified = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
    if unified is not None:
        folder = mount / unified.lstrip("/")
        if (folder / "cgroup.procs").exists():
            return folder, "v2"
    return None


def own_memory_group() -> tuple[Path, str] | None:
    """This process's memory cgroup folder and version (see memory_group)."""
    try:
        return memory_group(Path("/proc/self/cgroup").read_text())
    except OSError:  # not Linux
        return None


def cgroup_limit(group: Path, version: str, mount: Path = MOUNT) -> int | None:
    """The tightest limit on `group` and the groups above it (a group's memory counts against
    every ancestor's limit too), in bytes; None when none of them has one."""
    top = mount / "memory" if version == "v1" else mount
    found = []
    for folder in [group, *group.parents]:
        if not folder.is_relative_to(top):
            break
        try:
            text = (folder / LIMIT_FILE[version]).read_text().strip()
        except OSError:  # the root group has no limit file
            continue
        if text.isdigit() and int(text) < NO_LIMIT:
            found.append(int(text))
    return min(found, default=None)


def slurm_limit(env: Mapping[str, str], local_size: int) -> int | None:
    """A task's share of Slurm's memory for the job on this node, in bytes; None outside a
    job that asked for memory."""
    per_node = env.get("SLURM_MEM_PER_NODE", "")
    if per_node.isdigit() and int(per_node):
        return int(per_node) * MIB // local_size
    per_cpu = env.get("SLURM_MEM_PER_CPU", "")
    cpus = env.get("SLURM_CPUS_PER_TASK", "1")
    if per_cpu.isdigit() and int(per_cpu) and cpus.isdigit():
        return int(per_cpu) * MIB * max(int(cpus), 1)
    return None


def rank_limit(
    given: int | None, local_size: int, env: Mapping[str, str] | None = None
) -> Limit | None:
    """A rank's limit: `given` (--memory-per-rank), else its share of its memory cgroup's
    limit among the `local_size` ranks on its node, else of Slurm's; None when nothing
    limits it."""
    if given is not None:
        return Limit(given, "--memory-per-rank")
    group = own_memory_group()
    limit = cgroup_limit(*group) if group else None
    if limit is not None:
        return Limit(limit // local_size, "cgroup")
    limit = slurm_limit(os.environ if env is None else env, local_size)
    return Limit(limit, "Slurm") if limit is not None else None


def oom_kills(group: Path) -> int:
    """How many processes the kernel has killed for going over the group's limit (v1's
    memory.oom_control and v2's memory.events both carry an `oom_kill N` line)."""
    for name in ("memory.oom_control", "memory.events"):
        try:
            text = (group / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return 0
