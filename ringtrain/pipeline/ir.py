"""The schedule IR: actions `(stage, computation, microbatch)` in per-rank lists, and their JSON.

Compact text, as PyTorch prints its actions: `1F0` is stage 1's forward of microbatch 0, `1B0`
its full backward, `1BI0`/`1BW0` the input- and weight-gradient halves of that backward;
`0SA0`/`1RA0` send and receive an activation, `1SG0`/`0RG0` a gradient; `0REDUCE` averages
stage 0's gradients over its replicas and `0STEP` applies them. A stage→rank map places the
stages (stage s on rank s mod P for Megatron interleaving), so peers are ranks looked up there.
This module is the one place that knows the stages form a chain (stage s feeds stage s + 1).
Imports neither TensorFlow nor MPI.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple


class Op(StrEnum):
    """What an action does. The values are the op names schedules have always used, so an Op
    compares and hashes like its string; `code` is the short form the JSON and traces write."""

    F = "F"
    B = "B"
    BI = "BI"
    BW = "BW"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    REDUCE = "REDUCE"
    STEP = "STEP"

    @property
    def code(self) -> str:
        """The short name (F, B, BI, BW, SA, RA, SG, RG, REDUCE, STEP), as traces label it."""
        return _CODES[self]

    @property
    def is_compute(self) -> bool:
        """F, B, BI or BW: the computations, which take the stage's time."""
        return self in COMPUTE

    @property
    def is_message(self) -> bool:
        return self in _MOVES

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_ACT, Op.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (Op.RECV_ACT, Op.RECV_GRAD)

    @property
    def is_per_stage(self) -> bool:
        """REDUCE and STEP: once per stage and step, with no microbatch."""
        return self in (Op.REDUCE, Op.STEP)

    @property
    def makes_input_grad(self) -> bool:
        """B or BI: the backward that needs the output gradient and makes the input's."""
        return self in (Op.B, Op.BI)

    @property
    def ends_microbatch(self) -> bool:
        """B or BW: the stage's last computation of a microbatch, which frees its activations."""
        return self in (Op.B, Op.BW)

    @classmethod
    def of_code(cls, code: str) -> Op:
        """Inverse of `code`; KeyError for anything else."""
        return _BY_CODE[code]


_CODES = {
    Op.F: "F",
    Op.B: "B",
    Op.BI: "BI",
    Op.BW: "BW",
    Op.SEND_ACT: "SA",
    Op.RECV_ACT: "RA",
    Op.SEND_GRAD: "SG",
    Op.RECV_GRAD: "RG",
    Op.REDUCE: "REDUCE",
    Op.STEP: "STEP",
}
_BY_CODE = {code: op for op, code in _CODES.items()}
COMPUTE = (Op.F, Op.B, Op.BI, Op.BW)
_MOVES = {  # message op -> (tensor kind, sent by this stage?)
    Op.SEND_ACT: ("ACT", True),
    Op.RECV_ACT: ("ACT", False),
    Op.SEND_GRAD: ("GRAD", True),
    Op.RECV_GRAD: ("GRAD", False),
}
_SENDS = {kind: op for op, (kind, sent) in _MOVES.items() if sent}  # tensor kind -> its op
_RECVS = {kind: op for op, (kind, sent) in _MOVES.items() if not sent}
_LONGEST_FIRST = "|".join(sorted(_BY_CODE, key=len, reverse=True))  # BI before B
_ACTION_RE = re.compile(rf"^(\d+)({_LONGEST_FIRST})(\d*)$")
EXAMPLES = "e.g. 0F3, 1B3, 1BI3, 1BW3, 0SA3, 1RA3, 1SG3, 0RG3, 0REDUCE, 0STEP"


class Action(NamedTuple):
    """One thing one stage does: a computation or message of microbatch `mb`, or REDUCE/STEP.

    A named tuple rather than a dataclass: validation and simulation hash millions of them.
    What kind of action it is, its op says (`a.op.is_send`, `a.op.is_compute`, ...).
    """

    stage: int
    op: Op
    mb: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.op.code}{'' if self.mb is None else self.mb}"


def parse_action(text: str) -> Action:
    """Inverse of `str(action)`, so schedules round-trip through JSON and traces."""
    match = _ACTION_RE.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"not an action: {text!r} (expected {EXAMPLES})")
    stage, op, mb = int(match.group(1)), Op.of_code(match.group(2)), match.group(3)
    if op.is_per_stage != (mb == ""):
        raise ValueError(f"not an action: {text!r} (only REDUCE and STEP have no microbatch)")
    return Action(stage, op, int(mb) if mb else None)


class Tensor(NamedTuple):
    """A value that crosses stages: stage `stage`'s activation output ("ACT") of microbatch
    `mb`, or the gradient ("GRAD") its backward computes for its input."""

    kind: str
    stage: int
    mb: int

    @property
    def consumer(self) -> int:
        """The stage that needs it: activations flow down the chain, gradients up."""
        return self.stage + 1 if self.kind == "ACT" else self.stage - 1

    def makers(self) -> list[Action]:
        """The computations of its stage that produce it (either half-way or full backward)."""
        ops = (Op.F,) if self.kind == "ACT" else (Op.B, Op.BI)
        return [Action(self.stage, op, self.mb) for op in ops]

    def send_action(self) -> Action:
        """The schedule's SEND of this tensor: an action to place, not a message (the executor
        moves tensors as numpy buffers with upper-case Send/Recv)."""
        return Action(self.stage, _SENDS[self.kind], self.mb)

    def recv_action(self) -> Action:
        """The schedule's RECV of this tensor, on its consumer's rank."""
        return Action(self.consumer, _RECVS[self.kind], self.mb)


def produces(a: Action, n_stages: int) -> Tensor | None:
    """What compute `a` hands to a neighbouring stage (nothing past either end of the chain)."""
    if a.op is Op.F and a.stage < n_stages - 1:
        return Tensor("ACT", a.stage, a.mb)
    if a.op.makes_input_grad and a.stage > 0:
        return Tensor("GRAD", a.stage, a.mb)
    return None


def consumes(a: Action, n_stages: int) -> Tensor | None:
    """What compute `a` needs from a neighbouring stage before it can run."""
    if a.op is Op.F and a.stage > 0:
        return Tensor("ACT", a.stage - 1, a.mb)
    if a.op.makes_input_grad and a.stage < n_stages - 1:
        return Tensor("GRAD", a.stage + 1, a.mb)
    return None


def carries(a: Action) -> Tensor:
    """The tensor a send or receive action moves."""
    kind, sent_here = _MOVES[a.op]
    if sent_here:
        return Tensor(kind, a.stage, a.mb)
    return Tensor(kind, a.stage - 1 if kind == "ACT" else a.stage + 1, a.mb)


def interleaved_ranks(pp_size: int, virtual_stages: int) -> tuple[int, ...]:
    """Megatron's placement: stage s on pipeline rank s mod P, so each rank holds V stages."""
    return tuple(s % pp_size for s in range(pp_size * virtual_stages))


@dataclass
class Schedule:
    """A lowered schedule: `actions[r]` is everything pipeline rank `r` does in one step, in
    order; `stage_ranks[s]` is the pipeline rank that runs stage `s` (pp_size lists, n_stages
    stages)."""

    kind: str
    microbatches: int
    stage_ranks: tuple[int, ...]
    actions: list[list[Action]]

    @property
    def pp_size(self) -> int:
        return len(self.actions)

    @property
    def n_stages(self) -> int:
        return len(self.stage_ranks)

    def stages_on(self, pp_rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_ranks) if r == pp_rank]


# JSON keys written for readers and checked when a file gives them, with what they hold
_DERIVED = {"ranks": lambda s: s.pp_size, "stages": lambda s: s.n_stages}
_REPORT = ("predicted_bubble", "makespan", "peak_inflight")  # what `--json` adds; ignored


def schedule_to_json(schedule: Schedule) -> dict[str, Any]:
    """The file format: `actions` as compact strings, one list per rank."""
    return {
        "kind": schedule.kind,
        "ranks": schedule.pp_size,
        "stages": schedule.n_stages,
        "microbatches": schedule.microbatches,
        "stage_ranks": list(schedule.stage_ranks),
        "actions": [[str(a) for a in row] for row in schedule.actions],
    }


def schedule_from_json(doc: Any) -> Schedule:
    """Parse the file format; raise ValueError naming the first bad field or action.

    Required: `microbatches` and `actions`. `stage_ranks` defaults to one stage per rank.
    """
    if not isinstance(doc, dict):
        raise ValueError("expected a JSON object with 'microbatches' and 'actions'")
    known = {"kind", "microbatches", "stage_ranks", "actions", *_DERIVED, *_REPORT}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (expected {', '.join(sorted(known))})")
    for key in ("microbatches", "actions"):
        if key not in doc:
            raise ValueError(f"missing key {key!r}")
    rows, micro = doc["actions"], doc["microbatches"]
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
        raise ValueError("'actions' must be a non-empty list of per-rank lists of strings")
    if not _is_int(micro) or micro < 1:
        raise ValueError(f"'microbatches' must be a positive integer, got {micro!r}")
    stage_ranks = doc.get("stage_ranks", list(range(len(rows))))
    if not isinstance(stage_ranks, list) or not all(_is_int(r) for r in stage_ranks):
        raise ValueError("'stage_ranks' must be a list of rank numbers, one per stage")
    for s, r in enumerate(stage_ranks):
        if not 0 <= r < len(rows):
            raise ValueError(f"'stage_ranks' puts stage {s} on rank {r}, but there are {len(rows)}")
    actions = []
    for r, row in enumerate(rows):
        parsed = []
        for i, text in enumerate(row):
            try:
                parsed.append(parse_action(text))
            except ValueError as err:
                raise ValueError(f"rank {r} action {i}: {err}") from None
        actions.append(parsed)
    schedule = Schedule(str(doc.get("kind", "file")), micro, tuple(stage_ranks), actions)
    for key, derived in _DERIVED.items():
        if key in doc and doc[key] != derived(schedule):
            raise ValueError(f"'{key}' says {doc[key]!r} but the lists give {derived(schedule)}")
    return schedule


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
