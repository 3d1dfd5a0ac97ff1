"""Compute orders: what each rank computes, in which order, with no messages yet.

One small function per schedule, all with the signature (pp_size P, microbatches M,
virtual_stages V) -> per-rank lists of F/B/BI/BW actions; `lower.lower` adds the messages.
Stage s runs on pipeline rank s mod P (with V = 1, stage = pipeline rank).
"""

from __future__ import annotations

from collections.abc import Callable

from ringtrain.pipeline.ir import Action, Op

ComputeOrder = Callable[[int, int, int], list[list[Action]]]


def gpipe(pp_size: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """All forwards, then all backwards (increasing mb, so gradients flow in send order)."""
    mbs = range(microbatches)
    return [
        [Action(s, Op.F, m) for m in mbs] + [Action(s, Op.B, m) for m in mbs]
        for s in range(pp_size)
    ]


def one_f_one_b(pp_size: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """PipeDream-flush: warm-up forwards, then alternate F and B, then drain the Bs.

    Stage s holds at most min(P - s, M) microbatches' activations instead of GPipe's M.
    """
    return _one_f_one_b(pp_size, microbatches, ahead=0)


def one_f_one_b_ahead(
    pp_size: int, microbatches: int, virtual_stages: int = 1
) -> list[list[Action]]:
    """1F1B with one more warm-up forward on every stage but the last. In 1F1B's steady state
    stage s+1 needs microbatch i+1's activation just as stage s makes it (after the backward
    that waited for stage s+1's gradient), so every hand-off's latency (the send, the
    receiver's wait, unpacking) lies between the two stages' computations. One microbatch
    ahead, that activation was sent a whole F and B earlier. The price: stage s holds
    min(P - s + 1, M) microbatches' activations (the last stage still one)."""
    return _one_f_one_b(pp_size, microbatches, ahead=1)


def _one_f_one_b(pp_size: int, microbatches: int, ahead: int) -> list[list[Action]]:
    return [
        _warmup_steady_cooldown(
            [Action(s, Op.F, m) for m in range(microbatches)],
            [[Action(s, Op.B, m)] for m in range(microbatches)],
            min(pp_size - s - 1 + (ahead if s < pp_size - 1 else 0), microbatches),
        )
        for s in range(pp_size)
    ]


def zb_h1(pp_size: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with each backward
    split into BI (input gradient, on the critical path, sent upstream at once) and BW (weight
    gradient, needed by nobody else). Stage s runs its BW s microbatches late: BI reaches the
    earlier stages sooner and the late BWs fill the drain, where 1F1B idles.

    Every stage then holds at most P microbatches between F and BW, the peak of 1F1B's first
    stage, which is what sizes the memory of the whole pipeline.
    """
    orders = []
    for s in range(pp_size):
        bi = [Action(s, Op.BI, m) for m in range(microbatches)]
        bw = [Action(s, Op.BW, m) for m in range(microbatches)]
        backward = [[bi[m], *([bw[m - s]] if m >= s else [])] for m in range(microbatches)]
        order = _warmup_steady_cooldown(
            [Action(s, Op.F, m) for m in range(microbatches)],
            backward,
            min(pp_size - s - 1, microbatches),
        )
        orders.append(order + bw[max(microbatches - s, 0) :])
    return orders


def interleaved(pp_size: int, microbatches: int, virtual_stages: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: each rank holds V stages (s, s + P, ...), microbatches go
    through them in groups of P, and the warm-up shrinks the bubble about V times.

    Rank r runs M·V forwards in the order (group, chunk, mb within group), backwards in the
    same order with chunks reversed, after (V - 1)·P + 2·(P - 1 - r) warm-up forwards.
    """
    if microbatches % pp_size:
        raise ValueError(
            f"interleaved needs the microbatches ({microbatches}) to be a multiple of "
            f"the pipeline stages ({pp_size})"
        )
    total = microbatches * virtual_stages

    def nth(pp_rank: int, k: int, op: Op) -> Action:
        group, within = divmod(k, pp_size * virtual_stages)
        chunk, offset = divmod(within, pp_size)
        chunk = chunk if op is Op.F else virtual_stages - 1 - chunk
        return Action(chunk * pp_size + pp_rank, op, group * pp_size + offset)

    orders = []
    for r in range(pp_size):
        forwards = [nth(r, k, Op.F) for k in range(total)]
        backwards = [[nth(r, k, Op.B)] for k in range(total)]
        warmup = min((virtual_stages - 1) * pp_size + 2 * (pp_size - 1 - r), total)
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
    "1f1b-ahead": one_f_one_b_ahead,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
}
