"""The Python entry point: train a model (a list of elements) on arrays with any strategy.

    from ringtrain import TrainConfig, train, mlp, load_digits
    data = load_digits()
    result = train(mlp(data.input_shape, data.n_classes), data, TrainConfig(strategy="data"))

Run it under `horovodrun`/`mpirun`/`srun`; every rank calls train() with the same arguments.
The CLI is a thin layer over this function.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from ringtrain import heartbeat, log, loop, runtime
from ringtrain.config import TrainConfig, check_paths
from ringtrain.data import Dataset, UserData, step_plan
from ringtrain.deadline import step_traffic, transfer_time
from ringtrain.errors import UserError, alike_on_every_rank
from ringtrain.guard import Watchdog, finite_on_every_rank, non_finite
from ringtrain.launch.env import who_am_i
from ringtrain.launch.keepalive import keepalive_warning
from ringtrain.models import ModelSpec
from ringtrain.validation import validate_flags, validate_user_model
from ringtrain.weights import save_npz


@dataclass
class TrainResult:
    """Metrics on every rank's return; weights only on rank 0 (None elsewhere)."""

    metrics: dict
    weights: dict[str, np.ndarray] | None


def make_engine(spec: ModelSpec, data: Dataset, cfg: TrainConfig, world: runtime.World):
    """The engine this strategy runs on, and its replica count dp_size (for LR scaling)."""
    if cfg.strategy in ("single", "data") or (cfg.strategy == "hybrid" and cfg.pp_size == 1):
        from ringtrain.dataparallel.engine import DataParallelEngine

        return DataParallelEngine(spec, data, cfg, world), world.size
    from ringtrain.pipeline.engine import PipelineEngine

    engine = PipelineEngine(spec, data, cfg, world)
    return engine, engine.grid.dp_size


def train(spec: ModelSpec, data: Dataset, cfg: TrainConfig) -> TrainResult:
    """Validate identically on every rank, start the runtime, train, write rank 0's outputs."""
    me = who_am_i()
    with alike_on_every_rank(me.rank):  # the same verdict everywhere, so no rank waits
        validate_flags(cfg, me.world_size, len(spec))
        step_plan(len(data.x), cfg.batch_size, cfg.epochs, cfg.steps)
        _check_fit(spec)
    if cfg.loop == "fit" and cfg.strategy in ("single", "data"):
        from ringtrain.dataparallel.keras_fit import fit

        return _run(
            cfg, f"model of {len(spec)} elements", lambda w, dog: fit(spec, data, cfg, w, dog)
        )
    return _run(
        cfg,
        f"model of {len(spec)} elements",
        _looped(data, cfg, lambda w: make_engine(spec, data, cfg, w)),
    )


def train_keras(
    model, data: UserData, cfg: TrainConfig, given: Collection[str] = ()
) -> TrainResult:
    """`train` for a user's own compiled Keras model, which is trained in place. `given`
    names the settings the caller chose (a compiled model refuses some of them)."""
    from ringtrain.dataparallel.keras_engine import KerasDataParallelEngine
    from ringtrain.keras_model.compiled import base_learning_rate, check_compiled

    me = who_am_i()
    with alike_on_every_rank(me.rank):
        validate_user_model(cfg, me.world_size, given)
        check_compiled(model, "the model")
        step_plan(data.n_examples, cfg.batch_size, cfg.epochs, cfg.steps, True)
        if base_learning_rate(model.optimizer) is None and (cfg.scale_lr or cfg.warmup_epochs):
            raise UserError(
                "--scale-lr and --warmup-epochs act on a constant compiled learning rate; "
                "this model's optimizer has a schedule"
            )
    engine = lambda world: (KerasDataParallelEngine(model, data, cfg, world), world.size)  # noqa: E731
    result = _run(cfg, f"Keras model {model.name!r}", _looped(data, cfg, engine))
    if cfg.save and me.rank == 0 and result.weights is not None:
        save_keras(model, cfg.save)
    return result


def _looped(data, cfg: TrainConfig, make):
    """The shared loop on the engine `make(world)` builds: (metrics, gathered weights)."""

    def run(world: runtime.World, watchdog: Watchdog):
        engine, dp_size = make(world)
        traffic = step_traffic(engine, cfg.microbatches)  # the deadline rule, for a whole step
        watchdog.allow(transfer_time(traffic, cfg.min_link_rate))
        metrics = loop.run(engine, data, cfg, world, dp_size, watchdog)
        watchdog.kick("gathering the weights")
        return metrics, engine.gather_weights()

    return run


def _run(cfg: TrainConfig, what: str, train_on) -> TrainResult:
    """Start the runtime, train with `train_on(world, watchdog)`, write rank 0's outputs."""
    check_paths(cfg)
    world = runtime.start(
        with_horovod=cfg.strategy in ("data", "hybrid"),
        process_sets=_hybrid_process_sets(cfg),
    )
    # From here on every collective is covered: a rank that stops answering aborts the job.
    watchdog = Watchdog(cfg.comm_timeout, world.rank, "start-up", cfg.startup_timeout)
    if world.size > 1:  # names the silent peer and its host when a collective stalls
        heartbeat.start(world.comm, cfg.comm_timeout, cfg.startup_timeout)
    log.info(
        f"ringtrain: strategy {cfg.strategy}, {world.size} rank(s), {what}, "
        f"global batch {cfg.batch_size}"
    )
    if world.rank == 0 and (warning := keepalive_warning()):
        log.any_rank(warning)
    metrics, weights = train_on(world, watchdog)
    if not finite_on_every_rank(world.comm, (weights or {}).values()):  # the last update's
        raise non_finite("the weights became non-finite", metrics["steps"], world.rank, None)
    watchdog.stop()
    if not metrics.get("finished", True):
        return TrainResult(metrics, None)
    if world.rank == 0:
        if cfg.weights_out:
            save_npz(cfg.weights_out, weights)
        if cfg.metrics_out:
            with open(cfg.metrics_out, "w") as out:
                json.dump(metrics, out, indent=1)
        scores = ", ".join(f"held-out {k} {v:.4f}" for k, v in metrics["held_out"].items())
        log.info(
            f"final loss {metrics['final_loss']:.4f}{', ' if scores else ''}{scores}, "
            f"{metrics['samples_per_sec']:.0f} samples/s"
        )
    return TrainResult(metrics, weights)


def save_keras(model, path: str) -> None:
    """Keras's own format, written atomically; a custom piece Keras could not find again on
    loading is named in one line, as a warning."""
    from ringtrain.keras_model.compiled import unregistered

    missing = unregistered(model)
    if missing:
        log.info(
            f"warning: --save {path}: {', '.join(missing)} not registered; loading needs "
            "@keras.saving.register_keras_serializable or custom_objects"
        )
    tmp = f"{path}.tmp-{os.getpid()}.keras"
    model.save(tmp)
    os.replace(tmp, path)


def _check_fit(spec: ModelSpec) -> None:
    """Trace the shapes through the elements, so a model that cannot take the data's rows
    (a cnn on flat features) is a bad input, not a crash inside a stage."""
    try:
        spec.shapes()
    except ValueError as exc:
        raise UserError(f"the model does not fit rows of shape {spec.input_shape}: {exc}") from None


def _hybrid_process_sets(cfg: TrainConfig) -> list[list[int]] | None:
    """Static Horovod process sets, one per pipeline rank, for the replicas of its stages."""
    if cfg.strategy != "hybrid" or not cfg.pp_size or cfg.pp_size == 1:
        return None
    from ringtrain.pipeline.grid import Grid

    world_size = who_am_i().world_size
    return Grid(world_size, cfg.pp_size).dp_groups()
