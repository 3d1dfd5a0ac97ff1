"""`ringtrain schedule`: print, dump or draw a pipeline schedule without TensorFlow or MPI."""

from __future__ import annotations

import argparse
import json

from ringtrain.config import check_png
from ringtrain.errors import UserError
from ringtrain.launch.env import who_am_i
from ringtrain.pipeline.generators import SCHEDULES
from ringtrain.pipeline.ir import Schedule, schedule_to_json
from ringtrain.pipeline.schedule import build_schedule, load_schedule_file
from ringtrain.pipeline.simulate import SimResult, simulate

UNIT_COSTS = "unit costs: F = B = 1 per rank's share of the model, BI = BW = B/2"
_DEFAULTS = {"kind": "1f1b", "stages": 4, "microbatches": 8}


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the schedule options on a (sub)parser; the main CLI owns the wiring."""
    parser.add_argument("--kind", choices=list(SCHEDULES), help="a generated schedule (1f1b)")
    parser.add_argument(
        "--stages", "-P", type=int, help="pipeline ranks P, one stage each; interleaved: V each (4)"
    )
    parser.add_argument("--microbatches", "-M", type=int, help="microbatches M (8)")
    parser.add_argument(
        "--virtual-stages", "-V", type=int, help="interleaved: stages per rank V (2)"
    )
    parser.add_argument("--file", metavar="S.json", help="check and simulate your own schedule")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--png", metavar="FILE", help="write a Gantt chart of the simulation")


def _schedule(args: argparse.Namespace) -> Schedule:
    """The generated kind the flags ask for, or the user's file (validated)."""
    flags = ("kind", "stages", "microbatches", "virtual_stages")
    if args.file:
        given = [name for name in flags if getattr(args, name) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise UserError(f"--file holds the whole schedule; {flag} does not apply to it")
        return load_schedule_file(args.file)
    kind, pp_size, micro = (
        _DEFAULTS[name] if getattr(args, name) is None else getattr(args, name)
        for name in flags[:3]
    )
    virtual = args.virtual_stages or (2 if kind == "interleaved" else 1)
    try:
        return build_schedule(kind, pp_size, micro, virtual)
    except ValueError as err:  # pure arithmetic on the flags: every rank would say the same
        raise UserError(str(err)).on_every_rank(who_am_i().rank) from None


def _text(result: SimResult) -> str:
    """One line per rank, one column per time slot (the shortest computation), '.' idle."""
    slot = min((end - start for row in result.timeline for _, start, end in row), default=1.0)
    width = max((len(label) for row in result.timeline for label, _, _ in row), default=1)
    lines = []
    for r, row in enumerate(result.timeline):
        cells = ["."] * round(result.makespan / slot)
        for label, start, end in row:
            first = round(start / slot)
            cells[first : round(end / slot)] = [label] + ["-"] * (round(end / slot) - first - 1)
        lines.append(f"rank {r} | " + " ".join(c.ljust(width) for c in cells).rstrip())
    lines.append(f"predicted bubble: {100 * result.bubble:.1f}% ({UNIT_COSTS})")
    lines.append(f"makespan: {result.makespan:g} (a forward of the whole model costs 1 per rank)")
    lines.append(f"peak in-flight microbatches per stage: {result.peak_inflight}")
    return "\n".join(lines)


def run_schedule_command(args: argparse.Namespace) -> int:
    """Build or load, simulate and report one schedule; return the process exit code."""
    if args.png:
        check_png("--png", args.png)
    schedule = _schedule(args)
    result = simulate(schedule)
    if args.json:
        doc = schedule_to_json(schedule)
        doc.update(
            predicted_bubble=result.bubble,
            makespan=result.makespan,
            peak_inflight=result.peak_inflight,
        )
        print(json.dumps(doc))
    else:
        print(_text(result))
    if args.png:
        from ringtrain.pipeline.gantt import draw_gantt

        title = f"{schedule.kind} P={schedule.pp_size} M={schedule.microbatches}"
        if schedule.n_stages != schedule.pp_size:
            title += f" stages={schedule.n_stages}"
        draw_gantt(result.timeline, args.png, f"{title}, bubble {100 * result.bubble:.1f}%")
        if not args.json:
            print(f"wrote {args.png}")
    return 0
