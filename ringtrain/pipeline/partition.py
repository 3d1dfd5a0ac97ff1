"""Split a model's ordered elements into P contiguous stages.

`uniform` balances the element count, `params` the parameter count, and `time` the measured
forward+backward time. The last two are the same min-max problem over a cost per element.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache


def uniform(n_elements: int, stages: int) -> list[tuple[int, int]]:
    """Equal counts; earlier stages take the remainder (they also hold the input)."""
    base, extra = divmod(n_elements, stages)
    bounds, start = [], 0
    for s in range(stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def balanced(costs: Sequence[float], stages: int) -> list[tuple[int, int]]:
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

    _, cuts = best(0, stages)
    starts = (0, *cuts[:-1])
    return list(zip(starts, cuts, strict=True))


def describe(bounds: Sequence[tuple[int, int]], costs: Sequence[float] | None = None) -> str:
    parts = []
    for s, (a, b) in enumerate(bounds):
        cost = f" cost {sum(costs[a:b]):.3g}" if costs is not None else ""
        parts.append(f"stage {s}: elements {a}..{b - 1}{cost}")
    return "; ".join(parts)
