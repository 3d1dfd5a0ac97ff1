"""A memory cap per rehearsal node: one memory cgroup per node, as a Slurm node with
ConstrainRAMSpace gives each job, so a process that outgrows its node is killed by the kernel.

The node groups live in one folder, GROUPS, made below the memory cgroup `up` runs in (so the
cluster stays under whatever limit its caller has). A node's sshd and slurmd are started by a
shell that first moves itself into the node's group, so they, and every session, job step and
rank they start, are born inside it. cgroup v1 caps `memory.limit_in_bytes`, v2 `memory.max`;
swap is capped at zero as well, so going over the cap is a kill, not a slowdown.
"""

from __future__ import annotations

import time
from pathlib import Path

from ringtrain.cluster.system import end_processes
from ringtrain.errors import UserError
from ringtrain.memory_limit import LIMIT_FILE, MIB, oom_kills, own_memory_group

GROUPS = "ringtrain-cluster"
# (limit, swap limit, usage) in each version's names.
_V1 = (LIMIT_FILE["v1"], "memory.memsw.limit_in_bytes", "memory.usage_in_bytes")
_V2 = (LIMIT_FILE["v2"], "memory.swap.max", "memory.current")


def memory_parent(needed_by: str) -> tuple[Path, str]:
    """The folder of this process's memory cgroup, where child groups go (so they stay under
    whatever limit the caller has), and its version, "v1" or "v2". A host without a memory
    controller that this process may make groups under is a one-line UserError naming what
    needs one (`needed_by`)."""
    found = own_memory_group()
    if found is not None:  # v2 makes memory.max in children only where the group delegates it
        parent, version = found
        if version == "v1" or "memory" in _read(parent / "cgroup.subtree_control").split():
            return found
    raise UserError(
        f"{needed_by} needs a memory cgroup controller (cgroup v1's memory, or v2 with "
        "memory delegated to this process's group); this host has none"
    )


def groups_folder() -> Path:
    """Where the node groups go: GROUPS below this process's memory cgroup."""
    return memory_parent("--mem-per-node")[0] / GROUPS


def set_limit(group: Path, limit: int) -> None:
    """Cap a group's memory at `limit` bytes, in its version's name."""
    (group / _names(group)[0]).write_text(str(limit))


def create(groups: list[Path], limit: int) -> None:
    """Each node's group (all in one folder) with `limit` bytes of memory and none of swap.
    Groups left by an earlier cluster are removed first, so every `up` starts alike."""
    folder = groups[0].parent
    remove(folder)
    folder.mkdir()
    control = folder / "cgroup.subtree_control"
    if control.exists():  # v2: the nodes get memory.max only once the folder hands it on
        control.write_text("+memory")
    for group in groups:
        group.mkdir()
        set_limit(group, limit)
        names = _names(group)
        swap = group / names[1]
        if swap.exists():  # present when the kernel accounts swap; v1 counts memory + swap
            swap.write_text(str(limit) if names is _V1 else "0")


def join(group: Path) -> list[str]:
    """The command prefix that runs a program inside `group`: a shell that moves itself in,
    then becomes the program, so everything the program starts is born there."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group)]


def remove(folder: Path) -> list[str]:
    """Remove the node groups and their folder, ending any process still inside; their
    names. A group's last processes may still be exiting, so rmdir is retried."""
    if not folder.is_dir():
        return []
    groups = sorted(p for p in folder.iterdir() if p.is_dir())
    for group in [*groups, folder]:
        end_processes(int(pid) for pid in _read(group / "cgroup.procs").split())
        for _ in range(50):
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
    return [p.name for p in groups]


def describe(group: Path, limit: int) -> str:
    """A node's cap, its use now and its OOM kills, for `cluster status`."""
    used = _read(group / _names(group)[2]).strip()
    in_use = f"{int(used) // MIB} MiB used" if used.isdigit() else "group MISSING"
    return f"memory cap {limit // MIB} MiB ({in_use}, {oom_kills(group)} OOM kills)"


def _names(group: Path) -> tuple[str, str, str]:
    return _V2 if (group / _V2[0]).exists() else _V1


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
