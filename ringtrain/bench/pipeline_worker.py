"""Runs inside both ranks of `mpirun -np 2`: the pipeline benchmark's measurements.

Rounds alternate every contender (single process on rank 0, then GPipe and 1F1B at each M) so
machine drift hits them all alike. Rank 0 writes every raw timing to the JSON file given.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import numpy as np

from ringtrain import runtime
from ringtrain.bench.common import idle_barrier
from ringtrain.config import TrainConfig
from ringtrain.data import epoch_batches, load_synthetic
from ringtrain.models import cnn


def _single(spec, data, cfg, world, steps) -> float:
    from ringtrain.dataparallel.engine import DataParallelEngine

    alone = runtime.World(0, 1, 0, 1, _comm_self(), None)
    engine = DataParallelEngine(spec, data, replace(cfg, strategy="single", microbatches=1), alone)
    batches = epoch_batches(len(data.x), cfg.batch_size, cfg.seed, 0)
    engine.step(batches[0])  # trace the tf.function outside the timing
    start = time.perf_counter()
    for i in range(steps):
        engine.step(batches[(i + 1) % len(batches)])
    return cfg.batch_size * steps / (time.perf_counter() - start)


def _comm_self():
    from mpi4py import MPI

    return MPI.COMM_SELF


def _pipeline(spec, data, cfg, world, steps) -> dict:
    from ringtrain.pipeline.engine import PipelineEngine
    from ringtrain.pipeline.simulate import simulate
    from ringtrain.pipeline.trace import OPS, measured_bubble

    engine = PipelineEngine(spec, data, cfg, world)
    batches = epoch_batches(len(data.x), cfg.batch_size, cfg.seed, 0)
    engine.step(batches[0])
    start = time.perf_counter()
    for i in range(steps):
        engine.step(batches[(i + 1) % len(batches)])
    seconds = time.perf_counter() - start
    rows = engine.trace.gather(world.comm)
    if rows is None:
        return {}
    rows = rows[rows[:, 0] >= 1]  # the first step traced the functions
    mean = {}
    for stage in range(2):
        for op in ("F", "B"):
            sel = rows[(rows[:, 5] == stage) & (rows[:, 1] == OPS.index(op))]
            mean[stage, op] = float(np.mean(sel[:, 4] - sel[:, 3]))
    predicted = simulate(engine.schedule, lambda a: mean[a.stage, a.op] if a.is_compute else 0.0)
    act_bytes = [int(np.prod(engine.act_in.shape[1:])) * 4]  # stage 0 output = stage 1 input
    return {
        "samples_per_sec": cfg.batch_size * steps / seconds,
        "bubble_measured": measured_bubble(rows, 2, skip_first=False),
        "bubble_predicted": predicted.bubble,
        "bubble_predicted_unit": engine.predicted.bubble,
        "peak_inflight": engine.predicted.peak_inflight,
        "boundary_bytes_per_microbatch": act_bytes,
        "mean_f_b_seconds": {f"{s}{op}": v for (s, op), v in mean.items()},
    }


def main(out_path: str, rounds: int, steps: int, microbatches: list[int]) -> None:
    world = runtime.start(with_horovod=False)
    data = load_synthetic(1024, (32, 32, 3), 10, seed=0)
    spec = cnn(data.input_shape, data.n_classes)
    base = TrainConfig(
        strategy="pipeline",
        model="cnn",
        dataset="synthetic",
        batch_size=64,
        optimizer="sgd",
        lr=0.01,
        seed=0,
        comm_timeout=300,
    )
    results: list[dict] = []
    for round_index in range(rounds):
        if world.rank == 0:
            rate = _single(spec, data, base, world, steps)
            results.append({"round": round_index, "contender": "single", "samples_per_sec": rate})
        idle_barrier(world.comm)
        for m in microbatches:
            for kind in ("gpipe", "1f1b"):
                cfg = replace(base, schedule=kind, microbatches=m)
                measured = _pipeline(spec, data, cfg, world, steps)
                if world.rank == 0:
                    results.append(
                        {
                            "round": round_index,
                            "contender": f"{kind} M={m}",
                            "schedule": kind,
                            "microbatches": m,
                            **measured,
                        }
                    )
    if world.rank == 0:
        with open(out_path, "w") as out:
            json.dump(
                {
                    "raw": results,
                    "rounds": rounds,
                    "steps_per_measurement": steps,
                    "model": "cnn",
                    "input": [32, 32, 3],
                    "global_batch": 64,
                },
                out,
            )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(m) for m in sys.argv[4].split(",")])
