"""The root-only operations a cluster is built from: commands, processes and /etc/hosts."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from ringtrain.errors import ProblemsFound, UserError

ETC_HOSTS = Path("/etc/hosts")
SBIN_PATH = "/usr/sbin:/sbin"  # ip, tc and the daemons live here; a user's PATH may lack it


class ClusterError(ProblemsFound):
    """The system refused a step of `up` (or `down`); the message names the command (exit 1)."""


def require_root(command: str) -> None:
    if os.geteuid() != 0:
        raise UserError(
            f"`ringtrain cluster {command}` needs root: it creates network namespaces, veths "
            "and /etc/hosts lines (run it with sudo, or as root in a container)"
        )


def tool_path() -> str:
    return f"{SBIN_PATH}:{os.environ.get('PATH', '')}"


def require_tools(names: Iterable[str], package_hint: str) -> None:
    missing = [name for name in names if shutil.which(name, path=tool_path()) is None]
    if missing:
        raise UserError(f"missing {', '.join(missing)}: {package_hint}")


def run(argv: Sequence[str], *, check: bool = True, timeout: float = 30, **kwargs):
    """Run one system command; a failure raises ClusterError quoting its stderr."""
    env = {**os.environ, "PATH": tool_path(), **kwargs.pop("env", {})}
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, env=env, **kwargs
        )
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`{' '.join(argv)}` did not finish in {timeout} s") from None
    if check and done.returncode != 0:
        detail = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise ClusterError(
            f"`{' '.join(argv)}` exited {done.returncode}: {detail[-1] if detail else ''}"
        )
    return done


def netns_pids(netns: str) -> list[int]:
    """Every process in a network namespace (none when it is gone)."""
    return [int(p) for p in run(["ip", "netns", "pids", netns], check=False).stdout.split()]


def alive(pid: int) -> bool:
    """Running, and not a zombie (a daemon's parent may not reap it at once)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def end_processes(pids: Iterable[int], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever is still there after `grace` seconds."""
    pids = [p for p in set(pids) if p != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def pid_from_file(path: Path, must_mention: str) -> int | None:
    """The PID a daemon wrote, if that process still runs and its command line mentions
    `must_mention` (a reused PID must not be killed)."""
    try:
        pid = int(path.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError, IndexError):
        return None
    return pid if must_mention in cmdline else None


def pids_with_environment(entry: str) -> list[int]:
    """Processes whose environment holds `entry` exactly (e.g. a cluster's SLURM_CONF)."""
    marker = entry.encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append(int(proc.name))
    return found


def add_host_lines(lines: Sequence[str], marker: str) -> None:
    """Append `lines` to /etc/hosts, each ending with `marker`. In place: in a container
    /etc/hosts is a bind mount, which a rename over it would fail on."""
    text = ETC_HOSTS.read_text()
    added = "".join(f"{line} {marker}\n" for line in lines)
    with open(ETC_HOSTS, "r+") as hosts:
        hosts.seek(0)
        hosts.write(text if text.endswith("\n") or not text else text + "\n")
        hosts.write(added)
        hosts.truncate()


def remove_host_lines(marker: str) -> int:
    """Remove exactly the /etc/hosts lines ending with `marker`, in place; how many went."""
    lines = ETC_HOSTS.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.rstrip("\n").endswith(marker)]
    if len(kept) != len(lines):
        with open(ETC_HOSTS, "r+") as hosts:
            hosts.write("".join(kept))
            hosts.truncate()
    return len(lines) - len(kept)


def host_lines(marker: str) -> list[str]:
    return [line for line in ETC_HOSTS.read_text().splitlines() if line.endswith(marker)]
