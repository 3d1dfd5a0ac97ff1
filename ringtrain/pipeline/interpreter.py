"""One event loop over per-rank action lists, shared by lowering, validation and simulation.

Time jumps from event to event. At each instant messages move first (a send or receive that can
complete does), then every idle rank whose next action is not a message starts it and is busy
for `cost(action)`. With `blocking` sends a SEND and its RECV complete together, as a
rendezvous (MPI Ssend); otherwise a SEND never waits (MPI Isend) and its tensor reaches the
receiver `transfer(send, leaves)` after it leaves. There a message's own `cost` is the host's
work around it (posting, copying out), before the bytes leave and after they arrive, and the
link from one rank to another carries one message at a time: a send posted while an earlier one
is still on that wire starts after it (each direction on its own, as links are full duplex).
Without that, GPipe's eight activations posted back to back would all arrive as soon as one.

A *witness* run walks compute orders that have no messages yet: when a rank's next compute
lacks a tensor that another rank has already made, and that rank is between actions, the pair
SEND/RECV is recorded on both ranks at that instant. The recorded lists are then one
execution in which every send met its receive, so they cannot deadlock under blocking sends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ringtrain.pipeline.ir import Action, Op, Tensor, carries, consumes, produces

EPS = 1e-9  # times are sums of float costs: two ranks "at the same instant" may differ by ulps

Cost = Callable[[Action], float]
Transfer = Callable[[Action, float], float]  # (the send, when its bytes leave) -> seconds


class Stuck(Exception):
    """No rank can move; `waiting` holds (rank, index, action) of every unfinished rank."""

    def __init__(self, waiting: list[tuple[int, int, Action]]):
        super().__init__(", ".join(f"rank {r} at {a}" for r, _, a in waiting))
        self.waiting = waiting

    def line(self, problem: str) -> str:
        """One line naming the first stuck action and what every other rank waits at."""
        (r, i, a), *others = self.waiting
        waits = "".join(f"; rank {q} waits at action {j} ({b})" for q, j, b in others)
        return f"rank {r} action {i} ({a}): {problem}{waits}"


@dataclass
class Run:
    """What each rank did, in order (a witness run adds the messages), with (start, end)."""

    actions: list[list[Action]]
    times: list[list[tuple[float, float]]]


def interpret(
    stage_ranks: Sequence[int],
    lists: Sequence[Sequence[Action]],
    cost: Cost,
    *,
    blocking: bool,
    transfer: Transfer | None = None,
    witness: bool = False,
) -> Run:
    """Run every rank's list to the end; raise Stuck if the ranks wait on each other."""
    return _Loop(stage_ranks, lists, cost, blocking, transfer, witness).run()


_OTHER, _SEND, _RECV = 0, 1, 2


class _Loop:
    def __init__(self, stage_ranks, lists, cost, blocking, transfer, witness):
        self.stage_ranks, self.lists, self.cost = stage_ranks, lists, cost
        self.blocking, self.witness = blocking, witness
        self.transfer = transfer or (lambda a, leaves: 0.0)
        self.n_stages, pp_size = len(stage_ranks), len(lists)
        self.plans = [[self._plan(a) for a in row] for row in lists]
        self.pc, self.clock = [0] * pp_size, [0.0] * pp_size
        self.out: list[list[Action]] = [[] for _ in range(pp_size)]
        self.times: list[list[tuple[float, float]]] = [[] for _ in range(pp_size)]
        self.made: dict[Tensor, float] = {}  # witness: tensor -> when its compute ended
        self.received: set[Tensor] = set()  # witness: tensors delivered to their consumer
        self.arrives: dict[Tensor, float] = {}  # buffered sends: tensor -> arrival time
        self.wire_free: dict[tuple[int, int], float] = {}  # (from, to) rank -> when it is idle
        self.done: set[Action] = set()
        self.t = 0.0

    def _plan(self, a: Action) -> tuple[int, Tensor | None, int, Action | None]:
        """(kind of step, the tensor it moves or needs, the peer rank, the peer's matching
        receive), worked out once per action rather than at every instant."""
        if a.op.is_message:
            tensor = carries(a)
            if a.op.is_send:
                return _SEND, tensor, self.stage_ranks[tensor.consumer], tensor.recv_action()
            return _RECV, tensor, self.stage_ranks[tensor.stage], None
        need = consumes(a, self.n_stages) if self.witness else None
        return _OTHER, need, -1 if need is None else self.stage_ranks[need.stage], None

    def run(self) -> Run:
        ranks = range(len(self.lists))
        while True:
            free = [r for r in ranks if self.pc[r] < len(self.lists[r]) and self._free(r)]
            again = True
            while again:  # messages first, then computations, until nothing moves at this instant
                again = False
                for r in free:
                    while self._message(r):
                        again = True
                for r in free:  # a computation that takes time enables nothing at this instant
                    again |= self._compute(r) and self._free(r)
            later = [c for c in self.clock if c > self.t + EPS]
            if not later:
                break
            self.t = min(later)
        waiting = [(r, self.pc[r], self.lists[r][self.pc[r]]) for r in ranks if self._left(r)]
        if waiting:
            raise Stuck(waiting)
        return Run(self.out, self.times)

    def _left(self, r: int) -> bool:
        return self.pc[r] < len(self.lists[r])

    def _free(self, r: int) -> bool:
        """Between actions at the current instant (a finished rank is always free)."""
        return self.clock[r] <= self.t + EPS

    def _record(self, r: int, a: Action, end: float) -> None:
        self.out[r].append(a)
        self.times[r].append((self.t, end))
        self.clock[r] = end

    def _message(self, r: int) -> bool:
        """Move one message at rank r if it can move now; say whether it did."""
        pc = self.pc[r]
        if pc >= len(self.lists[r]) or self.clock[r] > self.t + EPS:
            return False
        kind, tensor, peer, recv = self.plans[r][pc]
        if self.witness:
            return self._witness_message(r, tensor, peer)
        if kind == _OTHER:
            return False
        a = self.lists[r][self.pc[r]]
        if kind == _RECV:
            if self.blocking or tensor not in self.arrives:
                return False  # a blocking receive completes from its sender's side
            self._record(r, a, max(self.t, self.arrives.pop(tensor)) + self.cost(a))
            self.pc[r] += 1
            return True
        if not self.blocking:  # the sender's own work, then the bytes on the wire, in turn
            posted = self.t + self.cost(a)
            leaves = max(posted, self.wire_free.get((r, peer), 0.0))
            self.arrives[tensor] = self.wire_free[(r, peer)] = leaves + self.transfer(a, leaves)
            self._record(r, a, posted)
            self.pc[r] += 1
            return True
        if not (self._left(peer) and self._free(peer)) or self.lists[peer][self.pc[peer]] != recv:
            return False
        end = self.t + self.transfer(a, self.t)
        for rank, action in ((r, a), (peer, recv)):
            self._record(rank, action, end)
            self.pc[rank] += 1
        return True

    def _witness_message(self, r: int, need: Tensor | None, maker: int) -> bool:
        """Fetch the tensor rank r's next compute lacks, if its maker is free and has made it."""
        if need is None or maker == r or need in self.received:
            return False
        if self.made.get(need, float("inf")) > self.t + EPS or not self._free(maker):
            return False
        end = self.t + self.transfer(need.send_action(), self.t)
        self._record(maker, need.send_action(), end)
        self._record(r, need.recv_action(), end)
        self.received.add(need)
        return True

    def _compute(self, r: int) -> bool:
        """Start rank r's next non-message action if it is free (and, in a witness run, fed)."""
        pc = self.pc[r]
        if pc >= len(self.lists[r]) or self.clock[r] > self.t + EPS:
            return False
        kind, need, maker, _ = self.plans[r][pc]
        a = self.lists[r][pc]
        if kind != _OTHER or (self.witness and not self._fed(r, a, need, maker)):
            return False
        end = self.t + self.cost(a)
        if self.witness:
            made = produces(a, self.n_stages)
            if made is not None:
                self.made[made] = end
            self.done.add(a)
        self._record(r, a, end)
        self.pc[r] += 1
        return True

    def _fed(self, r: int, a: Action, need: Tensor | None, maker: int) -> bool:
        """Witness run: a compute waits for its input tensor and its own earlier halves."""
        if need is not None and need not in (self.made if maker == r else self.received):
            return False
        if a.op.makes_input_grad and Action(a.stage, Op.F, a.mb) not in self.done:
            return False
        return not (a.op is Op.BW and Action(a.stage, Op.BI, a.mb) not in self.done)
