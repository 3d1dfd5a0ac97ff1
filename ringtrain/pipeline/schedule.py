"""Pipeline schedules as plain data: the two ways in, a generated kind or a user's JSON file.

A generator (generators.py) states each rank's compute order; `lower` (lower.py) adds the
messages, REDUCE and STEP; `validate` (validate.py) checks any schedule in milliseconds; the
same lists feed the simulator, the Gantt drawing and the executor. The IR is in ir.py.
Imports neither TensorFlow nor MPI on purpose.
"""

from __future__ import annotations

import json

from ringtrain.config import TrainConfig, is_schedule_file
from ringtrain.errors import UserError
from ringtrain.pipeline.generators import SCHEDULES
from ringtrain.pipeline.ir import Schedule, interleaved_ranks, schedule_from_json
from ringtrain.pipeline.lower import lower
from ringtrain.pipeline.validate import check_order, validate

MAX_WORK = 65536  # stages x microbatches: simulating that many takes seconds; more, minutes


def build_schedule(kind: str, pp_size: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Generate the compute order of `kind` over `pp_size` pipeline ranks and lower it."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule kind {kind!r} (choose from {', '.join(SCHEDULES)})")
    for name, value in (("stages", pp_size), ("microbatches", microbatches)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if virtual_stages < 1:
        raise ValueError(f"virtual stages must be >= 1, got {virtual_stages}")
    if pp_size * virtual_stages * microbatches > MAX_WORK:
        raise ValueError(
            f"{pp_size * virtual_stages} stages x {microbatches} microbatches is more than the "
            f"{MAX_WORK} stage-microbatches a schedule may hold"
        )
    if virtual_stages != 1 and kind != "interleaved":
        raise ValueError(f"{kind} puts one stage on each rank; virtual stages are for interleaved")
    stage_ranks = interleaved_ranks(pp_size, virtual_stages)
    orders = SCHEDULES[kind](pp_size, microbatches, virtual_stages)
    return Schedule(kind, microbatches, stage_ranks, lower(orders, stage_ranks))


def load_schedule_file(path: str) -> Schedule:
    """Read, complete and validate a user's schedule; one-line UserError before anything runs.

    Lists holding only computations (F, B, BI, BW) are compute orders and get lowered like a
    generated kind; anything else must already be a complete schedule, as `--json` prints it.
    """
    try:
        with open(path) as file:
            doc = json.load(file)
    except OSError as err:
        raise UserError(f"{path}: cannot read the schedule: {err.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: not JSON: {err}") from None
    try:
        schedule = schedule_from_json(doc)
        if all(a.op.is_compute for row in schedule.actions for a in row):
            check_order(schedule, lowered=False)
            schedule.actions = lower(schedule.actions, schedule.stage_ranks)
        validate(schedule)
    except ValueError as err:
        raise UserError(f"{path}: {err}") from None
    return schedule


def pipeline_schedule(cfg: TrainConfig, pp_size: int) -> Schedule:
    """The schedule every pipeline of this run follows: generated, or the user's file checked.

    Raises UserError; a file is read like a flag's value, every rank reading the same file.
    """
    if is_schedule_file(cfg.schedule):
        return load_schedule_file(cfg.schedule)
    try:
        return build_schedule(cfg.schedule, pp_size, cfg.microbatches, cfg.virtual_stages)
    except ValueError as err:
        raise UserError(f"--schedule {cfg.schedule}: {err}") from None
