"""A side channel that knows which peer went silent when a collective cannot say.

A rank blocked inside a Horovod allreduce (or any collective) only sees that nothing finishes;
it cannot tell which of its peers is missing. Every rank therefore sends a one-byte beat to
every other rank a few times per `--comm-timeout`, on its own duplicate of COMM_WORLD, from a
background thread (MPI_THREAD_MULTIPLE), and records when it last heard from each. When the
watchdog fires it asks `suspect()`: the peer silent the longest, with its host, which every
rank gathered once at start-up as fixed-size byte rows (no pickle).

The launcher may end the job first (Open MPI's keepalive gives up on an unreachable node's
daemon after about 11 s): it sends SIGTERM before SIGKILL. Python runs signal handlers only in
the main thread, which is blocked in the collective, so the heartbeat thread watches the
signal wakeup fd instead and, if a peer has gone quiet, names it before the process ends.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import threading
import time

import numpy as np

from ringtrain.errors import report

HOST_BYTES = 64  # one rank's hostname in the start-up gather
TAG = 1  # the only tag on the heartbeat's own communicator

current: Heartbeat | None = None  # the running heartbeat of this process, for error lines


def gather_hosts(comm) -> list[str]:
    """Every rank's hostname, by rank (one Allgather of byte rows)."""
    mine = np.zeros(HOST_BYTES, np.uint8)
    name = socket.gethostname().encode()[:HOST_BYTES]
    mine[: len(name)] = np.frombuffer(name, np.uint8)
    rows = np.empty(HOST_BYTES * comm.Get_size(), np.uint8)
    comm.Allgather(mine, rows)
    return [r.tobytes().rstrip(b"\0").decode() for r in rows.reshape(-1, HOST_BYTES)]


class Heartbeat:
    """Beats to and from every peer; `suspect()` names who has been silent longest."""

    def __init__(self, comm, timeout: float, startup_timeout: float = 0.0):
        self.comm = comm.Dup()  # beats never match a message of the training's communicators
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.hosts = gather_hosts(self.comm)
        self.timeout, self.interval = timeout, min(1.0, timeout / 8)
        self.peers = [r for r in range(self.size) if r != self.rank]
        now = time.monotonic()
        self.heard = dict.fromkeys(self.peers, now)
        self.lost: set[int] = set()  # peers whose connection was torn down
        self.patient_until = now + startup_timeout  # see patient()
        self.active = True
        self.signals = _signal_pipe()
        self.thread = threading.Thread(target=self._beat, daemon=True, name="ringtrain-heartbeat")
        self.thread.start()
        atexit.register(self.stop)  # runs before mpi4py's MPI_Finalize (registered earlier)

    def describe(self, rank: int) -> str:
        return f"rank {rank} on {self.hosts[rank]}"

    def suspect(self) -> tuple[int, float] | None:
        """(rank, seconds since last heard) of the peer silent longest, if any is overdue."""
        if not self.peers:
            return None
        rank = min(self.peers, key=lambda p: self.heard[p])
        return (rank, self.quiet(rank)) if self.overdue(rank) else None

    def quiet(self, rank: int) -> float:
        return time.monotonic() - self.heard[rank]

    def overdue(self, rank: int) -> bool:
        return self.quiet(rank) > 2 * self.interval + 0.5

    def stop(self) -> None:
        if self.active:
            self.active = False
            self.thread.join(timeout=5)

    def _beat(self) -> None:
        """Beat until stopped. An MPI error on one peer's requests (its connection torn down)
        ends the beats with that peer only (and the first step's patience with it): the silence
        it leaves is what `suspect()` reports, while the live peers keep hearing this rank.
        Stopping them all made a live rank on the dead one's partner node look as silent as the
        dead one, and sometimes the longest."""
        from mpi4py import MPI

        beat = np.ones(1, np.uint8)
        inbox = {p: np.zeros(1, np.uint8) for p in self.peers}
        receiving: dict[int, object] = {}
        sending: dict[int, object] = {}
        due = 0.0
        while self.active:
            beating = time.monotonic() >= due
            for p in self.peers:
                if p in self.lost:
                    continue
                try:
                    self._exchange(p, beat, inbox[p], sending, receiving, beating)
                except MPI.Exception:
                    self.lost.add(p)
            if beating:
                due = time.monotonic() + self.interval
            time.sleep(self.interval / 4)
            self._on_termination()
        for p in receiving.keys() - self.lost:
            try:
                receiving[p].Cancel()
                receiving[p].Wait()
            except MPI.Exception:  # torn down meanwhile: nothing left to cancel
                pass

    def _exchange(self, p: int, beat, box, sending: dict, receiving: dict, beating: bool) -> None:
        """One peer: a beat if one is due (never queued behind one that has not left yet), and
        every beat that has arrived from it."""
        if p not in receiving:
            receiving[p] = self.comm.Irecv(box, p, TAG)
        if beating and (p not in sending or sending[p].Test()):
            sending[p] = self.comm.Isend(beat, p, TAG)
        while receiving[p].Test():
            self.heard[p] = time.monotonic()
            receiving[p] = self.comm.Irecv(box, p, TAG)

    def _on_termination(self) -> None:
        """On SIGTERM (the launcher ending the job, or a scheduler's stop request), say which
        peer went quiet, if one did; a stop request among live peers stays silent here."""
        if self.signals is None:
            return
        try:
            received = os.read(self.signals, 64)
        except BlockingIOError:
            return
        found = self.suspect()
        if signal.SIGTERM in received and found:
            rank, quiet = found
            message = (
                f"{self.describe(rank)} unreachable: nothing heard from it for {quiet:.0f} s; "
                "the launcher is ending the job"
            )
            report("ringtrain train", message, self.rank)


def _signal_pipe() -> int | None:
    """The read end of a pipe Python's C-level signal handler writes each signal number to
    (only for signals with a Python handler, such as the stop signals); None off the main
    thread or when something else already owns the wakeup fd."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    try:
        theirs = signal.set_wakeup_fd(write)
        if theirs == -1:
            return read
        signal.set_wakeup_fd(theirs)
    except ValueError:
        pass
    os.close(read)
    os.close(write)
    return None


def start(comm, timeout: float, startup_timeout: float = 0.0) -> Heartbeat:
    """Gather the hosts (a collective) and start beating; the result is also `current`."""
    global current
    if current is not None:  # a second train() in the same process
        current.stop()
    current = Heartbeat(comm, timeout, startup_timeout)
    return current


def patient(world_rank: int | None) -> bool:
    """Whether a deadline that passed should be waited past: during start-up and the first
    step (graph tracing and compiling, slow on a loaded node), silence proves nothing, so only
    --startup-timeout bounds the wait, unless the peer's connection is gone (every peer, for
    None). A starved core holds a live peer's beats back for many seconds, and on a slow link
    they queue behind the step's own bytes: both ranks of a capped pair went 16 s without a
    beat in one CI run, in a first step that then would have finished."""
    if current is None or time.monotonic() > current.patient_until:
        return False
    peers = current.peers if world_rank is None else [world_rank]
    return current.lost.isdisjoint(peers)


def settle() -> None:
    """The first step is done: from now on --comm-timeout alone decides."""
    if current is not None:
        current.patient_until = 0.0


def blame(waited: str, what: str) -> str | None:
    """The line naming the silent peer, e.g. `rank 1 on node2 unreachable: no progress for
    20 s during step 5, nothing heard from it for 21 s`, or None when every peer is heard."""
    if current is None:
        return None
    found = current.suspect()
    if found is None:
        return None
    rank, quiet = found
    return (
        f"{current.describe(rank)} unreachable: no progress for {waited} during {what}, "
        f"nothing heard from it for {quiet:.0f} s"
    )
