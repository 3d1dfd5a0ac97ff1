"""What keeps a job from hanging or losing work: verdicts every rank agrees on (stop signals, a
non-finite loss, a bad input only some ranks see), and a watchdog that aborts when no step
finishes in time.

No launcher notices a rank that stops without dying (SIGSTOP, a deadlock, a stuck filesystem):
the others block inside a collective forever, where Horovod's stall check cannot run. A thread
in every rank watches step progress and calls MPI_Abort, which MPI_THREAD_MULTIPLE permits.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import numpy as np
from numpy.typing import ArrayLike

from ringtrain.errors import EXIT_SILENT_PEER, EXIT_WATCHDOG, NonFiniteError, UserError, report

T = TypeVar("T")
_VERDICT_BYTES = 1024  # one rank's exit code and message in the failure agreement


def end_job(code: int) -> None:
    """MPI_Abort with `code`. If the runtime stalls in the abort (seen with Open MPI 4.1 when
    several ranks abort at once), the process exits anyway after a few seconds, and the launcher
    ends the job on that non-zero exit."""
    fallback = threading.Timer(5.0, os._exit, args=(code,))
    fallback.daemon = True
    fallback.start()
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)


def abort_job(message: str, rank: int, code: int, prog: str = "ringtrain train") -> None:
    """One line naming the problem, then the end of the whole job."""
    report(prog, message, rank)
    end_job(code)


def _mpi(name: str):
    from mpi4py import MPI

    return getattr(MPI, name)


_signalled: list[int] = []  # the stop signals this process received, kept across runs


def _handle(signum, frame) -> None:
    _signalled.append(signum)


def catch_stop_signals() -> None:
    """From now on SIGTERM and SIGUSR1 are remembered (stop_requested) instead of ending the
    process."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _handle)


def stop_requested() -> int:
    """The first stop signal caught, or 0: a sweep starts no more trials after one."""
    return _signalled[0] if _signalled else 0


class StopSignal:
    """SIGTERM or SIGUSR1 ask for a checkpoint and a clean stop at the next step boundary; a
    signal that came while no run was training (a sweep between trials) still counts."""

    def __init__(self):
        catch_stop_signals()

    @property
    def requested(self) -> int:
        return stop_requested()

    def agree(self, comm, wait, loss: float) -> tuple[bool, bool]:
        """(stop, loss is finite), the same on every rank, from one Iallreduce per step.

        Stop is true if any rank was signalled. The loss is judged by rank 0, which holds the
        job's loss under every strategy (pipeline stages before the last never see it).
        """
        diverged = comm.Get_rank() == 0 and not math.isfinite(loss)
        flags = np.array([1 if self.requested else 0, 1 if diverged else 0], np.int32)
        anyone = np.zeros(2, np.int32)
        wait(comm.Iallreduce(flags, anyone, op=_mpi("MAX")), None, "the stop agreement")
        return bool(anyone[0]), not anyone[1]


def finite_on_every_rank(comm, arrays: Iterable[ArrayLike]) -> bool:
    """Whether every rank's arrays are free of NaN and infinity (a collective); each is made
    an array as it is checked."""
    mine = all(bool(np.isfinite(a).all()) for a in arrays)
    flag = np.array([1 if mine else 0], np.int32)
    comm.Allreduce(_mpi("IN_PLACE"), flag, op=_mpi("MIN"))
    return bool(flag[0])


def non_finite(what: str, step: int, rank: int, newest: int | None) -> NonFiniteError:
    """The error every rank raises when training diverged; rank 0 says it. `newest` is the
    newest checkpoint's step: None when the run writes none, 0 when none is written yet."""
    kept = ""
    if newest is not None:
        kept = "; no checkpoint was written for it"
        kept += f" (the newest is from step {newest})" if newest else ""
    message = f"{what} at step {step}{kept}; try a lower --lr or --clip-norm"
    return NonFiniteError(message).on_every_rank(rank)


def agree(comm, wait, attempt: Callable[[], T]) -> T:
    """Run `attempt` on every rank and share the outcome, so no rank waits for one that failed.

    When any rank raises a UserError, every rank raises: if all failed alike, rank 0 speaks for
    the job; otherwise each failing rank says its own line and the others stop quietly with the
    first failing rank's exit code. No pickle: each verdict is a fixed-size byte row.
    """
    value, problem = None, None
    try:
        value = attempt()
    except UserError as exc:
        problem = exc
    mine = np.zeros(_VERDICT_BYTES, np.uint8)
    if problem is not None:
        text = f"{problem.exit_code:03d}{problem}".encode()[: _VERDICT_BYTES - 1]
        mine[: len(text)] = np.frombuffer(text, np.uint8)
    rows = np.empty(_VERDICT_BYTES * comm.Get_size(), np.uint8)
    wait(comm.Iallgather(mine, rows), None, "the other ranks' checks")
    verdicts = [row.tobytes().rstrip(b"\0") for row in rows.reshape(-1, _VERDICT_BYTES)]
    failed = [v for v in verdicts if v]
    if not failed:
        return value
    if problem is None:
        quiet = UserError("another rank failed and said why")
        quiet.exit_code, quiet.together, quiet.said_elsewhere = int(failed[0][:3]), True, True
        raise quiet
    if len(failed) == len(verdicts) and len(set(failed)) == 1:
        raise problem.on_every_rank(comm.Get_rank())
    problem.together = True
    raise problem


class Watchdog:
    """Aborts the whole job when no step boundary is reached within `timeout` seconds.

    Start-up (building the model, broadcasting its first state, restoring a checkpoint) has
    `startup` seconds instead, up to the first kick: its transfers are whole models, and on a
    slow link they hold back the heartbeat's beats too, so silence proves nothing yet.
    """

    def __init__(self, timeout: float, rank: int, what: str = "start-up", startup: float = 0.0):
        self.timeout, self.rank, self.extra = timeout, rank, 0.0
        self.last, self.what, self.active = time.monotonic(), what, True
        self.startup = startup
        threading.Thread(target=self._watch, daemon=True, name="ringtrain-watchdog").start()

    def kick(self, what: str) -> None:
        self.last, self.what, self.startup = time.monotonic(), what, 0.0

    def settle(self, what: str) -> None:
        """Kick, then end the first step's patience (heartbeat.settle), in that order: the watch
        reads patience before the clock, so it never sees patience ended against an old kick."""
        from ringtrain import heartbeat

        self.kick(what)
        heartbeat.settle()

    def allow(self, extra: float) -> None:
        """Seconds a step may take beyond `timeout` to move its bytes (the deadline rule)."""
        self.extra = extra

    def stop(self) -> None:
        self.active = False

    def _watch(self) -> None:
        from ringtrain.deadline import waited
        from ringtrain.heartbeat import blame, patient  # the side channel knows who is silent

        patient_at = None  # the kick whose deadline patience last stretched
        while self.active:
            time.sleep(min(1.0, self.timeout / 4))
            # Patience first: settle() kicks before it ends patience (see there).
            patient_now = patient(None)
            quiet = time.monotonic() - self.last
            if not self.active or quiet <= max(self.timeout + self.extra, self.startup):
                continue
            if patient_now:
                patient_at = self.last
                continue
            how_long = waited(self.timeout, self.extra)
            named = blame(how_long, self.what)
            if named:
                abort_job(named, self.rank, EXIT_SILENT_PEER)
            if patient_at == self.last or self.startup:
                how_long = f"{quiet:.0f} s (within --startup-timeout)"
            abort_job(
                f"no progress for {how_long} during {self.what}: "
                "a rank stopped answering; aborting the job",
                self.rank,
                EXIT_WATCHDOG,
            )
