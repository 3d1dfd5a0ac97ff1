"""Keeps a rank's transfers moving while it computes.

Open MPI's TCP transport sends a message above its eager limit in fragments, and it moves the
next fragment only while some thread of that process is inside an MPI call. A pipeline stage
posts its send, then computes for tens of milliseconds, so across nodes the bytes sat in its
buffers until the receiver waited for them, and every stage's wait grew by the transfer. A
thread that makes a cheap MPI call every `period` seconds during a step (MPI is started with
MULTIPLE thread support) drives those fragments while the main thread is inside TensorFlow,
which holds no Python lock there. Between steps it sleeps, so an idle rank spends nothing.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager, nullcontext

from ringtrain.errors import UserError

TAG = 7  # never sent on the ticker's own communicator: its probes match nothing


class Ticker:
    """`with ticker:` around work whose transfers should progress during it."""

    def __init__(self, comm, period: float = 0.0005):
        from mpi4py import MPI

        self.comm, self.period, self.any_source = comm.Dup(), period, MPI.ANY_SOURCE
        self.running = threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True, name="ringtrain-progress")
        self.thread.start()

    def __enter__(self) -> Ticker:
        self.running.set()
        return self

    def __exit__(self, *_exc) -> None:
        self.running.clear()

    def _tick(self) -> None:
        while self.running.wait():
            self.comm.Iprobe(self.any_source, TAG)  # any MPI call runs the progress engine
            time.sleep(self.period)


def spans_hosts(comm) -> bool:
    """Whether some rank of `comm` shares no memory with this one (collective on `comm`)."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return comm.allreduce(local.Get_size(), op=MPI.MIN) < comm.Get_size()
    finally:
        local.Free()


def progress_ticker(comm, mode: str) -> AbstractContextManager:
    """`--mpi-progress`: a Ticker for `thread`, and for `auto` when `comm` spans hosts (on one
    host shared memory needs none, and the thread would take a little of each step's core);
    otherwise a context that does nothing. Collective on `comm`."""
    from mpi4py import MPI

    wanted = mode == "thread" or (mode == "auto" and comm.Get_size() > 1 and spans_hosts(comm))
    if wanted and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise UserError("--mpi-progress thread needs MPI started with MULTIPLE thread support")
    return Ticker(comm) if wanted else nullcontext()
