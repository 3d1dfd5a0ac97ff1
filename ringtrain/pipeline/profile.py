"""Choosing a pipeline's partition, and the profiling the `time` partition and `plan` rest on.

A unit (a built-in element, or a block of a user's graph between two valid cuts) is built as a
stage on its own and timed through the executor's own calls: the compiled forward that keeps
the activations, then the compiled backward that takes every gradient from them and adds the
weights' into the sums. BI is a whole B and BW nothing, as the executor runs a split backward.
A partition needs the units' relative costs. Rank 0 times, and broadcasts, so every rank
splits the model identically.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from ringtrain import log
from ringtrain.checkpoint import stored_partition
from ringtrain.comm import Link
from ringtrain.config import TrainConfig, partition_method
from ringtrain.guard import agree
from ringtrain.pipeline import partition
from ringtrain.pipeline.calls import CompiledCall
from ringtrain.pipeline.ir import COMPUTE, Op
from ringtrain.tensorflow_loader import tf


def time_microbatch(stage, x, y, share, upstream) -> tuple[float, float]:
    """Seconds of one microbatch's F (the loss read on a last stage, as the executor reads it)
    and B on `stage`, through the executor's own calls."""
    start = time.perf_counter()
    out, kept = stage.forward(x, y, share)
    if stage.last:
        float(out)
    middle = time.perf_counter()
    stage.backward(kept, x, y, share, upstream)
    return middle - start, time.perf_counter() - middle


@contextmanager
def untouched(stage):
    """Time a stage without changing its run: the state a training forward moves
    (BatchNormalization's statistics, a dropout's seed) is put back, and the next backward
    starts a new gradient sum."""
    state = [(v, v.numpy()) for v in stage.state_variables()]
    try:
        yield
    finally:
        for variable, value in state:
            variable.assign(value)
        stage.summing = False


def ones_upstream(stage, x, y=None, share=None):
    """Ones of the shape a stage's backward starts from (None on a last stage: its loss)."""
    if stage.last:
        return None
    made = stage.targets(stage.output(x, y, share), ())[0]
    return tf.nest.map_structure(tf.ones_like, made)


def microbatch_seconds(stage, x, y=None, share=None, repeats: int = 3) -> dict[Op, float]:
    """Median seconds of a stage's F, B, BI and BW on the input `x` over `repeats` runs, after
    one that traces: BI is a whole B and BW nothing, as the executor runs a split backward."""
    upstream = ones_upstream(stage, x, y, share)
    timings = [time_microbatch(stage, x, y, share, upstream) for _ in range(repeats + 1)]
    forward, backward = (float(np.median(column)) for column in zip(*timings[1:], strict=True))
    return {Op.F: forward, Op.B: backward, Op.BI: backward, Op.BW: 0.0}


def call_floor_seconds(repeats: int = 200) -> float:
    """Median seconds of a compiled call that adds one to one number, called the way the
    executor calls a stage: what every F and B pays before any of its own work."""
    call, x = CompiledCall(tf.function(lambda v: v + 1.0)), tf.zeros(1)
    call(x)  # traces
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call(x)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def time_unit(stage, x, repeats: int = 3) -> dict[Op, float]:
    """`microbatch_seconds` of one unit built as a stage of its own, without a loss (the last
    stage's is small against its layers)."""
    stage.last = False  # read when the stage's functions trace, at their first call
    return microbatch_seconds(stage, x, repeats=repeats)


def _unit_seconds(plan, samples: int, comm) -> list[dict[Op, float]]:
    """Each unit's F, B, BI and BW seconds at `samples` examples, timed on rank 0 and
    broadcast."""
    table = np.zeros((plan.n_units, len(COMPUTE)), np.float64)
    if comm.Get_rank() == 0:
        for i, seconds in enumerate(plan.unit_seconds(samples)):
            table[i] = [seconds[op] for op in COMPUTE]
    comm.Bcast(table, root=0)
    return [dict(zip(COMPUTE, row.tolist(), strict=True)) for row in table]


def choose_bounds(
    plan, cfg: TrainConfig, world, schedule, samples: int
) -> tuple[list[tuple[int, int]], list[dict[Op, float]]]:
    """The checkpoint's split when resuming (its parts hold its stages), --split-at's, or a
    fresh one by --partition; and the units' timings when the time partition measured them
    (the metrics' calibration reports them)."""
    n_units, n_stages = plan.n_units, schedule.n_stages
    if cfg.resume and cfg.checkpoint_dir:
        wait = Link(world.comm, cfg.comm_timeout).wait
        stored = agree(
            world.comm, wait, lambda: stored_partition(cfg.checkpoint_dir, n_stages, n_units)
        )
        if stored is not None:
            log.info(f"partition (from the checkpoint): {partition.describe(stored)}")
            return stored, []
    method, costs, seconds = partition_method(cfg, n_units, n_stages), None, []
    if cfg.split_at:
        bounds, method = plan.split_at(cfg.split_at.split(","), n_stages), "--split-at"
    elif method == "uniform":
        bounds = partition.uniform(n_units, n_stages)
    elif method == "params":
        costs = plan.unit_params()
        bounds = partition.balanced(costs, n_stages)
    else:  # time
        seconds = _unit_seconds(plan, samples, world.comm)
        costs = [unit[Op.F] + unit[Op.B] for unit in seconds]
        if len(set(schedule.stage_ranks)) < n_stages:  # a rank holds several stages
            bounds = partition.fastest(seconds, schedule)
        else:
            bounds = partition.balanced(costs, n_stages)
    log.info(f"partition ({method}): {partition.describe(bounds, costs)}")
    return bounds, seconds if world.rank == 0 else []
