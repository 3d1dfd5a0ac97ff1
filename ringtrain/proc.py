"""What Linux's /proc says about processes: memory, threads and sessions.

Each reader answers with an empty value where /proc is missing (another OS), so a caller that
only records the figure never fails on it.
"""

from __future__ import annotations

import os
from pathlib import Path


def resident_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (VmRSS) or its peak (VmHWM), from /proc (0 elsewhere)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def thread_ids() -> set[int]:
    """The ids of this process's threads (none found elsewhere)."""
    return (
        {int(t) for t in os.listdir("/proc/self/task")}
        if os.path.isdir("/proc/self/task")
        else set()
    )


def processes() -> dict[int, tuple[int, float]]:
    """pid -> (session id, CPU seconds used) for every process (nothing found elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[int, tuple[int, float]] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended while we looked
            continue
        found[int(entry.name)] = (int(fields[3]), (int(fields[11]) + int(fields[12])) / tick)
    return found


def parent_pid(pid: int) -> int | None:
    """The parent of `pid`, None when it has ended."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
