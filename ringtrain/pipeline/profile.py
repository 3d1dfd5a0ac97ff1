"""Choosing a pipeline's partition, and the profiling the `time` partition and `plan` rest on.

A unit (a built-in element, or a block of a user's graph between two valid cuts) is timed the
way the executor runs a stage with --no-recompute: a compiled forward under an eager tape,
then the tape's gradients (B: weights and inputs; BI: the inputs only; BW: the weights only).
A partition needs the units' relative costs. Rank 0 times, and broadcasts, so every rank
splits the model identically.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from ringtrain import log
from ringtrain.checkpoint import stored_partition
from ringtrain.comm import Link
from ringtrain.config import TrainConfig, partition_method
from ringtrain.guard import agree
from ringtrain.pipeline import partition
from ringtrain.pipeline.ir import COMPUTE, Op
from ringtrain.tensorflow_loader import tf


def time_unit(
    call: Callable, inputs: Sequence, weights: Sequence, repeats: int = 3
) -> dict[Op, float]:
    """Median seconds of F, B, BI and BW of `call(inputs)` (a list of tensors in, a tensor or
    a list out; only float tensors carry gradients)."""
    compiled = tf.function(call, reduce_retracing=True)
    floats = [x for x in inputs if x.dtype.is_floating]
    weights = list(weights)
    wanted = {Op.B: [*weights, *floats], Op.BI: floats, Op.BW: weights}
    timings: dict[Op, list[float]] = {op: [] for op in (Op.F, *wanted)}
    for round_index in range(repeats + 1):  # the first round traces
        for op, sources in wanted.items():
            start = time.perf_counter()
            with tf.GradientTape() as tape:
                for x in floats:
                    tape.watch(x)
                out = compiled(list(inputs))
            middle = time.perf_counter()
            outs = out if isinstance(out, list | tuple) else [out]
            targets = [o for o in outs if o.dtype.is_floating]
            if sources and targets:
                tape.gradient(targets, sources, unconnected_gradients="zero")
            if round_index:
                timings[Op.F].append(middle - start)
                timings[op].append(time.perf_counter() - middle)
    return {op: float(np.median(values)) for op, values in timings.items()}


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
