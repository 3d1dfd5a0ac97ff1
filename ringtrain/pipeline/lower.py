"""Lowering: turn compute orders into complete per-rank lists with messages, REDUCE and STEP.

Placing each receive right before its compute and each send right after it deadlocks 1F1B
under blocking sends (stage 0 sends activation 1 while stage 1 sends gradient 0). `lower`
instead records a witness run of the compute orders at unit cost (see interpreter.py): every
send is placed where its receiver needed the tensor, so the lists cannot deadlock even with
synchronous sends, and at unit cost sends land exactly when needed.

Neighbouring stages on the same rank (interleaving with P = 1, or a user's stage map) exchange
nothing: the tensor stays in the rank's memory, so the lists have no message for it.

Sends that do not wait (Isend) need none of that care: `send_when_made` moves every send up
to right after the computation that made its tensor, so a receiver never waits for a sender
that had the data but was itself waiting. Under real costs the witness order can make it wait:
at 2 stages 1F1B's stage 0 sent activation i + 1 only after gradient i arrived, and stage 1,
done with gradient i, waited about 1.5 ms for it every microbatch.

Then each stage gets a REDUCE (average its gradients over the replicas) right after its last
action, usually the send of its last input gradient, so upstream stages keep computing while
it averages; and a STEP, all of a rank's STEPs last, so a step that clips by the global norm
sees every stage's averaged gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ringtrain.pipeline.interpreter import Stuck, interpret
from ringtrain.pipeline.ir import Action, Op, Schedule, consumes, produces
from ringtrain.pipeline.simulate import unit_cost


def lower(orders: Sequence[Sequence[Action]], stage_ranks: Sequence[int]) -> list[list[Action]]:
    """Messages by witness run, then REDUCE and STEP; ValueError if the orders cannot run."""
    try:
        run = interpret(stage_ranks, orders, unit_cost(stage_ranks), blocking=True, witness=True)
    except Stuck as stuck:
        raise ValueError(stuck.line("the compute orders wait on each other")) from None
    return add_reduce_and_step(run.actions, stage_ranks)


def naive_lowering(
    orders: Sequence[Sequence[Action]], stage_ranks: Sequence[int]
) -> list[list[Action]]:
    """Receive right before, send right after each compute: kept to show why `lower` exists."""
    n_stages, lists = len(stage_ranks), []
    for r, order in enumerate(orders):
        row: list[Action] = []
        for a in order:
            need, made = consumes(a, n_stages), produces(a, n_stages)
            row += [need.recv_action()] if need and stage_ranks[need.stage] != r else []
            row += [a] + ([made.send_action()] if made and stage_ranks[made.consumer] != r else [])
        lists.append(row)
    return add_reduce_and_step(lists, stage_ranks)


def add_reduce_and_step(
    lists: Sequence[Sequence[Action]], stage_ranks: Sequence[int]
) -> list[list[Action]]:
    """REDUCE each stage right after its last action; every STEP at the end of its rank's list."""
    out = []
    for r, row in enumerate(lists):
        last = {a.stage: i for i, a in enumerate(row)}
        lowered: list[Action] = []
        for i, a in enumerate(row):
            lowered += [a, Action(a.stage, Op.REDUCE)] if last[a.stage] == i else [a]
        mine = [s for s, rank in enumerate(stage_ranks) if rank == r]
        out.append(lowered + [Action(s, Op.STEP) for s in mine])
    return out


def send_when_made(schedule: Schedule) -> Schedule:
    """The schedule with each send right after the computation that made its tensor: for sends
    that never block, where it cannot deadlock (data is only ever ready earlier) and no receiver
    waits longer. Blocking sends need `lower`'s placement."""
    n_stages, lists = schedule.n_stages, []
    for row in schedule.actions:
        sends = {a for a in row if a.op.is_send}
        moved: list[Action] = []
        for a in row:
            if a in sends:
                continue
            moved.append(a)
            made = produces(a, n_stages)
            send = made.send_action() if made is not None else None
            if send in sends:
                moved.append(send)
        lists.append(moved)
    return replace(schedule, actions=lists)
