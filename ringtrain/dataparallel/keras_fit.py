"""Data parallelism through `model.fit`: an optimizer wrapper and Keras-3-native callbacks.

Horovod's own Keras callbacks break under Keras 3 (keras.backend.get_value is gone), so these
replace them: broadcast of the initial state, epoch-metric averaging, LR scaling with warm-up.
"""

from __future__ import annotations

import math
import time

from ringtrain import tensorflow_loader  # noqa: F401  (before Keras: keeps scikit-learn out)

# isort: split
import keras
import numpy as np

from ringtrain import log
from ringtrain.config import TrainConfig
from ringtrain.data import Dataset, epoch_batches, shard, step_plan
from ringtrain.dataparallel.collectives import average_gradients, broadcast_state
from ringtrain.evaluate import AccuracyScorer, score_shards
from ringtrain.guard import Watchdog, non_finite
from ringtrain.models import ModelSpec
from ringtrain.optim import learning_rate, make_optimizer
from ringtrain.runtime import World
from ringtrain.weights import named_weights, replica_checksums, save_npz


def distributed_optimizer(optimizer: keras.optimizers.Optimizer, hvd, fp16: bool = False):
    """The same optimizer, but its gradients are ring-allreduce averaged before each update."""
    base = type(optimizer)

    class Distributed(base):
        def apply_gradients(self, grads_and_vars):
            grads, variables = zip(*grads_and_vars, strict=True)
            grads = average_gradients(hvd, list(grads), fp16=fp16)
            return super().apply_gradients(zip(grads, variables, strict=True))

    Distributed.__name__ = f"Distributed{base.__name__}"
    return Distributed.from_config(optimizer.get_config())


class BroadcastInitialState(keras.callbacks.Callback):
    """Rank 0's weights and optimizer slots reach every rank before the first update."""

    def __init__(self, hvd):
        super().__init__()
        self.hvd, self.done = hvd, False

    def on_train_begin(self, logs=None):
        if self.done:
            return
        optimizer = self.model.optimizer
        if not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        broadcast_state(self.hvd, list(self.model.variables) + list(optimizer.variables))
        self.done = True


class MetricAverage(keras.callbacks.Callback):
    """Epoch metrics are averaged over ranks, so rank 0 reports the job, not its own shard."""

    def __init__(self, hvd):
        super().__init__()
        self.hvd = hvd

    def on_epoch_end(self, epoch, logs=None):
        for key in sorted(logs or {}):
            logs[key] = float(self.hvd.allreduce(np.float64(logs[key]), op=self.hvd.Average))


class LearningRateWarmup(keras.callbacks.Callback):
    """Sets the LR before each batch from ringtrain's shared rule (scale and warm-up)."""

    def __init__(self, cfg: TrainConfig, dp_size: int, steps_per_epoch: int, first_step: int = 0):
        super().__init__()
        self.cfg, self.dp_size, self.per_epoch = cfg, dp_size, steps_per_epoch
        self.step = first_step

    def on_train_batch_begin(self, batch, logs=None):
        lr = learning_rate(self.cfg, self.step / self.per_epoch, self.dp_size)
        self.model.optimizer.learning_rate.assign(lr)
        self.step += 1


class LossRecorder(keras.callbacks.Callback):
    """Per-step losses averaged over ranks: the series the custom loop reports.

    Keras logs a running mean per epoch; with equal batches, step t's own loss is
    t * mean_t - (t - 1) * mean_(t-1).
    """

    def __init__(self, hvd):
        super().__init__()
        self.hvd, self.losses, self.previous_mean = hvd, [], 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self.previous_mean = 0.0

    def on_train_batch_end(self, batch, logs=None):
        mean = float(logs["loss"])
        loss = np.float64((batch + 1) * mean - batch * self.previous_mean)
        self.previous_mean = mean
        if self.hvd is not None:
            loss = self.hvd.allreduce(loss, op=self.hvd.Average)
        self.losses.append(float(loss))
        if not math.isfinite(self.losses[-1]):  # averaged, so every rank stops at this step
            what = f"the loss became non-finite ({self.losses[-1]})"
            rank = self.hvd.rank() if self.hvd is not None else 0
            raise non_finite(what, len(self.losses), rank, None)


class KickWatchdog(keras.callbacks.Callback):
    """Each finished batch tells the watchdog the job is alive."""

    def __init__(self, watchdog: Watchdog):
        super().__init__()
        self.watchdog = watchdog

    def on_train_batch_end(self, batch, logs=None):
        self.watchdog.settle(f"batch {batch + 1} of model.fit")


class ShowProgress(keras.callbacks.Callback):
    """Feeds each batch's loss to the epoch's progress (a bar on rank 0, or nothing)."""

    progress: log.EpochProgress

    def on_train_batch_end(self, batch, logs=None):
        self.progress.update(float(logs["loss"]))


def fit(spec: ModelSpec, data: Dataset, cfg: TrainConfig, world: World, watchdog: Watchdog):
    """Train with model.fit on this rank's slice of every global batch, in the shared order."""
    hvd = world.hvd if world.size > 1 else None
    elements = spec.build(range(len(spec)), cfg.seed)
    if cfg.initial_weights_out and world.rank == 0:  # BroadcastInitialState sends these
        save_npz(cfg.initial_weights_out, named_weights(elements))
    model = keras.Sequential([keras.Input(data.input_shape), *elements])
    optimizer = make_optimizer(cfg)
    if hvd is not None:
        optimizer = distributed_optimizer(optimizer, hvd, cfg.fp16_allreduce)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    total, per_epoch = step_plan(len(data.x), cfg.batch_size, cfg.epochs, cfg.steps)
    recorder = LossRecorder(hvd)
    shown = ShowProgress()
    callbacks = [
        recorder,
        LearningRateWarmup(cfg, world.size, per_epoch),
        KickWatchdog(watchdog),
        shown,
    ]
    if hvd is not None:
        callbacks += [BroadcastInitialState(hvd), MetricAverage(hvd)]
    local_batch = cfg.batch_size // world.size
    started = time.perf_counter()
    n_epochs, style = -(-total // per_epoch), log.progress_style(cfg.progress, world.launcher)
    for epoch in range(n_epochs):
        steps = min(per_epoch, total - epoch * per_epoch)
        shown.progress = log.EpochProgress(style, f"epoch {epoch + 1}/{n_epochs}", steps)
        order = epoch_batches(len(data.x), cfg.batch_size, cfg.seed, epoch)[:steps]
        local = np.concatenate([shard(b, world.rank, world.size) for b in order])
        history = model.fit(
            data.x[local],
            data.y[local],
            batch_size=local_batch,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
        shown.progress.end(
            {"loss": history.history["loss"][0], "train accuracy": history.history["accuracy"][0]}
        )
    seconds = time.perf_counter() - started
    predict = lambda x: model.predict(x, verbose=0)  # noqa: E731
    held_out = data.validation
    scores = score_shards(AccuracyScorer(), predict, held_out, world.comm, world.rank, world.size)
    accuracy = scores["accuracy"]
    metrics = {
        "strategy": cfg.strategy,
        "world_size": world.size,
        "steps": total,
        "loop": "fit",
        "global_batch": cfg.batch_size,
        "losses": recorder.losses,
        "final_loss": recorder.losses[-1],
        "test_accuracy": accuracy,
        "held_out": {"accuracy": accuracy},
        "samples_per_sec": cfg.batch_size * total / seconds,
        "seconds": seconds,
        "config": cfg.as_dict(),
        "replica_checksums": replica_checksums(world.comm, model.trainable_variables),
    }
    return metrics, named_weights(elements) if world.rank == 0 else None
