"""Check a schedule before anything runs; an error names the first bad action.

Three passes, each stopping at its first problem: every action in order (its stage lives on
this rank, and what it needs came earlier in the list), then completeness (each stage computes
and exchanges every microbatch once, then REDUCEs and STEPs), then a run of all lists with
blocking sends (the shared interpreter), which finds any deadlock. Messages name actions as
`rank R action I (TEXT)`, with I counted from 0 as in the JSON lists. A compute order (no
messages, REDUCE or STEP yet) gets the first two passes without the messages; `lower` then
finds whether the ranks' orders can run together.
"""

from __future__ import annotations

from ringtrain.pipeline.interpreter import Stuck, interpret
from ringtrain.pipeline.ir import Action, Op, Schedule, carries, consumes, produces
from ringtrain.pipeline.simulate import unit_cost


def validate(schedule: Schedule) -> None:
    """Raise ValueError with one line naming the first problem; silence means it can run."""
    check_order(schedule, lowered=True)
    try:
        interpret(
            schedule.stage_ranks, schedule.actions, unit_cost(schedule.stage_ranks), blocking=True
        )
    except Stuck as stuck:
        raise ValueError(stuck.line("deadlock under blocking sends")) from None


def check_order(schedule: Schedule, lowered: bool) -> None:
    """The order and completeness passes; `lowered=False` for a bare compute order."""
    if not schedule.n_stages:
        raise ValueError("the schedule has no stages")
    for r in range(schedule.pp_size):
        seen: set[Action] = set()
        for i, a in enumerate(schedule.actions[r]):
            problem = _out_of_order(schedule, r, a, seen, lowered)
            if problem:
                raise ValueError(f"rank {r} action {i} ({a}): {problem}")
            seen.add(a)
        _check_complete(schedule, r, seen, lowered)


def _out_of_order(
    schedule: Schedule, r: int, a: Action, seen: set[Action], lowered: bool
) -> str | None:
    """What is wrong with action `a` at this point of rank r's list, if anything."""
    n_stages, mb = schedule.n_stages, a.mb
    if not 0 <= a.stage < n_stages:
        return f"there is no stage {a.stage} (the schedule has {n_stages})"
    if schedule.stage_ranks[a.stage] != r:
        return f"stage {a.stage} runs on rank {schedule.stage_ranks[a.stage]}"
    if mb is not None and not 0 <= mb < schedule.microbatches:
        return f"microbatch {mb} is out of range (there are {schedule.microbatches})"
    if a in seen:
        return "repeats an earlier action"
    if a.op.is_message:
        return _message_problem(schedule, r, a, seen)
    if a.op is Op.REDUCE:
        missing = _missing_compute(schedule, a.stage, seen)
        return f"averages gradients before {missing}" if missing else None
    if a.op is Op.STEP:
        reduce_ = Action(a.stage, Op.REDUCE)
        return None if reduce_ in seen else "steps the optimizer before averaging the gradients"
    if a.op is Op.BW:
        if Action(a.stage, Op.BI, mb) not in seen:
            return f"weight-gradient half of microbatch {mb} before its input-gradient half"
        return None
    if a.op.makes_input_grad:
        if Action(a.stage, Op.F, mb) not in seen:
            return f"backward of microbatch {mb} before its forward"
        other = (Op.BI, Op.BW) if a.op is Op.B else (Op.B,)
        if any(Action(a.stage, op, mb) in seen for op in other):
            return f"both a full and a split backward of microbatch {mb}"
    need = consumes(a, n_stages)
    if need is None:
        return None
    if schedule.stage_ranks[need.stage] != r:
        if not lowered:
            return None  # the receive is lowering's to place
        what = "activation" if need.kind == "ACT" else "gradient"
        return None if need.recv_action() in seen else f"runs before receiving its {what}"
    if any(m in seen for m in need.makers()):
        return None
    return f"runs before stage {need.stage} made its input"


def _message_problem(schedule: Schedule, r: int, a: Action, seen: set[Action]) -> str | None:
    tensor = carries(a)
    sending = a.op.is_send
    peer_stage = tensor.consumer if sending else tensor.stage
    if not 0 <= peer_stage < schedule.n_stages:
        return f"there is no stage {peer_stage} to {'send to' if sending else 'receive from'}"
    if schedule.stage_ranks[peer_stage] == r:
        return f"stage {peer_stage} is on this rank too: hand-offs within a rank are not messages"
    if not sending:
        return None
    if any(m in seen for m in tensor.makers()):
        return None
    return f"sends microbatch {a.mb}'s {tensor.kind.lower()} before computing it"


def _missing_compute(schedule: Schedule, stage: int, seen: set[Action]) -> str | None:
    """The first forward or backward stage `stage` has not run, if any."""
    for mb in range(schedule.microbatches):
        if Action(stage, Op.F, mb) not in seen:
            return str(Action(stage, Op.F, mb))
        if Action(stage, Op.B, mb) not in seen and Action(stage, Op.BW, mb) not in seen:
            return str(Action(stage, Op.B, mb))
    return None


def _check_complete(schedule: Schedule, r: int, seen: set[Action], lowered: bool) -> None:
    """Every stage on rank r computes and exchanges every microbatch, then REDUCEs and STEPs."""
    for stage in schedule.stages_on(r):
        for mb in range(schedule.microbatches):
            backward = (Op.BI, Op.BW) if Action(stage, Op.BI, mb) in seen else (Op.B,)
            computes = [Action(stage, op, mb) for op in (Op.F, *backward)]
            needed = computes + (_messages(schedule, r, computes) if lowered else [])
            for a in needed:
                if a not in seen:
                    raise ValueError(f"rank {r}: {a} is missing")
        for op in (Op.REDUCE, Op.STEP) if lowered else ():
            if Action(stage, op) not in seen:
                raise ValueError(f"rank {r}: {Action(stage, op)} is missing")


def _messages(schedule: Schedule, r: int, computes: list[Action]) -> list[Action]:
    """The receives feeding `computes` and the sends of what they make, across ranks."""
    messages = []
    for a in computes:
        need, made = consumes(a, schedule.n_stages), produces(a, schedule.n_stages)
        if need is not None and schedule.stage_ranks[need.stage] != r:
            messages.append(need.recv_action())
        if made is not None and schedule.stage_ranks[made.consumer] != r:
            messages.append(made.send_action())
    return messages
