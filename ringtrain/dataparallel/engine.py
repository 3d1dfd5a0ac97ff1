"""Data parallelism for a user's own compiled Keras model: the model object itself trains.

Every rank holds the user's model and its compiled optimizer, starts from rank 0's weights
and slots, and takes a contiguous share of each global batch (uneven when the batch does not
divide, as an epoch's partial last batch). Its loss is rescaled so that Horovod's average of
the replicas' gradients is the gradient of the loss Keras computes over the whole batch; the
optimizer then applies it as Keras's `fit` would, with everything `compile` gave it (clipping,
schedules, weight decay). Frozen layers have no gradient, so they send no allreduce bytes.

`--accumulate K` cuts each rank's share into K contiguous slices, run one after another with
their gradients summed, each weighted by its share of the global batch (BatchNormalization
then normalises per slice, as a pipeline does per microbatch). `--bucket-mb` averages the
gradients in groups as the backward makes them, as for the built-ins.
"""

from __future__ import annotations

import time

import numpy as np

from ringtrain.checkpoint import WholeModelReplica
from ringtrain.config import TrainConfig
from ringtrain.data import UserData, uneven_shard
from ringtrain.dataparallel.collectives import average_in_buckets, buckets
from ringtrain.evaluate import score_shards
from ringtrain.gradients import add_gradients
from ringtrain.keras_model.compiled import (
    CompiledMetrics,
    base_learning_rate,
    global_loss,
    loss_share,
    predictor,
    reduction_kind,
)
from ringtrain.optim import LearningRate
from ringtrain.runtime import World
from ringtrain.tensorflow_loader import tf
from ringtrain.weights import by_path, variable_bytes


def broadcast_in_order(comm, variables: list) -> None:
    """Rank 0's values to every rank, variable by variable in the model's order. Horovod's
    broadcast matches tensors by name, and Keras names a user's optimizer by how many were made
    in the process ("adam_2"), which a script that builds another model on one rank changes."""
    for v in variables:
        value = np.array(v.numpy(), ndmin=1)  # a writable, contiguous copy; scalars as (1,)
        comm.Bcast(value, root=0)
        v.assign(value.reshape(v.shape))


class DataParallelEngine(WholeModelReplica):
    """The user's model, replicated; one compiled step per global batch."""

    def __init__(self, model, data: UserData, cfg: TrainConfig, world: World):
        self.model, self.data, self.cfg, self.world = model, data, cfg, world
        self.hvd = world.hvd if world.size > 1 else None
        self.trainable = list(model.trainable_variables)
        self.optimizer = model.optimizer
        self.variables = list(model.weights)  # what a checkpoint holds: frozen ones too
        stepping = self._stepping_optimizer()
        if world.size > 1:
            broadcast_in_order(world.comm, self.variables + self._replicated_state())
        self.kind = reduction_kind(model)
        sizes = variable_bytes(self.trainable)
        self.buckets = buckets(sizes, cfg.bucket_mb) if cfg.bucket_mb else [list(range(len(sizes)))]
        self.base_learning_rate = base_learning_rate(self.optimizer)
        self._lr = LearningRate(stepping)
        self._train_step = tf.function(self._step_graph, reduce_retracing=True)
        self._traced_step = tf.function(
            lambda slices, stop: self._step_graph(slices, stop, True), reduce_retracing=True
        )
        self.scorer = CompiledMetrics(model)
        self._predict = predictor(model)

    def _step_graph(self, slices: tuple, stop: tf.Tensor, timed: bool = False):
        """`slices` holds (x, y, share) per accumulation slice. The loss and the stop flag
        ride in the first bucket's allreduce, so every rank sees the same loss and agrees on
        stopping without a collective of its own. `timed` also returns when the backward
        ended and when each bucket's average arrived (seconds since the step began): the
        overlap trace."""
        began = [_clock(slices[0][:2])] if timed else []
        grads, loss = None, tf.constant(0.0)
        for x, y, share in slices:
            with tf.control_dependencies(began), tf.GradientTape() as tape:
                y_pred = self.model(x, training=True)
                part = global_loss(self.model, x, y, y_pred, share, 1 / len(slices))
            made = tape.gradient(part, self.trainable, unconnected_gradients="zero")
            grads = made if grads is None else add_gradients(grads, made)
            loss += tf.cast(part, loss.dtype)
        loss, stop, arrived = self._average_and_apply(grads, loss, stop)
        if not timed:
            return loss, stop
        return loss, stop, tf.stack([_clock(after) - began[0] for after in [grads, *arrived]])

    def _stepping_optimizer(self):
        """The optimizer that applies the averaged gradients, built: here the compiled one, with
        a slot for every weight on every replica."""
        self.optimizer.build(self.trainable)
        return self.optimizer

    def _replicated_state(self) -> list:
        """What every replica holds alike besides the weights: broadcast from rank 0 at start."""
        return list(self.optimizer.variables)

    def _average_and_apply(self, grads: list, loss: tf.Tensor, stop: tf.Tensor) -> tuple:
        """Average the replicas' gradients, the loss and the stop flag, and update the weights:
        (loss, stop, each bucket's averages as they arrived)."""
        arrived = []
        if self.hvd is not None:
            grads, loss, stop, arrived = average_in_buckets(
                self.hvd,
                grads,
                self.buckets,
                loss,
                stop,
                self.cfg.fp16_allreduce,
                self.world.process_set,
            )
        self.optimizer.apply_gradients(zip(grads, self.trainable, strict=True))
        return loss, stop, arrived

    def set_learning_rate(self, lr: float) -> None:
        self._lr.set(lr)

    def step(self, global_indices: np.ndarray) -> float:
        return self.step_agreeing(global_indices, False)[0]

    def reads(self, global_indices: np.ndarray) -> np.ndarray:
        return uneven_shard(global_indices, self.world.rank, self.world.size)

    def _slices(self, global_indices: np.ndarray) -> tuple:
        """This rank's share of the global batch, as (x, y, share) per accumulation slice."""
        local = self.reads(global_indices)
        slices = []
        for part in np.array_split(local, self.cfg.accumulate):
            if len(part):  # a partial batch may leave a slice empty
                share = loss_share(self.kind, len(part), len(global_indices), self.world.size)
                slices.append((*self.data.train.take(part), np.float32(share)))
        return tuple(slices)

    def step_agreeing(self, global_indices: np.ndarray, stop_requested: bool) -> tuple[float, bool]:
        """One update on the global batch `global_indices`; (its loss, whether any rank asked
        to stop)."""
        loss, anyone = self._train_step(self._slices(global_indices), np.float32(stop_requested))
        return float(loss), float(anyone) > 0

    def traced_step(self, global_indices: np.ndarray) -> dict:
        """One update, with when (ms after the step began) the backward ended and each bucket's
        average arrived: a bucket that arrives before the backward ends overlapped it."""
        _, _, times = self._traced_step(self._slices(global_indices), np.float32(0))
        ms = [float(t) * 1e3 for t in times.numpy()]
        return {"backward_end_ms": ms[0], "bucket_arrival_ms": ms[1:]}

    def evaluate(self) -> dict[str, float]:
        if self.data.validation is None:
            return {}
        world = self.world
        return score_shards(
            self.scorer, self._predict, self.data.validation, world.comm, world.rank, world.size
        )

    def gather_weights(self) -> dict[str, np.ndarray] | None:
        """Replicas are identical, so rank 0's copy is the model."""
        if self.world.rank != 0:
            return None
        return by_path(self.variables)


def _clock(after) -> tf.Tensor:
    """Seconds on the host clock once every tensor in `after` exists. tf.timestamp is stateful,
    and tf.function runs stateful ops in program order, so timestamps taken after the backward
    and after each bucket would wait for one another (and every bucket would seem to arrive
    after the backward ended). A stateless host call is ordered only by its inputs."""
    tensors = tf.nest.flatten(list(after), expand_composites=True)
    return tf.numpy_function(
        lambda *_: np.float64(time.perf_counter()), tensors, tf.float64, stateful=False
    )
