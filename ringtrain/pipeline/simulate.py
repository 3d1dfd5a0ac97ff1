"""Predict a schedule's makespan, bubble and activation memory before running it.

Unit costs, the textbook model: each rank's share of the model costs F = B = 1, so a rank
holding V stages spends 1/V on each stage's F or B; a split backward costs BI = BW = B/2;
messages, REDUCE and STEP are free. Under them GPipe's and 1F1B's bubble is (P-1)/(M+P-1).
Measured figures replace them: `cost` gives seconds per action (a message's is the host's work
around it), `link` a wire per direction between two ranks that says how long a message of n
bytes leaving at time t takes (a wire can keep state, such as a token bucket), and
`boundary_bytes[s]` the bytes of stage s's output (its gradient is as big). Sends are buffered
like MPI Isend: the sender never waits, the receiver waits for arrival. The bubble is over the
span of the computations, as the executor's trace measures it; the makespan holds every action.

Activation memory: a microbatch's activations on a stage count as held from its F until its B
ends or, split, until its BW ends. The weight-gradient half still reads the stage's input and
the output gradient, so ringtrain's executor frees nothing at BI.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ringtrain.pipeline.interpreter import Cost, Stuck, interpret
from ringtrain.pipeline.ir import Action, Op, Schedule, carries

_UNIT = {Op.F: 1.0, Op.B: 1.0, Op.BI: 0.5, Op.BW: 0.5}  # of a rank's share of the model


class Wire(Protocol):
    def carry(self, nbytes: float, leaves: float) -> float: ...


class Link(Protocol):
    def wire(self) -> Wire: ...


def unit_cost(stage_ranks: Sequence[int]) -> Cost:
    """F = B = 1 per rank's share of the model (1/V per stage), BI = BW = B/2, the rest free."""
    per_rank = Counter(stage_ranks)

    def cost(a: Action) -> float:
        return _UNIT.get(a.op, 0.0) / per_rank[stage_ranks[a.stage]]

    return cost


@dataclass
class SimResult:
    makespan: float
    bubble: float  # idle fraction: 1 - sum(busy) / (pp_size * span of the computations)
    busy: list[float]  # computing time per pipeline rank (F, B, BI, BW)
    peak_inflight: list[int]  # per stage: most microbatches between F and B (or BW) at once
    timeline: list[list[tuple[str, float, float]]]  # per rank (action, start, end), computations


def simulate(
    schedule: Schedule,
    cost: Cost | None = None,
    link: Link | None = None,
    boundary_bytes: Sequence[int] | None = None,
) -> SimResult:
    """Replay every rank's list in time with buffered sends; unit costs unless told otherwise."""
    cost = cost or unit_cost(schedule.stage_ranks)
    stage_ranks, wires = schedule.stage_ranks, {}

    def transfer(send: Action, leaves: float) -> float:
        if link is None:
            return 0.0
        tensor = carries(send)
        path = (stage_ranks[tensor.stage], stage_ranks[tensor.consumer])
        if path not in wires:
            wires[path] = link.wire()
        wire = wires[path]
        boundary = min(tensor.stage, tensor.consumer)
        return wire.carry(boundary_bytes[boundary] if boundary_bytes else 0, leaves)

    try:
        run = interpret(
            schedule.stage_ranks, schedule.actions, cost, blocking=False, transfer=transfer
        )
    except Stuck as stuck:
        raise ValueError(f"receive without a send: {stuck}") from None
    timeline = [
        [(str(a), s, e) for a, (s, e) in zip(row, times, strict=True) if a.op.is_compute]
        for row, times in zip(run.actions, run.times, strict=True)
    ]
    busy = [sum(end - start for _, start, end in row) for row in timeline]
    makespan = max((end for times in run.times for _, end in times), default=0.0)
    boxes = [box for row in timeline for box in row]
    span = max((b[2] for b in boxes), default=0.0) - min((b[1] for b in boxes), default=0.0)
    bubble = 1.0 - sum(busy) / (schedule.pp_size * span) if span > 0 else 0.0
    return SimResult(makespan, bubble, busy, _peak_inflight(schedule), timeline)


def _peak_inflight(schedule: Schedule) -> list[int]:
    held, peak = [0] * schedule.n_stages, [0] * schedule.n_stages
    for row in schedule.actions:
        for a in row:
            if a.op is Op.F:
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.op.ends_microbatch:
                held[a.stage] -= 1
    return peak
