"""Predict a schedule's makespan, bubble and memory before running it on a cluster.

Sends are buffered here (like MPI Isend): a SEND never waits, a RECV waits for its SEND.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ringtrain.pipeline.schedule import Action, Schedule, build_schedule

Cost = Callable[[int, Action], float]


def unit_cost(stage: int, action: Action) -> float:
    """F = B = 1 and free communication: the textbook model behind (P-1)/(M+P-1)."""
    return 1.0 if action.is_compute else 0.0


@dataclass
class SimResult:
    makespan: float
    bubble: float  # idle fraction of all stage-time: 1 - sum(busy) / (P * makespan)
    busy: list[float]  # compute time per stage
    peak_inflight: list[int]  # max (#F done - #B done) per stage: activations held at once
    timeline: list[list[tuple[str, float, float]]]  # per stage (label, start, end), compute only


def simulate(schedule: Schedule, cost: Cost | None = None) -> SimResult:
    """Replay every stage's list in time; a comm action's cost is time spent on its stage."""
    cost = cost or unit_cost
    P, acts = schedule.stages, schedule.actions
    clock, pc = [0.0] * P, [0] * P
    busy, inflight, peak = [0.0] * P, [0] * P, [0] * P
    timeline: list[list[tuple[str, float, float]]] = [[] for _ in range(P)]
    sent: dict[tuple[int, int, Action], float] = {}  # (from, to, matching RECV) -> send time
    progress = True
    while progress:
        progress = False
        for s in range(P):
            while pc[s] < len(acts[s]):
                a = acts[s][pc[s]]
                start = clock[s]
                if a.op.startswith("RECV"):
                    src = s - 1 if a.op == "RECV_ACT" else s + 1
                    if (src, s, a) not in sent:
                        break
                    start = max(start, sent.pop((src, s, a)))
                clock[s] = start + cost(s, a)
                if a.op.startswith("SEND"):
                    dst = s + 1 if a.op == "SEND_ACT" else s - 1
                    sent[(s, dst, Action(a.op.replace("SEND", "RECV"), a.mb))] = clock[s]
                if a.is_compute:
                    busy[s] += clock[s] - start
                    timeline[s].append((str(a), start, clock[s]))
                    inflight[s] += 1 if a.op == "F" else -1
                    peak[s] = max(peak[s], inflight[s])
                pc[s] += 1
                progress = True
    stuck = [f"stage {s} at {acts[s][pc[s]]}" for s in range(P) if pc[s] < len(acts[s])]
    if stuck:
        raise ValueError(f"receive without a send: {', '.join(stuck)}")
    makespan = max(clock)
    bubble = 1.0 - sum(busy) / (P * makespan) if makespan > 0 else 0.0
    return SimResult(makespan, bubble, busy, peak, timeline)


def predicted_bubble(kind: str, stages: int, microbatches: int) -> float:
    """Unit-cost bubble of a generated schedule: (P-1)/(M+P-1) for GPipe and 1F1B."""
    return simulate(build_schedule(kind, stages, microbatches)).bubble
