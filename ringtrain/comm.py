"""Point-to-point messages with deadlines, on contiguous numpy buffers (no pickle).

MPI receives have no timeout, so every wait polls a non-blocking request against a deadline;
a peer that stays silent past it aborts the whole job with a line naming that peer.
"""

from __future__ import annotations

import time

import numpy as np

from ringtrain.guard import abort_job


class Link:
    """Sends and receives for one rank on one communicator; `name(peer)` says who a peer is."""

    def __init__(self, comm, timeout: float, sync_sends: bool = False, name=lambda r: f"rank {r}"):
        self.comm, self.timeout, self.sync_sends, self.name = comm, timeout, sync_sends, name
        self.pending: list[tuple[object, np.ndarray, int, str]] = []

    def send_buffer(self, buf: np.ndarray, dest: int, tag: int, what: str) -> None:
        """Isend by default (completed at flush); Issend, waited at once, with sync_sends."""
        if self.sync_sends:
            self.wait(self.comm.Issend(buf, dest, tag), dest, f"{what} to be received")
        else:
            self.pending.append((self.comm.Isend(buf, dest, tag), buf, dest, what))

    def recv_buffer(self, buf: np.ndarray, source: int, tag: int, what: str) -> np.ndarray:
        self.wait(self.comm.Irecv(buf, source, tag), source, what)
        return buf

    def flush(self) -> None:
        """Complete every outstanding send; their buffers may be reused afterwards."""
        for request, _buf, dest, what in self.pending:
            self.wait(request, dest, f"{what} to be received")
        self.pending.clear()

    def wait(self, request, peer: int | None, what: str) -> None:
        """Poll until done; past the deadline abort the job, naming the peer (if one is known)."""
        who = self.name(peer) if peer is not None else "a rank"
        deadline = time.monotonic() + self.timeout
        pause = 0.0
        while not request.Test():
            if time.monotonic() > deadline:
                self.abort(
                    f"{who} went silent: no progress for {self.timeout:g} s "
                    f"while waiting for {what}"
                )
            if pause:
                time.sleep(pause)
            pause = min(0.001, pause * 2 or 0.00002)  # back off so a waiting rank frees its core

    def abort(self, message: str) -> None:
        from mpi4py import MPI

        abort_job(message, MPI.COMM_WORLD.Get_rank(), 3)
