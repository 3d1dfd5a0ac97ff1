"""Compute orders: what each rank computes, in which order, with no messages yet.

One small function per schedule, all with the signature (ranks P, microbatches M, virtual
stages V) -> per-rank lists of F/B/BI/BW actions; `lower.lower` adds the messages. Stage s runs
on rank s mod P (with V = 1, stage = rank).
"""

from __future__ import annotations

from collections.abc import Callable

from ringtrain.pipeline.ir import Action

ComputeOrder = Callable[[int, int, int], list[list[Action]]]


def gpipe(ranks: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """All forwards, then all backwards (increasing mb, so gradients flow in send order)."""
    mbs = range(microbatches)
    return [
        [Action(s, "F", m) for m in mbs] + [Action(s, "B", m) for m in mbs] for s in range(ranks)
    ]


def one_f_one_b(ranks: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """PipeDream-flush: warm-up forwards, then alternate F and B, then drain the Bs.

    Stage s holds at most min(P - s, M) microbatches' activations instead of GPipe's M.
    """
    return [
        _warmup_steady_cooldown(
            [Action(s, "F", m) for m in range(microbatches)],
            [[Action(s, "B", m)] for m in range(microbatches)],
            min(ranks - s - 1, microbatches),
        )
        for s in range(ranks)
    ]


def zb_h1(ranks: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with each backward
    split into BI (input gradient, on the critical path, sent upstream at once) and BW (weight
    gradient, needed by nobody else). Stage s runs its BW s microbatches late: BI reaches the
    earlier stages sooner and the late BWs fill the drain, where 1F1B idles.

    Every stage then holds at most P microbatches between F and BW, the peak of 1F1B's first
    stage, which is what sizes the memory of the whole pipeline.
    """
    orders = []
    for s in range(ranks):
        bi = [Action(s, "BI", m) for m in range(microbatches)]
        bw = [Action(s, "BW", m) for m in range(microbatches)]
        backward = [[bi[m], *([bw[m - s]] if m >= s else [])] for m in range(microbatches)]
        order = _warmup_steady_cooldown(
            [Action(s, "F", m) for m in range(microbatches)],
            backward,
            min(ranks - s - 1, microbatches),
        )
        orders.append(order + bw[max(microbatches - s, 0) :])
    return orders


def interleaved(ranks: int, microbatches: int, virtual_stages: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: each rank holds V stages (s, s + P, ...), microbatches go
    through them in groups of P, and the warm-up shrinks the bubble about V times.

    Rank r runs M·V forwards in the order (group, chunk, mb within group), backwards in the
    same order with chunks reversed, after (V - 1)·P + 2·(P - 1 - r) warm-up forwards.
    """
    if microbatches % ranks:
        raise ValueError(
            f"interleaved needs the microbatches ({microbatches}) to be a multiple of "
            f"the pipeline stages ({ranks})"
        )
    total = microbatches * virtual_stages

    def nth(rank: int, k: int, op: str) -> Action:
        group, within = divmod(k, ranks * virtual_stages)
        chunk, offset = divmod(within, ranks)
        chunk = chunk if op == "F" else virtual_stages - 1 - chunk
        return Action(chunk * ranks + rank, op, group * ranks + offset)

    orders = []
    for r in range(ranks):
        forwards = [nth(r, k, "F") for k in range(total)]
        backwards = [[nth(r, k, "B")] for k in range(total)]
        warmup = min((virtual_stages - 1) * ranks + 2 * (ranks - 1 - r), total)
        orders.append(_warmup_steady_cooldown(forwards, backwards, warmup))
    return orders


def _warmup_steady_cooldown(
    forwards: list[Action], backwards: list[list[Action]], warmup: int
) -> list[Action]:
    """The 1F1B shape: `warmup` forwards, then one forward and one backward group at a time,
    then the backward groups left."""
    order = forwards[:warmup]
    for i in range(len(forwards) - warmup):
        order += [forwards[warmup + i], *backwards[i]]
    for group in backwards[len(forwards) - warmup :]:
        order += group
    return order


SCHEDULES: dict[str, ComputeOrder] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
}
