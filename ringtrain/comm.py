"""Point-to-point messages with deadlines, on contiguous numpy buffers (no pickle).

MPI receives have no timeout, so every wait polls a non-blocking request against a deadline;
a peer that stays silent past it (the deadline rule, see deadline.py) aborts the whole job with
a line naming that peer and its host.
"""

from __future__ import annotations

import json
import time
from typing import NamedTuple

import numpy as np

from ringtrain.deadline import DEFAULT_MIN_LINK_RATE, transfer_time, waited
from ringtrain.errors import EXIT_SILENT_PEER
from ringtrain.guard import abort_job

# The longest sleep between two polls of a wait: each waited message arrives up to this late.
LONGEST_PAUSE = 0.0002  # at 1 ms, a 2-stage 1F1B idled 1-3 points more (measured A/B)


def world_rank(comm, peer: int) -> int:
    from mpi4py import MPI

    return comm.Get_group().Translate_ranks([peer], MPI.COMM_WORLD.Get_group())[0]


def host_of(comm, peer: int) -> str | None:
    """The host of `peer` (a rank of `comm`), from the table the heartbeat gathered at start."""
    from ringtrain import heartbeat

    if heartbeat.current is None:
        return None
    return heartbeat.current.hosts[world_rank(comm, peer)]


class PostedReceive(NamedTuple):
    """An Irecv already under way into `buf`; `Link.complete` waits for it."""

    request: object
    buf: np.ndarray
    source: int
    what: str


class Link:
    """Sends and receives for one rank on one communicator; `name(peer)` says who a peer is."""

    def __init__(
        self,
        comm,
        timeout: float,
        sync_sends: bool = False,
        name=lambda r: f"rank {r}",
        min_rate: float = DEFAULT_MIN_LINK_RATE,
    ):
        self.comm, self.timeout, self.sync_sends, self.name = comm, timeout, sync_sends, name
        self.min_rate = min_rate
        self.pending: list[tuple[object, np.ndarray, int, str]] = []

    def send_buffer(self, buf: np.ndarray, dest: int, tag: int, what: str) -> None:
        """Isend by default (completed at flush); Issend, waited at once, with sync_sends."""
        if self.sync_sends:
            self.wait(self.comm.Issend(buf, dest, tag), dest, f"{what} to be received", buf.nbytes)
        else:
            self.pending.append((self.comm.Isend(buf, dest, tag), buf, dest, what))

    def recv_buffer(self, buf: np.ndarray, source: int, tag: int, what: str) -> np.ndarray:
        return self.complete(self.post_receive(buf, source, tag, what))

    def post_receive(self, buf: np.ndarray, source: int, tag: int, what: str) -> PostedReceive:
        """Irecv now, `complete` when the data is needed: the transfer overlaps the work between,
        and an early sender's message lands in `buf` rather than in MPI's own buffers."""
        return PostedReceive(self.comm.Irecv(buf, source, tag), buf, source, what)

    def complete(self, posted: PostedReceive) -> np.ndarray:
        """Wait for a posted receive under the usual deadline, which starts now."""
        self.wait(posted.request, posted.source, posted.what, posted.buf.nbytes)
        return posted.buf

    def send_named(self, arrays: dict[str, np.ndarray], dest: int, tag: int, what: str) -> None:
        """Named float32 tensors as three buffers (header length, JSON header of names and
        shapes, every value in one flat array), so no pickle carries them; sent by flush."""
        header = json.dumps([[k, list(a.shape)] for k, a in arrays.items()]).encode()
        values = [np.ravel(a) for a in arrays.values()]
        flat = np.concatenate(values).astype(np.float32) if values else np.empty(0, np.float32)
        for buf in (np.array([len(header)], np.int64), np.frombuffer(header, np.uint8), flat):
            self.send_buffer(np.ascontiguousarray(buf), dest, tag, what)

    def recv_named(self, source: int, tag: int, what: str) -> dict[str, np.ndarray]:
        """What send_named sent, in its order."""
        size = self.recv_buffer(np.empty(1, np.int64), source, tag, what)
        header = self.recv_buffer(np.empty(int(size[0]), np.uint8), source, tag, what)
        names = json.loads(header.tobytes())
        flat = self.recv_buffer(
            np.empty(sum(int(np.prod(s)) for _, s in names), np.float32), source, tag, what
        )
        arrays, offset = {}, 0
        for name, shape in names:
            n = int(np.prod(shape))
            arrays[name] = flat[offset : offset + n].reshape(shape)
            offset += n
        return arrays

    def flush(self) -> None:
        """Complete every outstanding send; their buffers may be reused afterwards."""
        for request, buf, dest, what in self.pending:
            self.wait(request, dest, f"{what} to be received", buf.nbytes)
        self.pending.clear()

    def wait(self, request, peer: int | None, what: str, nbytes: int = 0) -> None:
        """Poll until done; past the deadline abort the job, naming the peer (if one is known)."""
        extra = transfer_time(nbytes, self.min_rate)
        deadline = time.monotonic() + self.timeout + extra
        pause = 0.0
        while not request.Test():
            if time.monotonic() > deadline and not self._patient(peer):
                self.abort(self._silence(peer, what, waited(self.timeout, extra)))
            if pause:
                time.sleep(pause)
            pause = min(LONGEST_PAUSE, pause * 2 or 0.00002)  # a waiting rank frees its core

    def _patient(self, peer: int | None) -> bool:
        from ringtrain.heartbeat import patient

        return patient(None if peer is None else world_rank(self.comm, peer))

    def _silence(self, peer: int | None, what: str, allowed: str) -> str:
        if peer is None:  # a collective: the heartbeat may know who is missing
            from ringtrain.heartbeat import blame

            named = blame(allowed, what)
            return named or f"a rank went silent: no progress for {allowed} during {what}"
        host = host_of(self.comm, peer)
        where = f"; it runs on {host}" if host else ""
        return (
            f"{self.name(peer)} went silent: no progress for {allowed} "
            f"while waiting for {what}{where}"
        )

    def abort(self, message: str) -> None:
        from mpi4py import MPI

        abort_job(message, MPI.COMM_WORLD.Get_rank(), EXIT_SILENT_PEER)
