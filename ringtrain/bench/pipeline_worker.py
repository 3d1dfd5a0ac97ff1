"""The pipeline benchmark's processes: `BATCH ranks NAMES` (the 2 pipeline ranks, every
pipeline contender in NAMES) or `BATCH single NAMES` (one process, its threads from
RINGTRAIN_THREADS, every single contender in NAMES), at global batch BATCH.

Each builds its engines, traces them and times the link once, says it is ready, then serves
the parent's commands: time a contender for some steps and report (a pipeline also predicts
the rest of those steps from a few of them).
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import numpy as np

from ringtrain import runtime
from ringtrain.bench.common import (
    batch_stream,
    bench_config,
    engine_of,
    ranks_cpus_allowed,
    reply,
    serve,
    settings_in_force,
)
from ringtrain.bench.pipeline_bench import (
    ACCUMULATE,
    BLOCKS,
    CLASSES,
    DIM,
    LR,
    PIPELINES,
    SAMPLES,
    SEED,
    SHAPE,
)
from ringtrain.data import Dataset, load_synthetic
from ringtrain.models import compile_classifier, transformer
from ringtrain.pipeline.calibrate import calibration_steps
from ringtrain.pipeline.trace import STEP, measured_bubble, measured_step_seconds

WARM_UP_STEPS = 2  # before the rounds: the first traces the graphs


def base_config(batch: int):
    """Activations kept (the default), as the docs tell users whose stages fit in memory."""
    return bench_config(
        "transformer",
        batch,
        LR,
        SEED,
        strategy="pipeline",
        partition="time",
        progress="none",
    )


def workload(cfg) -> tuple[Dataset, object]:
    """The data, and the wider transformer compiled as cfg says."""
    data = load_synthetic(SAMPLES, SHAPE, CLASSES, SEED)
    model = transformer(data.input_shape, data.n_classes, dim=DIM, blocks=BLOCKS, seed=SEED)
    return data, compile_classifier(model, cfg.optimizer, cfg.lr)


def held_bytes(model, bounds: list[tuple[int, int]], mb_size: int, recompute: bool):
    """Bytes the executor keeps per microbatch in flight, per stage: its input and, with
    activations kept, each layer's output (a layer's own intermediates are not counted)."""
    shapes = [model.inputs[0].shape[1:], *(layer.output.shape[1:] for layer in model.layers)]
    per_sample = [4 * int(np.prod(s)) for s in shapes]
    return [
        mb_size * (per_sample[first] + (0 if recompute else sum(per_sample[first + 1 : last + 1])))
        for first, last in bounds
    ]


class Contender:
    """One pipeline schedule's engine; each timing predicts its steps from a few of them."""

    def __init__(self, name: str, world: runtime.World, batch: int):
        kind, micro, virtual = PIPELINES[name]
        base = base_config(batch)
        cfg = replace(base, schedule=kind, microbatches=micro, virtual_stages=virtual)
        data, model = workload(cfg)
        self.engine, self.world, self.cfg = engine_of(model, data, cfg, world), world, cfg
        self.engine.calibrate_link()
        for indices in batch_stream(len(data.x), WARM_UP_STEPS, batch, SEED):
            self.engine.step(indices)  # the first traces the graphs
        e = self.engine
        per_mb = held_bytes(model, e.bounds, e.mb_size, cfg.recompute)
        peaks = e.predicted.peak_inflight
        self.report = {
            "schedule": kind,
            "microbatches": micro,
            "virtual_stages": virtual,
            "partition": [list(b) for b in e.bounds],
            "peak_inflight": peaks,
            "activation_bytes_per_microbatch": per_mb,
            "activation_bytes_peak": [p * b for p, b in zip(peaks, per_mb, strict=True)],
            "boundary_bytes_per_microbatch": e.boundary_bytes,
        }

    def run(self, steps: int) -> dict | None:
        """Time `steps` steps; a few of them, spread through the timing (calibration_steps),
        calibrate the simulator, which then predicts the rest: a prediction made minutes
        earlier would measure this VM's drift between rounds, not the model."""
        since = self.engine.step_index
        stream = batch_stream(len(self.engine.data.x), steps, self.cfg.batch_size, SEED + since)
        start = time.perf_counter()
        for batch in stream:
            self.engine.step(batch)
        seconds = time.perf_counter() - start
        rows = self.engine.trace.gather(self.world.comm, since=since)
        if rows is None:
            return None
        chosen = calibration_steps(since, steps)
        predicted, calibration = self.engine.prediction(rows, chosen)
        later = rows[~np.isin(rows[:, STEP], chosen)] if steps > 1 else rows
        return {
            "seconds": seconds,
            "bubble_measured": measured_bubble(later, 2, skip_first=False),
            "step_time_measured": measured_step_seconds(later, skip_first=False),
            "bubble_predicted": predicted.bubble,
            "step_time_predicted": predicted.makespan,
            "calibration": calibration,
            **self.report,
        }


def ranks(batch: int, names: list[str]) -> None:
    world = runtime.start(with_horovod=False)
    contenders = {name: Contender(name, world, batch) for name in names}
    cpus = ranks_cpus_allowed(world.comm)
    if world.rank == 0:
        reply({"ready": True, "cpus_allowed_list": cpus, "environment": settings_in_force()})
    serve(world.comm, names, lambda name, steps: contenders[name].run(steps))


def single(batch: int, names: list[str]) -> None:
    """One process serving each single contender in `names`, its batch whole or in slices."""
    world = runtime.start(with_horovod=False)
    base = replace(base_config(batch), strategy="single")
    engines = {}
    for name in names:
        cfg = replace(base, accumulate=ACCUMULATE[name])
        data, model = workload(cfg)
        engines[name] = engine_of(model, data, cfg, world)
    for engine in engines.values():
        engine.step(batch_stream(len(data.x), 1, batch, SEED)[0])  # trace outside the timing

    def run(name: str, steps: int) -> dict:
        stream = batch_stream(len(data.x), steps, batch, SEED + 1)
        start = time.perf_counter()
        for indices in stream:
            engines[name].step(indices)
        return {"seconds": time.perf_counter() - start}

    reply(
        {
            "ready": True,
            "cpus_allowed_list": ranks_cpus_allowed(world.comm),
            "threads": runtime.default_threads(1),
            "environment": settings_in_force(),
        }
    )
    serve(world.comm, names, run)


if __name__ == "__main__":
    batch, role, what = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    (ranks if role == "ranks" else single)(batch, what.split(","))
