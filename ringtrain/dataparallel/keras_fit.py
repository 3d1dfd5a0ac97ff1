"""Data parallelism through `model.fit`: an optimizer wrapper and Keras-3-native callbacks.

Horovod's own Keras callbacks break under Keras 3 (keras.backend.get_value is gone), so these
replace them: broadcast of the initial state, epoch-metric averaging, LR scaling with warm-up.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext

from ringtrain import tensorflow_loader  # noqa: F401  (before Keras: keeps scikit-learn out)

# isort: split
import keras
import numpy as np

from ringtrain import log
from ringtrain.config import TrainConfig
from ringtrain.data import READS, shard, step_plan
from ringtrain.dataparallel.collectives import average_gradients, broadcast_state
from ringtrain.dataparallel.engine import broadcast_in_order
from ringtrain.errors import UserError
from ringtrain.evaluate import score_shards
from ringtrain.guard import Watchdog, non_finite
from ringtrain.keras_model.compiled import predictor, reduction_kind
from ringtrain.loop import input_wait
from ringtrain.optim import LearningRate, learning_rate
from ringtrain.runtime import World
from ringtrain.weights import by_path, replica_checksums, save_npz


def _averaging(base: type, hvd, fp16: bool) -> type:
    """`base`, but its gradients are ring-allreduce averaged before each update."""

    class Distributed(base):
        def apply_gradients(self, grads_and_vars):
            grads, variables = zip(*grads_and_vars, strict=True)
            grads = average_gradients(hvd, list(grads), fp16=fp16)
            return super().apply_gradients(zip(grads, variables, strict=True))

    Distributed.__name__ = f"Distributed{base.__name__}"
    return Distributed


def distributed_optimizer(optimizer: keras.optimizers.Optimizer, hvd, fp16: bool = False):
    """A new optimizer like `optimizer` whose gradients are averaged over the ranks."""
    return _averaging(type(optimizer), hvd, fp16).from_config(optimizer.get_config())


@contextmanager
def averaging_gradients(model, hvd, fp16: bool = False):
    """The model's own compiled optimizer averages its gradients over the ranks while inside:
    its class is swapped, so its state and everything `compile` set stay as they are. Keras's
    traced train step is dropped on entry and exit, so neither side sees the other's."""
    optimizer = model.optimizer
    base = type(optimizer)
    optimizer.__class__ = _averaging(base, hvd, fp16)
    model.train_function = None
    try:
        yield
    finally:
        optimizer.__class__ = base
        model.train_function = None


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

    def __init__(
        self,
        cfg: TrainConfig,
        dp_size: int,
        steps_per_epoch: int,
        base: float | None = None,
    ):
        """`base`: a compiled constant rate (None: --lr)."""
        super().__init__()
        self.cfg, self.dp_size, self.per_epoch, self.base = cfg, dp_size, steps_per_epoch, base
        self.step = 0
        self.rate: LearningRate | None = None

    def on_train_batch_begin(self, batch, logs=None):
        if self.rate is None:
            self.rate = LearningRate(self.model.optimizer)
        self.rate.set(learning_rate(self.cfg, self.step / self.per_epoch, self.dp_size, self.base))
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


def check_fit_loop(model, n_examples: int, cfg: TrainConfig, world_size: int) -> None:
    """What model.fit on each rank's share cannot make exact: Horovod's average of the ranks'
    mean losses is the global batch's mean only when the shares are equal and the loss a mean."""
    if world_size == 1:
        return
    if reduction_kind(model) != "mean":
        raise UserError(
            "--loop fit averages the ranks' losses, which a loss with reduction='sum' does not "
            "allow; use --loop custom"
        )
    total, per_epoch = step_plan(n_examples, cfg.batch_size, cfg.epochs, cfg.steps, True)
    sizes = {cfg.batch_size} | ({n_examples % cfg.batch_size} if total >= per_epoch else set())
    uneven = sorted(size for size in sizes if size % world_size)
    if uneven:
        raise UserError(
            f"--loop fit needs every global batch to divide among the {world_size} ranks, but "
            f"one holds {uneven[0]} examples; use --loop custom, or another --batch-size"
        )


def fit_model(
    model,
    data,
    cfg: TrainConfig,
    world: World,
    watchdog: Watchdog,
    scorer,
    base_lr: float | None,
) -> dict:
    """Train a compiled model with its own model.fit on this rank's share of every global
    batch, in the shared order; every rank starts from rank 0's weights and slots, and the
    optimizer averages the gradients. `scorer` scores the held-out examples; `base_lr` is the
    constant rate --scale-lr and --warmup-epochs act on (None: a schedule rules)."""
    hvd = world.hvd if world.size > 1 else None
    model.optimizer.build(model.trainable_variables)
    if world.size > 1:
        broadcast_in_order(world.comm, list(model.weights) + list(model.optimizer.variables))
    if cfg.initial_weights_out and world.rank == 0:
        save_npz(cfg.initial_weights_out, by_path(model.trainable_weights))
    n_examples, keep_partial = data.n_examples, data.keeps_partial_batch
    total, per_epoch = step_plan(n_examples, cfg.batch_size, cfg.epochs, cfg.steps, keep_partial)
    recorder, shown = LossRecorder(hvd), ShowProgress()
    callbacks = [recorder, KickWatchdog(watchdog), shown]
    if base_lr is not None:
        callbacks.append(LearningRateWarmup(cfg, world.size, per_epoch, base_lr))
    if hvd is not None:
        callbacks.append(MetricAverage(hvd))
    history: dict[str, list[float]] = {"loss": []}
    predict = predictor(model)
    held_out, started, waited = {}, time.perf_counter(), 0.0
    n_epochs, style = -(-total // per_epoch), log.progress_style(cfg.progress, world.launcher)
    with averaging_gradients(model, hvd, cfg.fp16_allreduce) if hvd else nullcontext():
        for epoch in range(n_epochs):
            steps = min(per_epoch, total - epoch * per_epoch)
            shown.progress = log.EpochProgress(style, f"epoch {epoch + 1}/{n_epochs}", steps)
            order = data.epoch_order(cfg.batch_size, cfg.seed, epoch, cfg.shuffle)
            local = np.concatenate([shard(b, world.rank, world.size) for b in order[:steps]])
            READS.lap()
            x, y = data.train.take(local)
            waited += READS.lap()
            model.fit(
                x,
                y,
                batch_size=cfg.batch_size // world.size,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
            watchdog.kick(f"evaluation after epoch {epoch + 1}")
            held_out = (
                score_shards(scorer, predict, data.validation, world.comm, world.rank, world.size)
                if data.validation is not None
                else {}
            )
            epoch_loss = float(np.mean(recorder.losses[epoch * per_epoch :]))
            history["loss"].append(epoch_loss)
            for name, value in held_out.items():
                history.setdefault(f"val_{name}", []).append(value)
            shown.progress.end(
                {"loss": epoch_loss, **{f"held-out {k}": v for k, v in held_out.items()}}
            )
    seconds = time.perf_counter() - started
    return {
        "strategy": cfg.strategy,
        "world_size": world.size,
        "steps": total,
        "loop": "fit",
        "epochs": n_epochs,
        "global_batch": cfg.batch_size,
        "losses": recorder.losses,
        "final_loss": recorder.losses[-1],
        "test_accuracy": held_out.get("accuracy", float("nan")),
        "held_out": held_out,
        "history": history,
        "samples_per_sec": cfg.batch_size * total / seconds,
        "seconds": seconds,
        "config": cfg.as_dict(),
        "replica_checksums": replica_checksums(world.comm, model.trainable_variables),
        **input_wait(world.comm, waited, seconds),
    }
