"""What a pipeline run reports: the bubble per epoch, the schedule replayed with the run's
own calibration (the prediction `ringtrain plan` reads), the run's metrics, and the --trace and
--gantt files. Read from the executor's trace; nothing here changes training."""

from __future__ import annotations

import numpy as np

from ringtrain.pipeline.calibrate import calibration_steps, stage_seconds, step_actions
from ringtrain.pipeline.costs import predict_from_steps
from ringtrain.pipeline.simulate import SimResult
from ringtrain.pipeline.trace import (
    FIXED,
    MB,
    STAGE,
    STEP,
    action_costs,
    measured_bubble,
    measured_step_seconds,
    timeline,
    write_chrome_trace,
)
from ringtrain.weights import replica_checksums


def epoch_scalars(engine) -> dict[str, float]:
    """The bubble measured over this epoch's steps (collective: rank 0 gets the value).
    The process's first step is left out, as in the run's figure: it includes tracing."""
    rows = engine.trace.gather(engine.world.comm, since=engine.epoch_start)
    first, engine.epoch_start = engine.epoch_start, engine.step_index
    if rows is None:
        return {}
    return {"bubble_measured": measured_bubble(rows, engine.pp_size, skip_first=first == 0)}


def prediction(engine, rows: np.ndarray, steps: list[int]) -> tuple[SimResult, dict]:
    """The schedule replayed with this run's calibration (each of `steps` of a gathered
    trace with its own actions' times, and the link model), and that calibration as a
    report: the median per (stage, op), which `ringtrain plan` reads."""
    measured = step_actions(rows, steps, engine.pp_size)
    predicted = predict_from_steps(
        engine.schedule, measured, engine.link_model, engine.boundary_bytes
    )
    seconds = stage_seconds(rows, steps)
    return predicted, {
        "steps": steps,
        "seconds": {f"{s}{op}": v for (s, op), v in seconds.items()},
        "link": engine.link_model.to_json(),
        "boundary_bytes": engine.boundary_bytes,
        "elements": engine.element_seconds,
        "action_costs_ms": action_costs(rows, steps),
        "fixed_ms_per_microbatch": fixed_per_microbatch(rows, steps, engine),
        "call_floor_ms": 1e3 * engine.call_floor,
    }


def fixed_per_microbatch(rows: np.ndarray, steps: list[int], engine) -> dict[str, float]:
    """Per stage, the milliseconds of fixed cost one microbatch pays in one replica: its F
    and B (or BI and BW) on one example, and its messages' own work."""
    chosen = rows[np.isin(rows[:, STEP], steps) & (rows[:, MB] >= 0)]
    per_stage = len(steps) * engine.cfg.microbatches * engine.dp_size
    return {
        str(s): 1e3 * float(chosen[chosen[:, STAGE] == s][:, FIXED].sum()) / per_stage
        for s in range(engine.n_stages)
    }


def run_metrics(engine) -> dict:
    """What a pipeline run adds to the metrics (collective): its layout, the measured and
    predicted bubble and step time, the calibration, peaks and replica checksums; and the
    --trace and --gantt files."""
    rows = engine.trace.gather(engine.world.comm)
    peaks = np.zeros((engine.world.size, 2), np.int64)
    mine = np.array([engine.peak_inflight, engine.model_resident], np.int64)
    engine.world.comm.Allgather(mine, peaks)
    checksums = replica_checksums(engine.world.comm, engine.variables)
    if rows is None:
        return {}
    title = f"{engine.schedule.kind} P={engine.pp_size} M={engine.cfg.microbatches}"
    steps = calibration_steps(1, engine.step_index - 1) if engine.step_index > 1 else [0]
    predicted, calibration = prediction(engine, rows, steps)
    if engine.cfg.trace:
        write_chrome_trace(rows, engine.pp_size, engine.cfg.trace)
    if engine.cfg.gantt:
        from ringtrain.pipeline.gantt import draw_panels

        measured = timeline(rows, engine.pp_size, engine.step_index - 1)
        panels = [(f"{title}: predicted", predicted.timeline), (f"{title}: measured", measured)]
        draw_panels(panels, engine.cfg.gantt)
    return {
        "schedule": engine.cfg.schedule,
        "microbatches": engine.cfg.microbatches,
        "pp_size": engine.pp_size,
        "stages": engine.n_stages,
        "stage_ranks": list(engine.schedule.stage_ranks),
        "recompute": engine.cfg.recompute,
        "dp_size": engine.dp_size,
        "partition": [list(b) for b in engine.bounds],
        "bubble_measured": measured_bubble(rows, engine.pp_size),
        "bubble_predicted": predicted.bubble,
        "bubble_predicted_unit_costs": engine.predicted.bubble,
        "step_time_measured": measured_step_seconds(rows),
        "step_time_predicted": predicted.makespan,
        "calibration": calibration,
        "peak_inflight": peaks[:, 0].tolist(),
        # per rank: VmHWM after it built its stages, less VmHWM before the model was built
        "model_resident_bytes": peaks[:, 1].tolist(),
        "replica_checksums": checksums,
    }
