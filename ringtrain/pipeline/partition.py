"""Split a model's ordered elements into n_stages contiguous stages.

`uniform` balances the element count, `params` the parameter count, and `time` the measured
forward+backward time. The last two are the same min-max problem over a cost per element:
with a stage a rank, the costliest stage sets the pace of every step. Interleaving gives a rank
several stages, and what sets its pace is then the schedule's own, so measured times pick the
split whose simulated step is shortest (`fastest`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from itertools import combinations
from math import comb

from ringtrain.pipeline.ir import COMPUTE, Op, Schedule
from ringtrain.pipeline.simulate import simulate

MOST_SIMULATED = 1000  # splits a simulation search tries; more fall back to `balanced`


def uniform(n_elements: int, n_stages: int) -> list[tuple[int, int]]:
    """Equal counts; earlier stages take the remainder (they also hold the input)."""
    base, extra = divmod(n_elements, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def balanced(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    """Contiguous split minimising the costliest stage (exact dynamic programme; n is small)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    @cache
    def best(start: int, parts: int) -> tuple[float, tuple[int, ...]]:
        if parts == 1:
            return prefix[n] - prefix[start], (n,)
        options = []
        for end in range(start + 1, n - parts + 2):
            rest, cuts = best(end, parts - 1)
            options.append((max(prefix[end] - prefix[start], rest), (end, *cuts)))
        return min(options)

    _, cuts = best(0, n_stages)
    starts = (0, *cuts[:-1])
    return list(zip(starts, cuts, strict=True))


def fastest(seconds: Sequence[Mapping[str, float]], schedule: Schedule) -> list[tuple[int, int]]:
    """The contiguous split whose step, simulated with each element's measured F, B, BI and BW
    seconds (a stage's are its elements' sums; messages free), is shortest; ties go to the one
    with the cheapest costliest stage. Balancing ranks alone is not enough: a rank's two stages
    can sum evenly while one of them is twice its neighbours and holds up every microbatch."""
    n, n_stages = len(seconds), schedule.n_stages
    totals = [e[Op.F] + e[Op.B] for e in seconds]
    if comb(n - 1, n_stages - 1) > MOST_SIMULATED:
        return balanced(totals, n_stages)

    def step_key(bounds: list[tuple[int, int]]) -> tuple[float, float]:
        table = [{op: sum(e[op] for e in seconds[a:b]) for op in COMPUTE} for a, b in bounds]
        step = simulate(schedule, lambda act: table[act.stage].get(act.op, 0.0)).makespan
        return step, max(sum(totals[a:b]) for a, b in bounds)

    splits = [
        list(zip((0, *cuts), (*cuts, n), strict=True))
        for cuts in combinations(range(1, n), n_stages - 1)
    ]
    return min(splits, key=step_key)


def describe(bounds: Sequence[tuple[int, int]], costs: Sequence[float] | None = None) -> str:
    parts = []
    for s, (a, b) in enumerate(bounds):
        cost = f" cost {sum(costs[a:b]):.3g}" if costs is not None else ""
        parts.append(f"stage {s}: elements {a}..{b - 1}{cost}")
    return "; ".join(parts)
