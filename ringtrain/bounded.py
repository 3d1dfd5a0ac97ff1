"""Child processes that cannot outlive their deadline: each leads its own session, so it and
everything it starts (mpirun's ranks) can be ended together."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Collection
from contextlib import suppress
from pathlib import Path

from ringtrain.proc import processes


class RunFailed(Exception):
    """A child failed or missed its deadline; the message says which and why."""


def start_session(cmd: list[str], env: dict[str, str], **popen) -> subprocess.Popen:
    """A child that leads its own session, so it and everything it starts can be ended."""
    return subprocess.Popen(cmd, env=env, start_new_session=True, **popen)


def end_session(process: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM (mpirun passes it to its ranks), then SIGKILL whatever of the session is left."""
    if process.poll() is None:
        with suppress(ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=grace)
    for pid, (sid, _) in processes().items():
        if sid == process.pid:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    process.wait()


def last_words(log: Path) -> str:
    """The last line a failed process wrote that is not TensorFlow's start-up chatter."""
    noise = ("WARNING: All log messages", "I0000 ", "To enable the following")
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()]
    except OSError:
        return "no output"
    said = [ln for ln in lines if ln and not ln.startswith(noise)]
    if said and _is_rule(said[-1]):  # Open MPI ends with a banner: its headline says what failed
        rules = [i for i, ln in enumerate(said) if _is_rule(ln)]
        opening = rules[-2] if len(rules) > 1 else -1
        return said[opening + 1][:300]
    return said[-1][:300] if said else "no output"


def _is_rule(line: str) -> bool:
    return set(line) <= {"-", "="}


def run_bounded(
    cmd: list[str],
    env: dict[str, str],
    timeout: float,
    log: Path,
    quiet: bool = False,
    expected: Collection[int] = (0,),
) -> int:
    """Run to completion within timeout seconds, stderr (and, if quiet, stdout) to log, and
    return the exit code; RunFailed, naming the command and its last words, where it is not
    one of `expected` or the command does not finish."""
    name = Path(cmd[0]).name
    with open(log, "w") as err:
        process = start_session(cmd, env, stderr=err, **({"stdout": err} if quiet else {}))
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_session(process)
            raise RunFailed(f"{name} did not finish within {timeout:.0f} s") from None
        except BaseException:
            end_session(process)
            raise
    if code not in expected:
        raise RunFailed(f"{name} exited {code}: {last_words(log)}")
    return code
