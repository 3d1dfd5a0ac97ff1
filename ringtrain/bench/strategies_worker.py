"""ringtrain's contenders in `ringtrain bench strategies`, one measurement per command.

    mpirun --bind-to none -np 2 python -m ringtrain.bench.strategies_worker ranks
        single (rank 0, 1 thread), data parallel (custom loop and fit), pipeline (1F1B, M=8)
    mpirun --bind-to none -np 1 python -m ringtrain.bench.strategies_worker all-cores
        one process with every core (unbound, so it may really use them)

The ranks stay up for the whole benchmark, so start-up and tracing are paid once and the
contenders can alternate with TensorFlow's strategies in other processes. Rank 0 reads a
command from stdin (the parent's pipe, which mpirun forwards to rank 0), passes it on with a
broadcast the other rank waits for asleep, and replies with the time of `steps` steps that
follow one untimed step. Horovod runs only while a data-parallel contender is measured. The
ready reply carries every rank's Cpus_allowed_list and the settings the ranks run with.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace

import numpy as np

from ringtrain import runtime
from ringtrain.bench.common import (
    batch_stream,
    bench_config,
    engine_of,
    horovod_running,
    ranks_cpus_allowed,
    reply,
    serve,
    settings_in_force,
)
from ringtrain.bench.strategies import (
    ALL_CORES,
    BATCH,
    DP,
    FIT,
    LR,
    PIPELINE,
    SEED,
    SINGLE,
    workload,
)
from ringtrain.config import TrainConfig
from ringtrain.data import Dataset, shard
from ringtrain.loop import Engine
from ringtrain.models import compile_classifier

Runner = Callable[[int], float]  # steps -> seconds they took


def engine_runner(engine: Engine, data: Dataset, global_batch: int = BATCH) -> Runner:
    """Custom-loop engines (single, data, pipeline): what `ringtrain train` runs per step;
    each run times `steps` global batches of the shared order after one untimed step."""

    def run(steps: int) -> float:
        batches = batch_stream(len(data.x), steps + 1, global_batch, SEED)
        engine.step(batches[0])
        start = time.perf_counter()
        for batch in batches[1:]:
            engine.step(batch)
        return time.perf_counter() - start

    return run


def fit_runner(model, data: Dataset, world: runtime.World) -> Runner:
    """model.fit with ringtrain's Keras 3 pieces: the allreducing optimizer and the broadcast."""
    import keras

    from ringtrain.dataparallel.keras_fit import BroadcastInitialState, distributed_optimizer

    model.compile(
        optimizer=distributed_optimizer(model.optimizer, world.hvd),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    broadcast = BroadcastInitialState(world.hvd)

    def run(steps: int) -> float:
        batches = batch_stream(len(data.x), steps + 1, BATCH, SEED)
        local = np.concatenate([shard(b, world.rank, world.size) for b in batches])
        ends: list[float] = []
        timer = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: ends.append(time.perf_counter())
        )
        model.fit(
            data.x[local],
            data.y[local],
            batch_size=BATCH // world.size,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[broadcast, timer],
        )
        return ends[-1] - ends[0]  # the steps after the first

    return run


def _runners(kind: str, world: runtime.World) -> dict[str, tuple[Runner | None, bool]]:
    """name -> (runner, or None where this rank sits out; whether Horovod must run)."""
    from mpi4py import MPI

    data, build = workload()
    cfg = bench_config("cnn", BATCH, LR, SEED)

    def engine(cfg: TrainConfig, world: runtime.World):
        """ringtrain's engine for cfg, on a model of its own (`ringtrain train`'s)."""
        return engine_of(compile_classifier(build(), "sgd", LR), data, cfg, world)

    if kind == "all-cores":
        everything = engine_runner(engine(cfg, world), data)
        return {ALL_CORES: (everything, False)}
    # Horovod broadcasts by variable name and Keras numbers names per process, so every rank
    # builds the broadcasting contenders first, in the same order, and rank 0's own single
    # process after them.
    with horovod_running(world.comm) as hvd:
        ranks = replace(world, hvd=hvd)
        data_cfg = replace(cfg, strategy="data")
        custom = engine_runner(engine(data_cfg, ranks), data)
        fit = fit_runner(compile_classifier(build(), "sgd", LR), data, ranks)
        custom(1)  # trace while Horovod is up
        fit(1)
    single = None
    if world.rank == 0:
        alone = runtime.World(0, 1, 0, 1, MPI.COMM_SELF, None)
        single = engine_runner(engine(cfg, alone), data)
    pipeline_cfg = replace(cfg, strategy="pipeline", schedule="1f1b", microbatches=8)
    pipeline = engine_runner(engine(pipeline_cfg, world), data)
    return {
        SINGLE: (single, False),
        DP: (custom, True),
        FIT: (fit, True),
        PIPELINE: (pipeline, False),
    }


def main(kind: str) -> None:
    world = runtime.start(with_horovod=False, horovod_later=True)
    import tensorflow as tf

    runners = _runners(kind, world)
    for run, horovod in runners.values():
        if run is not None and not horovod:
            run(1)  # trace outside any timing
    names = list(runners)
    cpus = ranks_cpus_allowed(world.comm)
    if world.rank == 0:
        threads = {
            "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
            "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
        }
        reply(
            {
                "ready": True,
                "contenders": names,
                "ranks": world.size,
                "threads": threads,
                "cpus_allowed_list": cpus,
                "environment": settings_in_force(),
            }
        )

    def measure(name: str, steps: int) -> dict | None:
        run, horovod = runners[name]
        if run is None:
            return None
        with horovod_running(world.comm) if horovod else nullcontext():
            return {"seconds": run(steps)}

    serve(world.comm, names, measure)


if __name__ == "__main__":
    main(sys.argv[1])
