"""Pipeline schedules as plain data: per-stage lists of actions.

A generator states only the compute order (F and B per stage); `lower` adds the sends and
receives. The same lists feed the simulator, the Gantt drawing and the executor, and
`validate` checks them in milliseconds. Imports neither TensorFlow nor MPI on purpose.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

_SHORT = {
    "F": "F",
    "B": "B",
    "SEND_ACT": "SA",
    "RECV_ACT": "RA",
    "SEND_GRAD": "SG",
    "RECV_GRAD": "RG",
}
_LONG = {short: op for op, short in _SHORT.items()}
_ACTION_RE = re.compile(r"^(SA|RA|SG|RG|F|B)(\d+)$")


@dataclass(frozen=True)
class Action:
    """One step of one stage: a compute (F, B) or a message of microbatch `mb`."""

    op: str
    mb: int

    def __str__(self) -> str:
        return f"{_SHORT[self.op]}{self.mb}"

    @property
    def code(self) -> str:
        """The op's short name (F, B, SA, RA, SG, RG), as traces label it."""
        return _SHORT[self.op]

    @property
    def is_compute(self) -> bool:
        return self.op in ("F", "B")


def parse_action(text: str) -> Action:
    """Inverse of `str(action)`, so schedules round-trip through JSON and traces."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(f"not an action: {text!r} (expected e.g. F3, B3, SA3, RA3, SG3, RG3)")
    return Action(_LONG[match.group(1)], int(match.group(2)))


@dataclass
class Schedule:
    """A lowered schedule: `actions[s]` is everything stage `s` does, in order."""

    kind: str
    stages: int
    microbatches: int
    actions: list[list[Action]]


ComputeOrder = Callable[[int, int], list[list[Action]]]


def gpipe(stages: int, microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards (increasing mb, so gradients flow in send order)."""
    fwd = [Action("F", mb) for mb in range(microbatches)]
    bwd = [Action("B", mb) for mb in range(microbatches)]
    return [fwd + bwd for _ in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> list[list[Action]]:
    """PipeDream-flush: warm-up forwards, then alternate F and B, then drain the Bs.

    Stage s holds at most min(P - s, M) microbatches' activations instead of GPipe's M.
    """
    orders = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        order = [Action("F", mb) for mb in range(warmup)]
        for i in range(microbatches - warmup):
            order += [Action("F", warmup + i), Action("B", i)]
        order += [Action("B", mb) for mb in range(microbatches - warmup, microbatches)]
        orders.append(order)
    return orders


SCHEDULES: dict[str, ComputeOrder] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def _needs(s: int, stages: int, a: Action) -> tuple[str, int, int] | None:
    """The message (op-direction, mb, sender) compute `a` on stage `s` must receive first."""
    if a.op == "F" and s > 0:
        return ("ACT", a.mb, s - 1)
    if a.op == "B" and s < stages - 1:
        return ("GRAD", a.mb, s + 1)
    return None


def _produces(s: int, stages: int, a: Action) -> tuple[str, int, int] | None:
    """The message (op-direction, mb, receiver) compute `a` on stage `s` must send after."""
    if a.op == "F" and s < stages - 1:
        return ("ACT", a.mb, s + 1)
    if a.op == "B" and s > 0:
        return ("GRAD", a.mb, s - 1)
    return None


def lower(orders: list[list[Action]]) -> list[list[Action]]:
    """Insert sends and receives so the result cannot deadlock even when every send blocks.

    Placing each receive right before its compute and each send right after it deadlocks
    1F1B (stage 0 sends activation 1 while stage 1 sends gradient 0). Instead we run a
    witness execution in rounds: first every stage whose next compute lacks an input takes
    it from its peer's outbox (SEND and RECV emitted at the same moment), then every ready
    stage runs one compute. The lists record that execution, so they are deadlock-free; one
    compute per round makes it the unit-cost as-soon-as-possible run, so sends land exactly
    when the receiver needs them.
    """
    P = len(orders)
    out: list[list[Action]] = [[] for _ in range(P)]
    pc = [0] * P
    outbox: set[tuple[int, int, str, int]] = set()  # (sender, receiver, kind, mb), not yet sent
    received: set[tuple[int, str, int]] = set()  # (receiver, kind, mb)

    def missing(s: int) -> tuple[str, int, int] | None:
        """The message stage s's next compute still lacks, if any."""
        need = _needs(s, P, orders[s][pc[s]])
        return None if need is None or (s, need[0], need[1]) in received else need

    while active := [s for s in range(P) if pc[s] < len(orders[s])]:
        matched = False
        for s in active:
            need = missing(s)
            if need is not None and (need[2], s, need[0], need[1]) in outbox:
                kind, mb, peer = need
                outbox.remove((peer, s, kind, mb))
                received.add((s, kind, mb))
                out[peer].append(Action(f"SEND_{kind}", mb))
                out[s].append(Action(f"RECV_{kind}", mb))
                matched = True
        ready = [s for s in active if missing(s) is None]
        for s in ready:
            a = orders[s][pc[s]]
            out[s].append(a)
            pc[s] += 1
            msg = _produces(s, P, a)
            if msg is not None:
                outbox.add((s, msg[2], msg[0], msg[1]))
        if not matched and not ready:
            stuck = ", ".join(f"stage {s} at {orders[s][pc[s]]}" for s in active)
            raise ValueError(f"compute orders cannot make progress: {stuck}")
    return out


def build_schedule(kind: str, stages: int, microbatches: int) -> Schedule:
    """Generate the compute order of `kind` and lower it; the one entry point for consumers."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule kind {kind!r} (choose from {', '.join(SCHEDULES)})")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    actions = lower(SCHEDULES[kind](stages, microbatches))
    return Schedule(kind, stages, microbatches, actions)


def naive_lowering(kind: str, stages: int, microbatches: int) -> Schedule:
    """Receive right before, send right after each compute: kept to show why `lower` exists."""
    actions = []
    for s, order in enumerate(SCHEDULES[kind](stages, microbatches)):
        lst: list[Action] = []
        for a in order:
            need, msg = _needs(s, stages, a), _produces(s, stages, a)
            lst += [Action(f"RECV_{need[0]}", a.mb)] if need else []
            lst += [a] + ([Action(f"SEND_{msg[0]}", a.mb)] if msg else [])
        actions.append(lst)
    return Schedule(kind, stages, microbatches, actions)


def _expected_comm(s: int, stages: int, mb: int) -> list[Action]:
    """The four messages stage `s` exchanges for microbatch `mb` (fewer at the ends)."""
    ops = []
    if s > 0:
        ops += ["RECV_ACT", "SEND_GRAD"]
    if s < stages - 1:
        ops += ["SEND_ACT", "RECV_GRAD"]
    return [Action(op, mb) for op in ops]


# Within one stage and microbatch: receive before compute, compute before send, F before B.
_ORDER_RULES = [
    ("RECV_ACT", "F"),
    ("F", "SEND_ACT"),
    ("F", "B"),
    ("RECV_GRAD", "B"),
    ("B", "SEND_GRAD"),
]


def _peer(s: int, a: Action) -> tuple[int, Action]:
    """Who the comm action `a` on stage `s` talks to, and the action it must meet there."""
    kind = a.op.split("_")[1]
    sending = a.op.startswith("SEND")
    downstream = (kind == "ACT") == sending
    return (s + 1 if downstream else s - 1), Action(("RECV_" if sending else "SEND_") + kind, a.mb)


def validate(schedule: Schedule) -> None:
    """Raise ValueError naming the first problem; silence means the executor can run it."""
    P, M = schedule.stages, schedule.microbatches
    if len(schedule.actions) != P:
        raise ValueError(f"expected {P} stage lists, got {len(schedule.actions)}")
    for s, lst in enumerate(schedule.actions):
        counts = Counter(lst)
        for mb in range(M):
            for a in [Action("F", mb), Action("B", mb), *_expected_comm(s, P, mb)]:
                if counts.pop(a, 0) != 1:
                    raise ValueError(f"stage {s}: {a} must appear exactly once")
        if counts:
            extra = ", ".join(str(a) if a.op in _SHORT else repr(a) for a in counts)
            raise ValueError(f"stage {s}: unexpected {extra} (duplicate or no matching peer)")
        pos = {a: i for i, a in enumerate(lst)}
        for mb in range(M):
            for first, then in _ORDER_RULES:
                a, b = Action(first, mb), Action(then, mb)
                if a in pos and b in pos and pos[a] > pos[b]:
                    raise ValueError(f"stage {s}: {b} comes before {a}")
    _check_runs(schedule)


def _check_runs(schedule: Schedule) -> None:
    """Run all lists with blocking sends: a SEND and its peer's RECV advance together."""
    P, acts = schedule.stages, schedule.actions
    pc = [0] * P
    done: set[tuple[int, Action]] = set()
    progress = True
    while progress:
        progress = False
        for s in range(P):
            while pc[s] < len(acts[s]) and acts[s][pc[s]].is_compute:
                a = acts[s][pc[s]]
                dep = _needs(s, P, a)
                if dep is not None and (dep[2], a) not in done:
                    raise ValueError(f"stage {s} runs {a} before stage {dep[2]} finished it")
                done.add((s, a))
                pc[s] += 1
                progress = True
            if pc[s] < len(acts[s]):
                peer, want = _peer(s, acts[s][pc[s]])
                if pc[peer] < len(acts[peer]) and acts[peer][pc[peer]] == want:
                    pc[s] += 1
                    pc[peer] += 1
                    progress = True
    stuck = [f"stage {s} at {acts[s][pc[s]]}" for s in range(P) if pc[s] < len(acts[s])]
    if stuck:
        raise ValueError(f"deadlock under blocking sends: {', '.join(stuck)}")
