"""The Python entry points: `fit` a compiled Keras model as Keras's `fit` would on one
process, under any strategy; `train` is the layer beneath it (and beneath the CLI), which
takes the whole configuration at once.

    import ringtrain
    data = ringtrain.load_digits()
    model = ringtrain.mlp(data.input_shape, data.n_classes)  # or any keras.Model
    model.compile(optimizer="adam", loss=..., metrics=["accuracy"])
    ringtrain.fit(model, data.x, data.y, strategy="data", batch_size=64, epochs=2)

Run it under `horovodrun`/`mpirun`/`srun`; every rank makes the same call.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ringtrain import heartbeat, log, loop, runtime
from ringtrain.config import (
    TrainConfig,
    check_paths,
    gathers_whole_model,
    pp_size_of,
    runs_stages,
    uses_horovod,
)
from ringtrain.data import Dataset, Examples, UserData, step_plan
from ringtrain.deadline import step_traffic, transfer_time
from ringtrain.errors import UserError, alike_on_every_rank
from ringtrain.guard import Watchdog, finite_on_every_rank, non_finite
from ringtrain.launch.env import who_am_i
from ringtrain.launch.keepalive import keepalive_warning
from ringtrain.memory_check import check_memory
from ringtrain.pipeline.schedule import pipeline_schedule
from ringtrain.validation import validate_flags
from ringtrain.weights import by_path, save_npz


@dataclass
class TrainResult:
    """Metrics on every rank's return. Weights on rank 0 only (None elsewhere), and there only
    when the whole model was copied out (config.gathers_whole_model): under single and data
    for --weights-out alone, as rank 0's model is itself trained."""

    metrics: dict
    weights: dict[str, np.ndarray] | None


def train(
    model,
    data: Dataset | UserData,
    cfg: TrainConfig,
    given: Collection[str] = (),
    callbacks: Sequence = (),
) -> TrainResult:
    """Train a compiled Keras model (a built-in or the user's own) under cfg's strategy: it
    ends up trained on rank 0 (on every rank under data parallelism). Validates alike on
    every rank, starts the runtime, writes rank 0's outputs. `given` names the settings the
    caller chose (a user's compiled model refuses some of them); `callbacks` are Keras
    callbacks, run on rank 0."""
    from ringtrain.keras_model.callbacks import EpochCallbacks, check_callbacks
    from ringtrain.keras_model.compiled import base_learning_rate, check_compiled, receive_weights
    from ringtrain.keras_model.deferred import pending

    me = who_am_i()
    asked = bool(cfg.save or cfg.weights_out or cfg.initial_weights_out or callbacks)
    gathers = gathers_whole_model(cfg, asked, pending(model) is None)
    with alike_on_every_rank(me.rank):
        validate_flags(cfg, me.world_size, given)
        check_compiled(model, "the model")
        check_callbacks(callbacks)
        total, per_epoch = step_plan(
            data.n_examples, cfg.batch_size, cfg.epochs, cfg.steps, data.keeps_partial_batch
        )
        if base_learning_rate(model.optimizer) is None and (cfg.scale_lr or cfg.warmup_epochs):
            raise UserError(
                "--scale-lr and --warmup-epochs act on a constant compiled learning rate; "
                "this model's optimizer has a schedule"
            )
        if me.world_size > 1 and any(
            getattr(layer, "synchronized", False) for layer in model._flatten_layers()
        ):
            raise UserError(
                "BatchNormalization(synchronized=True) is not honoured across ranks yet; "
                "use synchronized=False (each replica normalises its own share)"
            )
        if cfg.loop == "fit":
            from ringtrain.dataparallel.keras_fit import check_fit_loop

            check_fit_loop(model, data.n_examples, cfg, me.world_size)
            if callbacks:
                raise UserError("Keras callbacks run at the epoch ends of --loop custom only")
            train_on = _fitted(model, data, cfg)
        else:
            make = engine_for(model, data, cfg, me.world_size)
        readers = (
            me.world_size // pp_size_of(cfg, me.world_size) if runs_stages(cfg) else me.world_size
        )
        if data.choose_policy(cfg.shard_policy, readers) == "file" and me.rank == 0:
            log.info(
                f"--shard-policy file: {len(data.shard_rows)} files dealt to {readers} readers"
            )
        # before the engine allocates gradients and slots
        check_memory(model, data, cfg, me, gathers, asked)
        waiting = pending(model)
        if waiting is not None and not runs_stages(cfg):  # built weightless for the check
            waiting.keep_only(set())
    hooks = None
    if callbacks:
        hooks = EpochCallbacks(callbacks, model, me.rank, -(-total // per_epoch), per_epoch)
        hooks.train_begin()
    if cfg.loop != "fit":
        train_on = _looped(data, cfg, make, hooks, gathers)
    result = _run(cfg, f"Keras model {model.name!r}", _read_alike(data, cfg, train_on))
    if runs_stages(cfg) and result.weights is not None:  # rank 0: the stages' weights
        receive_weights(model, result.weights)
    whole_here = gathers or not runs_stages(cfg)  # rank 0's model holds the trained weights
    if me.rank == 0 and result.metrics.get("finished", True) and whole_here:
        if hooks:
            hooks.train_end(_last_epoch_logs(result.metrics))
        if cfg.save:
            save_keras(model, cfg.save)
    return result


def _fitted(model, data: UserData, cfg: TrainConfig):
    """--loop fit: the user's model trained by its own model.fit on every rank."""

    def run(world: runtime.World, watchdog: Watchdog):
        from ringtrain.dataparallel.keras_fit import fit_model
        from ringtrain.keras_model.compiled import CompiledMetrics, base_learning_rate

        base = base_learning_rate(model.optimizer)
        metrics = fit_model(model, data, cfg, world, watchdog, CompiledMetrics(model), base)
        _check_finite(world, model.weights, metrics["steps"])
        return metrics, by_path(model.weights) if world.rank == 0 and cfg.weights_out else None

    return run


def _read_alike(data, cfg: TrainConfig, train_on):
    """A tf.data.Dataset must give every rank the same examples in the same order (no
    unseeded shuffle): its first global batch is compared across the ranks before training.
    Under --shard-policy off each rank's is its own: the ranks learn each other's lengths."""
    if not getattr(data, "in_order", False):
        return train_on

    def run(world: runtime.World, watchdog: Watchdog):
        if world.size > 1:
            from ringtrain.comm import Link
            from ringtrain.streamed import check_same_order, shared_lengths

            wait = Link(world.comm, cfg.comm_timeout).wait
            if data.policy == "off":
                data.stream_lengths = shared_lengths(world.comm, wait, len(data.train))
            else:
                flag = "the training data"
                check_same_order(world.comm, wait, data.train, cfg.batch_size, flag)
        return train_on(world, watchdog)

    return run


def _last_epoch_logs(metrics: dict) -> dict:
    """The last epoch's figures, as Keras hands them to on_train_end."""
    return {name: values[-1] for name, values in metrics.get("history", {}).items() if values}


def engine_for(model, data: Dataset | UserData, cfg: TrainConfig, world_size: int):
    """What builds the engine once the runtime runs; a graph that cannot be cut as asked is
    refused here, before it starts, alike on every rank. `pipeline` and `model` on one rank
    still run stages (all of them on that rank)."""
    # one replica (of the model, or of each stage) has nothing to divide
    sharded = cfg.shard_optimizer and world_size > pp_size_of(cfg, world_size)
    if sharded:
        from ringtrain.dataparallel.sharded import check_shardable

        check_shardable(model.optimizer, model.trainable_variables)
    if not runs_stages(cfg):
        from ringtrain.dataparallel.engine import DataParallelEngine

        engine = DataParallelEngine
        if sharded:
            from ringtrain.dataparallel.sharded import ShardedDataParallelEngine

            engine = ShardedDataParallelEngine
        return lambda world: (engine(model, data, cfg, world), world.size)
    from ringtrain.keras_model.graph import split_graph
    from ringtrain.pipeline.engine import PipelineEngine
    from ringtrain.pipeline.split import GraphPlan

    if model.losses or any(
        getattr(layer, "activity_regularizer", None) for layer in model._flatten_layers()
    ):
        raise UserError(
            "a model with added losses (regularisers, add_loss) runs under single and data "
            "so far, not in pipeline stages"
        )
    plan = GraphPlan(model, split_graph(model, data.train.x))
    stages = pipeline_schedule(cfg, pp_size_of(cfg, world_size)).n_stages
    plan.check_cuts(cfg.split_at.split(",") if cfg.split_at else None, stages)

    engine = PipelineEngine
    if sharded:
        from ringtrain.pipeline.sharded import ShardedPipelineEngine

        engine = ShardedPipelineEngine

    def make(world):
        built = engine(plan, data, cfg, world)
        return built, built.grid.dp_size

    return make


def _looped(data, cfg: TrainConfig, make, callbacks=None, gathers: bool = True):
    """The shared loop on the engine `make(world)` builds: (metrics, the weights gathered on
    rank 0 where `gathers`, else None)."""

    def run(world: runtime.World, watchdog: Watchdog):
        engine, dp_size = make(world)
        traffic = step_traffic(engine, cfg.microbatches)  # the deadline rule, for a whole step
        watchdog.allow(transfer_time(traffic, cfg.min_link_rate))
        metrics = loop.run(engine, data, cfg, world, dp_size, watchdog, callbacks)
        _check_finite(world, engine.variables, metrics["steps"])
        if not gathers:
            return metrics, None
        watchdog.kick("gathering the weights")
        return metrics, engine.gather_weights()

    return run


def _check_finite(world: runtime.World, variables: list, steps: int) -> None:
    """The last update's weights, each rank its own: one variable's copy at a time, so no
    rank holds a second copy of its model for it."""
    if not finite_on_every_rank(world.comm, (v.numpy() for v in variables)):
        raise non_finite("the weights became non-finite", steps, world.rank, None)


def _run(cfg: TrainConfig, what: str, train_on) -> TrainResult:
    """Start the runtime, train with `train_on(world, watchdog)`, write rank 0's outputs."""
    check_paths(cfg)
    world = runtime.start(
        with_horovod=uses_horovod(cfg),
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


def _hybrid_process_sets(cfg: TrainConfig) -> list[list[int]] | None:
    """Static Horovod process sets, one per pipeline rank, for the replicas of its stages."""
    if cfg.strategy != "hybrid" or not cfg.pp_size or cfg.pp_size == 1:
        return None
    from ringtrain.pipeline.grid import Grid

    world_size = who_am_i().world_size
    return Grid(world_size, cfg.pp_size).dp_groups()


OWN_ARGUMENTS = ("strategy", "batch_size", "epochs", "steps", "shuffle")
NOT_OPTIONS = ("model", "dataset", "synthetic_size", "synthetic_shape", *OWN_ARGUMENTS)


def fit(
    model,
    x,
    y=None,
    *,
    strategy: str = "data",
    batch_size: int,
    epochs: int | None = None,
    steps: int | None = None,
    shuffle: bool = True,
    validation_data: Any = None,
    callbacks: Sequence = (),
    **options: Any,
):
    """Train `model` on numpy arrays (dicts of them for several inputs or outputs) as Keras's
    `fit` would on one process with this global batch; return a keras.callbacks.History whose
    `history` holds the loss per epoch and, with validation_data, `val_` + each compiled
    metric. Nothing is held out of x. With shuffle=False, global batch t is examples
    [t*B, (t+1)*B) and an epoch's last batch may be partial, as in Keras. Keras `callbacks`
    run on rank 0 at epoch ends; their stop and learning-rate changes reach every rank.
    x may instead be a tf.data.Dataset of unbatched (features, label) elements (y None):
    ringtrain batches it and keeps its order, as Keras's fit does (shuffle does not apply);
    validation_data may be one too."""
    allowed = {f.name for f in fields(TrainConfig)} - set(NOT_OPTIONS)
    for name in options:
        if name not in allowed:
            raise UserError(f"fit() has no option {name!r}; it takes ringtrain train's flags")
    from ringtrain import streamed

    dataset = streamed.is_dataset(x)
    if y is None and not dataset:
        raise UserError("fit() needs y, the targets of x, as numpy arrays")
    if y is not None and dataset:
        raise UserError("fit() takes no y with a tf.data.Dataset: its elements hold the labels")
    validation = None
    if streamed.is_dataset(validation_data):
        validation = streamed.in_memory(validation_data, "validation_data")
    elif validation_data is not None:
        if not isinstance(validation_data, tuple) or len(validation_data) != 2:
            raise UserError("validation_data must be a tuple (x_val, y_val) or a Dataset")
        validation = Examples(*validation_data)
    cfg = TrainConfig(
        strategy=strategy,
        model=f"python:{model.name}",
        batch_size=batch_size,
        epochs=epochs if epochs is not None or steps is not None else 1,
        steps=steps,
        shuffle=shuffle,
        **options,
    )
    if dataset:
        data = UserData(streamed.streamed(x, batch_size, "fit()"), validation, in_order=True)
    else:
        data = UserData(Examples(x, y), validation)
    result = train(model, data, cfg, given=set(options), callbacks=callbacks or ())
    return history_of(model, result.metrics)


def history_of(model, metrics: dict):
    """The run's per-epoch figures as the History object Keras's own fit returns."""
    from ringtrain.tensorflow_loader import tf  # noqa: F401  (before Keras)

    # isort: split
    import keras

    history = keras.callbacks.History()
    history.set_model(model)
    history.history = metrics.get("history", {})
    history.epoch = list(range(len(history.history.get("loss", []))))
    history.params = {"epochs": metrics.get("epochs"), "steps": metrics.get("steps")}
    return history
