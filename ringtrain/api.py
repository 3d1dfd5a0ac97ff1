"""The Python entry point: train a model (a list of elements) on arrays with any strategy.

    from ringtrain import TrainConfig, train, mlp, load_digits
    data = load_digits()
    result = train(mlp(data.input_shape, data.n_classes), data, TrainConfig(strategy="data"))

Run it under `horovodrun`/`mpirun`/`srun`; every rank calls train() with the same arguments.
The CLI is a thin layer over this function.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ringtrain import log, loop, runtime
from ringtrain.config import TrainConfig, validate
from ringtrain.data import Dataset
from ringtrain.guard import Watchdog
from ringtrain.launch.env import who_am_i
from ringtrain.models import ModelSpec
from ringtrain.weights import save_npz


@dataclass
class TrainResult:
    """Metrics on every rank's return; weights only on rank 0 (None elsewhere)."""

    metrics: dict
    weights: dict[str, np.ndarray] | None


def _engine(spec: ModelSpec, data: Dataset, cfg: TrainConfig, world: runtime.World):
    if cfg.strategy in ("single", "data") or (cfg.strategy == "hybrid" and cfg.pp_size == 1):
        from ringtrain.dataparallel.engine import DataParallelEngine

        return DataParallelEngine(spec, data, cfg, world), world.size
    from ringtrain.pipeline.engine import PipelineEngine

    engine = PipelineEngine(spec, data, cfg, world)
    return engine, engine.grid.replicas


def train(spec: ModelSpec, data: Dataset, cfg: TrainConfig) -> TrainResult:
    """Validate identically on every rank, start the runtime, train, write rank 0's outputs."""
    validate(cfg, who_am_i().world_size, len(spec))
    world = runtime.start(
        with_horovod=cfg.strategy in ("data", "hybrid"),
        process_sets=_hybrid_process_sets(cfg),
    )
    # From here on every collective is covered: a rank that stops answering aborts the job.
    watchdog = Watchdog(cfg.comm_timeout, world.rank, "start-up")
    log.info(
        f"ringtrain: strategy {cfg.strategy}, {world.size} rank(s), model of {len(spec)} "
        f"elements, global batch {cfg.batch_size}"
    )
    if cfg.loop == "fit" and cfg.strategy in ("single", "data"):
        from ringtrain.dataparallel.keras_fit import fit

        metrics, weights = fit(spec, data, cfg, world, watchdog)
    else:
        engine, replicas = _engine(spec, data, cfg, world)
        metrics = loop.run(engine, data, cfg, world, replicas, watchdog)
        watchdog.kick("gathering the weights")
        weights = engine.gather_weights()
    watchdog.stop()
    if not metrics.get("finished", True):
        return TrainResult(metrics, None)
    if world.rank == 0:
        if cfg.weights_out:
            save_npz(cfg.weights_out, weights)
        if cfg.metrics_out:
            with open(cfg.metrics_out, "w") as out:
                json.dump(metrics, out, indent=1)
        log.info(
            f"final loss {metrics['final_loss']:.4f}, held-out accuracy "
            f"{metrics['test_accuracy']:.4f}, {metrics['samples_per_sec']:.0f} samples/s"
        )
    return TrainResult(metrics, weights)


def _hybrid_process_sets(cfg: TrainConfig) -> list[list[int]] | None:
    """Static Horovod process sets, one per stage, for the replicas of that stage."""
    if cfg.strategy != "hybrid" or not cfg.pp_size or cfg.pp_size == 1:
        return None
    from ringtrain.pipeline.grid import Grid

    world_size = who_am_i().world_size
    return Grid(world_size, cfg.pp_size).stage_sets()
