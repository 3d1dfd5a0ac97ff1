"""Per-rank timing of every executed action, merged on rank 0 into bubble, Chrome trace, Gantt.

Timestamps are wall-clock (time.time) so ranks on one node, or NTP-synced nodes, line up.
"""

from __future__ import annotations

import json
import time
from statistics import median

import numpy as np

COMPUTE = ("F", "B", "BI", "BW")
# Every action's code (schedule IR), and ALLREDUCE: the replica average inside a REDUCE.
OPS = ("F", "B", "BI", "BW", "SA", "RA", "SG", "RG", "REDUCE", "STEP", "ALLREDUCE")


class Trace:
    """Rows of (step, op, microbatch, start, end) recorded on one rank."""

    def __init__(self):
        self.rows: list[tuple[int, int, int, float, float]] = []

    def record(self, step: int, op: str, mb: int | None, start: float) -> None:
        """`mb` is None for per-stage actions (REDUCE, STEP, ALLREDUCE), stored as -1."""
        self.rows.append((step, OPS.index(op), -1 if mb is None else mb, start, time.time()))

    def gather(self, comm, since: int = 0) -> np.ndarray | None:
        """All ranks' rows from step `since` on, on rank 0 as an (N, 6) array with the rank
        appended; None elsewhere."""
        kept = [row for row in self.rows if row[0] >= since] if since else self.rows
        mine = np.array(kept, dtype=np.float64).reshape(-1, 5)
        counts = _gather_counts(comm, len(mine))
        if comm.Get_rank() != 0:
            comm.Gatherv(mine, None, root=0)
            return None
        merged = np.empty((int(counts.sum()), 5), dtype=np.float64)
        comm.Gatherv(mine, (merged, counts * 5), root=0)
        ranks = np.repeat(np.arange(len(counts)), counts)
        return np.column_stack([merged, ranks])


def _gather_counts(comm, n: int) -> np.ndarray:
    counts = np.zeros(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([n], dtype=np.int64), counts)
    return counts


def measured_bubble(rows: np.ndarray, stages: int, skip_first: bool = True) -> float:
    """Median over steps of 1 - (busy compute summed over stages) / (P x wall time of the step).

    Rows of every replica are pooled per step (rank // stages is the replica), each replica's
    bubble is computed separately, then the median is taken.
    """
    values = []
    steps = sorted({int(s) for s in rows[:, 0]})
    for step in steps[1:] if skip_first and len(steps) > 1 else steps:
        at_step = rows[rows[:, 0] == step]
        for replica in {int(r) // stages for r in at_step[:, 5]}:
            part = at_step[at_step[:, 5] // stages == replica]
            compute = part[np.isin(part[:, 1], [OPS.index(op) for op in COMPUTE])]
            wall = compute[:, 4].max() - compute[:, 3].min()
            busy = float(np.sum(compute[:, 4] - compute[:, 3]))
            values.append(1.0 - busy / (stages * wall))
    return float(median(values))


def timeline(rows: np.ndarray, stages: int, step: int, replica: int = 0) -> list[list]:
    """(label, start, end) per stage for one step of one replica: what draw_gantt takes."""
    lanes: list[list] = [[] for _ in range(stages)]
    for _step, op, mb, start, end, rank in rows[rows[:, 0] == step]:
        if int(rank) // stages == replica and OPS[int(op)] in COMPUTE:
            lanes[int(rank) % stages].append((f"{OPS[int(op)]}{int(mb)}", start, end))
    return lanes


def write_chrome_trace(rows: np.ndarray, stages: int, path: str) -> None:
    """chrome://tracing / Perfetto format: one process per replica, one thread per stage."""
    t0 = rows[:, 3].min()
    events = [
        {
            "name": f"{OPS[int(op)]}{int(mb) if int(mb) >= 0 else ''}",
            "ph": "X",
            "cat": "step",
            "ts": (start - t0) * 1e6,
            "dur": (end - start) * 1e6,
            "pid": int(rank) // stages,
            "tid": int(rank) % stages,
            "args": {"step": int(step), "rank": int(rank)},
        }
        for step, op, mb, start, end, rank in rows
    ]
    with open(path, "w") as out:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, out)
