"""What keeps a job from hanging or losing work: stop signals agreed by all ranks, and a
watchdog that aborts when no step finishes in time.

No launcher notices a rank that stops without dying (SIGSTOP, a deadlock, a stuck filesystem):
the others block inside a collective forever, where Horovod's stall check cannot run. A thread
in every rank watches step progress and calls MPI_Abort, which MPI_THREAD_MULTIPLE permits.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np

from ringtrain.errors import report


def abort_job(message: str, rank: int, code: int) -> None:
    """One line naming the problem, then MPI_Abort. If the runtime stalls in the abort (seen
    with Open MPI 4.1 when several ranks abort at once), the process exits anyway after a few
    seconds, and the launcher ends the job on that non-zero exit."""
    report("ringtrain", message, rank)
    fallback = threading.Timer(5.0, os._exit, args=(code,))
    fallback.daemon = True
    fallback.start()
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)


class StopSignal:
    """SIGTERM or SIGUSR1 ask for a checkpoint and a clean stop at the next step boundary."""

    def __init__(self):
        self.requested = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = signum

    def agree(self, comm, wait) -> bool:
        """True on every rank if any rank was signalled: all stop after the same step."""
        flag = np.array([1 if self.requested else 0], np.int32)
        anyone = np.zeros(1, np.int32)
        wait(comm.Iallreduce(flag, anyone, op=_mpi_max()), None, "the stop-signal agreement")
        return bool(anyone[0])


def _mpi_max():
    from mpi4py import MPI

    return MPI.MAX


class Watchdog:
    """Aborts the whole job when no step boundary is reached within `timeout` seconds."""

    def __init__(self, timeout: float, rank: int, what: str = "the first step"):
        self.timeout, self.rank = timeout, rank
        self.last, self.what, self.active = time.monotonic(), what, True
        threading.Thread(target=self._watch, daemon=True, name="ringtrain-watchdog").start()

    def kick(self, what: str) -> None:
        self.last, self.what = time.monotonic(), what

    def stop(self) -> None:
        self.active = False

    def _watch(self) -> None:
        while self.active:
            time.sleep(min(1.0, self.timeout / 4))
            if self.active and time.monotonic() - self.last > self.timeout:
                from mpi4py import MPI

                report(
                    "ringtrain",
                    f"no progress for {self.timeout:g} s during {self.what}: "
                    "a rank stopped answering; aborting the job",
                    self.rank,
                )
                MPI.COMM_WORLD.Abort(4)
