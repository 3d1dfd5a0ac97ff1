"""`ringtrain schedule`: print, dump or draw a pipeline schedule without TensorFlow or MPI."""

from __future__ import annotations

import argparse
import json
import sys

from ringtrain.pipeline.schedule import SCHEDULES, Schedule, build_schedule
from ringtrain.pipeline.simulate import SimResult, simulate


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the schedule options on a (sub)parser; the main CLI owns the wiring."""
    parser.add_argument("--kind", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--stages", "-P", type=int, default=4, help="pipeline stages P")
    parser.add_argument("--microbatches", "-M", type=int, default=8, help="microbatches M")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--png", metavar="FILE", help="write a Gantt chart of the simulation")


def _text(schedule: Schedule, result: SimResult) -> str:
    """One line per stage, one column per unit time slot, '.' where the stage idles."""
    slots = int(result.makespan)
    width = max(len(label) for row in result.timeline for label, _, _ in row)
    lines = []
    for s, row in enumerate(result.timeline):
        cells = ["."] * slots
        for label, start, _ in row:
            cells[int(start)] = label
        lines.append(f"stage {s} | " + " ".join(c.ljust(width) for c in cells).rstrip())
    lines.append(f"predicted bubble: {100 * result.bubble:.1f}% (unit cost F = B = 1)")
    lines.append(f"peak in-flight microbatches per stage: {result.peak_inflight}")
    return "\n".join(lines)


def run_schedule_command(args: argparse.Namespace) -> int:
    """Build, simulate and report one schedule; return the process exit code."""
    try:
        schedule = build_schedule(args.kind, args.stages, args.microbatches)
    except ValueError as err:
        print(f"ringtrain schedule: error: {err}", file=sys.stderr)
        return 2
    result = simulate(schedule)
    if args.json:
        doc = {
            "kind": schedule.kind,
            "stages": schedule.stages,
            "microbatches": schedule.microbatches,
            "actions": [[str(a) for a in row] for row in schedule.actions],
            "predicted_bubble": result.bubble,
            "peak_inflight": result.peak_inflight,
        }
        print(json.dumps(doc))
    else:
        print(_text(schedule, result))
    if args.png:
        from ringtrain.pipeline.gantt import draw_gantt

        title = f"{schedule.kind} P={schedule.stages} M={schedule.microbatches}"
        draw_gantt(result.timeline, args.png, f"{title}, bubble {100 * result.bubble:.1f}%")
        if not args.json:
            print(f"wrote {args.png}")
    return 0
