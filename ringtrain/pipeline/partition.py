"""Split a model's ordered elements into P contiguous stages.

`uniform` balances the element count, `params` the parameter count, and `time` the measured
forward+backward time. The last two are the same min-max problem over a cost per element, by
rank: an interleaved rank holds several stages, and what it waits on is their sum.
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


def balanced(
    costs: Sequence[float], stages: int, stage_ranks: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """Contiguous split minimising the costliest rank, then the costliest stage.

    A rank's load is the sum of its stages' costs (`stage_ranks[s]` holds stage s; one stage a
    rank when not given). With a stage a rank, that is the min-max over stages, an exact dynamic
    programme. Interleaving gives a rank several stages, and the stage-balanced split can load
    one rank with two heavy ones, so a branch and bound, started from that split and pruning
    every partial split already costlier, finds the best by rank (n is small)."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    cuts = _stage_balanced_cuts(prefix, stages)
    if stage_ranks is not None and len(set(stage_ranks)) < stages:
        cuts = _rank_balanced_cuts(prefix, stage_ranks, cuts)
    starts = (0, *cuts[:-1])
    return list(zip(starts, cuts, strict=True))


def _stage_balanced_cuts(prefix: list[float], stages: int) -> tuple[int, ...]:
    n = len(prefix) - 1

    @cache
    def best(start: int, parts: int) -> tuple[float, tuple[int, ...]]:
        if parts == 1:
            return prefix[n] - prefix[start], (n,)
        options = []
        for end in range(start + 1, n - parts + 2):
            rest, cuts = best(end, parts - 1)
            options.append((max(prefix[end] - prefix[start], rest), (end, *cuts)))
        return min(options)

    return best(0, stages)[1]


def _rank_balanced_cuts(
    prefix: list[float], stage_ranks: Sequence[int], start_from: tuple[int, ...]
) -> tuple[int, ...]:
    n, stages = len(prefix) - 1, len(stage_ranks)

    def key(cuts: tuple[int, ...]) -> tuple[float, float]:
        loads = [0.0] * (max(stage_ranks) + 1)
        sizes = [prefix[b] - prefix[a] for a, b in zip((0, *cuts[:-1]), cuts, strict=True)]
        for s, size in enumerate(sizes):
            loads[stage_ranks[s]] += size
        return max(loads), max(sizes)

    best = [key(start_from), start_from]

    def search(cuts: tuple[int, ...], loads: tuple[float, ...]) -> None:
        s, start = len(cuts), cuts[-1] if cuts else 0
        ends = [n] if s == stages - 1 else range(start + 1, n - (stages - s - 1) + 1)
        for end in ends:
            grown = list(loads)
            grown[stage_ranks[s]] += prefix[end] - prefix[start]
            if max(grown) > best[0][0]:
                continue
            if s == stages - 1:
                candidate = (*cuts, end)
                if key(candidate) < best[0]:
                    best[:] = [key(candidate), candidate]
            else:
                search((*cuts, end), tuple(grown))

    search((), (0.0,) * (max(stage_ranks) + 1))
    return best[1]


def describe(bounds: Sequence[tuple[int, int]], costs: Sequence[float] | None = None) -> str:
    parts = []
    for s, (a, b) in enumerate(bounds):
        cost = f" cost {sum(costs[a:b]):.3g}" if costs is not None else ""
        parts.append(f"stage {s}: elements {a}..{b - 1}{cost}")
    return "; ".join(parts)
