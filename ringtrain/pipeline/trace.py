"""Per-rank timing of every executed action, merged on rank 0 into bubble, Chrome trace, Gantt.

Timestamps are wall-clock (time.time) so ranks on one node, or NTP-synced nodes, line up.
Each action's time is split three ways: **wait** (blocked on a message or a neighbour: a
receive's data not yet there, sends still out at REDUCE, the replicas' allreduce), **fixed**
cost (what the action costs whatever the microbatch's size: for F and B their time on a
1-example microbatch, measured at start-up; for messages and REDUCE, all their own work), and
**compute**, the rest.
"""

from __future__ import annotations

import json
import time
from statistics import median

import numpy as np

from ringtrain.pipeline.ir import COMPUTE, Op

# Every action's code (schedule IR), and ALLREDUCE: the replica average inside a REDUCE.
OPS = (*(op.code for op in Op), "ALLREDUCE")
# The columns of a gathered trace; a rank records all but the last.
STEP, OP, MB, START, END, STAGE, FIXED, WAIT, RANK = range(9)
RECORDED = RANK
ALL = float("inf")  # a fixed cost of everything not waited: a message's or REDUCE's own work
COMPUTE_CODES = {op.code for op in COMPUTE}
RECEIVE_CODES = {op.code for op in Op if op.is_recv}


class Trace:
    """Rows of (step, op, microbatch, start, end, stage, fixed, wait) recorded on one rank."""

    def __init__(self):
        self.rows: list[tuple] = []

    def record(
        self,
        step: int,
        op: str,
        mb: int | None,
        start: float,
        stage: int = -1,
        fixed: float = 0.0,
        wait: float = 0.0,
    ) -> None:
        """`mb` is None for per-stage actions (REDUCE, STEP, ALLREDUCE), stored as -1; so is
        the stage of what belongs to no one stage. `wait` and `fixed` seconds are capped at
        the action's time; compute is what they leave."""
        end = time.time()
        wait = min(wait, end - start)
        fixed = min(fixed, end - start - wait)
        row = (step, OPS.index(op), -1 if mb is None else mb, start, end, stage, fixed, wait)
        self.rows.append(row)

    def gather(self, comm, since: int = 0) -> np.ndarray | None:
        """All ranks' rows from step `since` on, on rank 0 as an (N, 7) array with the rank
        appended; None elsewhere."""
        kept = [row for row in self.rows if row[0] >= since] if since else self.rows
        mine = np.array(kept, dtype=np.float64).reshape(-1, RECORDED)
        counts = _gather_counts(comm, len(mine))
        if comm.Get_rank() != 0:
            comm.Gatherv(mine, None, root=0)
            return None
        merged = np.empty((int(counts.sum()), RECORDED), dtype=np.float64)
        comm.Gatherv(mine, (merged, counts * RECORDED), root=0)
        ranks = np.repeat(np.arange(len(counts)), counts)
        return np.column_stack([merged, ranks])


def _gather_counts(comm, n: int) -> np.ndarray:
    counts = np.zeros(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([n], dtype=np.int64), counts)
    return counts


def measured_bubble(rows: np.ndarray, pp_size: int, skip_first: bool = True) -> float:
    """Median over steps of 1 - (busy compute summed over stages) / (P x wall time of the step).

    Rows of every replica are pooled per step (rank // pp_size is the dp_rank), each replica's
    bubble is computed separately, then the median is taken.
    """
    values = []
    for step in _steps(rows, skip_first):
        at_step = rows[rows[:, STEP] == step]
        for dp_rank in {int(r) // pp_size for r in at_step[:, RANK]}:
            compute = computations(at_step[at_step[:, RANK] // pp_size == dp_rank])
            wall = compute[:, END].max() - compute[:, START].min()
            busy = float(np.sum(compute[:, END] - compute[:, START]))
            values.append(1.0 - busy / (pp_size * wall))
    return float(median(values))


def measured_step_seconds(rows: np.ndarray, skip_first: bool = True) -> float:
    """Median over steps of the wall time from the step's first computation to its last action,
    the span the simulator's makespan covers. Not from its first action: a downstream rank
    posts its first receive while upstream still finishes the last step, and that wait would
    count the two steps' overlap twice."""
    spans = []
    for step in _steps(rows, skip_first):
        at_step = rows[rows[:, STEP] == step]
        spans.append(at_step[:, END].max() - computations(at_step)[:, START].min())
    return float(median(spans))


def computations(rows: np.ndarray) -> np.ndarray:
    """The rows of F, B, BI and BW."""
    return rows[np.isin(rows[:, OP], [OPS.index(op.code) for op in COMPUTE])]


def _steps(rows: np.ndarray, skip_first: bool) -> list[int]:
    """The steps in the rows, without the first (it traced the functions) if asked and if
    there are others."""
    steps = sorted({int(s) for s in rows[:, STEP]})
    return steps[1:] if skip_first and len(steps) > 1 else steps


def timeline(rows: np.ndarray, pp_size: int, step: int, dp_rank: int = 0) -> list[list]:
    """(label, start, end, fixed seconds) per pipeline rank for one step of one replica: each
    computation labelled like the schedule's actions ("1F3"), and each receive's wait
    ("wait"). What draw_gantt takes."""
    lanes: list[list] = [[] for _ in range(pp_size)]
    for row in rows[rows[:, STEP] == step]:
        rank, code = int(row[RANK]), OPS[int(row[OP])]
        if rank // pp_size != dp_rank:
            continue
        if code in COMPUTE_CODES:
            label = f"{int(row[STAGE])}{code}{int(row[MB])}"
            lanes[rank % pp_size].append((label, row[START], row[END], row[FIXED]))
        elif row[WAIT] > 0 and code in RECEIVE_CODES:
            lanes[rank % pp_size].append(("wait", row[START], row[START] + row[WAIT], 0.0))
    return lanes


def split_ms(row: np.ndarray) -> dict[str, float]:
    """An action's milliseconds of compute, fixed cost and wait."""
    spent = row[END] - row[START]
    return {
        "compute_ms": 1e3 * (spent - row[FIXED] - row[WAIT]),
        "fixed_ms": 1e3 * row[FIXED],
        "wait_ms": 1e3 * row[WAIT],
    }


def action_costs(rows: np.ndarray, steps: list[int]) -> dict[str, dict[str, dict[str, float]]]:
    """Per stage (-1: a replica's allreduce) and kind of action (F, B, RA, ...), the median
    milliseconds of compute, fixed cost and wait per action over the given steps: where a
    stage's time per microbatch goes, action by action."""
    chosen = rows[np.isin(rows[:, STEP], steps)]
    costs: dict[str, dict[str, dict[str, float]]] = {}
    kinds = zip(chosen[:, STAGE].astype(int), chosen[:, OP].astype(int), strict=True)
    for stage, op in dict.fromkeys(kinds):
        mine = chosen[(chosen[:, STAGE] == stage) & (chosen[:, OP] == op)]
        splits = [split_ms(row) for row in mine]
        costs.setdefault(str(stage), {})[OPS[op]] = {
            key: float(median(s[key] for s in splits)) for key in splits[0]
        }
    return costs


def write_chrome_trace(rows: np.ndarray, pp_size: int, path: str) -> None:
    """chrome://tracing / Perfetto format: one process per replica, one thread per stage;
    each action's compute, fixed cost and wait in its arguments."""
    t0 = rows[:, START].min()
    events = [
        {
            "name": f"{_stage(row[STAGE])}{OPS[int(row[OP])]}{_microbatch(row[MB])}",
            "ph": "X",
            "cat": "step",
            "ts": (row[START] - t0) * 1e6,
            "dur": (row[END] - row[START]) * 1e6,
            "pid": int(row[RANK]) // pp_size,
            "tid": int(row[RANK]) % pp_size,
            "args": {"step": int(row[STEP]), "rank": int(row[RANK])} | split_ms(row),
        }
        for row in rows
    ]
    with open(path, "w") as out:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, out)


def _stage(stage: float) -> str:
    return "" if stage < 0 else str(int(stage))


def _microbatch(mb: float) -> str:
    return str(int(mb)) if mb >= 0 else ""
