"""The custom-loop train step for `single` and `data`: one tf.function, gradients averaged by
Horovod when there is more than one replica, in one fused allreduce after the backward or, with
--bucket-mb, in buckets that start while the backward still runs."""

from __future__ import annotations

import time

import numpy as np

from ringtrain.checkpoint import WholeModelReplica
from ringtrain.config import TrainConfig
from ringtrain.data import Dataset, shard
from ringtrain.dataparallel.collectives import average_in_buckets, broadcast_state, buckets
from ringtrain.evaluate import AccuracyScorer, score_shards
from ringtrain.models import ModelSpec, forward, loss_fn, trainable_variables
from ringtrain.optim import LearningRate, make_optimizer
from ringtrain.runtime import World
from ringtrain.tensorflow_loader import tf
from ringtrain.weights import named_weights, variable_bytes


class DataParallelEngine(WholeModelReplica):
    """Every rank holds the whole model and trains on its slice of each global batch."""

    def __init__(self, spec: ModelSpec, data: Dataset, cfg: TrainConfig, world: World):
        self.data, self.cfg, self.world = data, cfg, world
        self.train = data.train
        self.hvd = world.hvd if world.size > 1 else None
        self.elements = spec.build(range(len(spec)), cfg.seed)
        self.variables = trainable_variables(self.elements)
        self.optimizer = make_optimizer(cfg)
        self.optimizer.build(self.variables)
        if self.hvd is not None:
            broadcast_state(self.hvd, self.variables + list(self.optimizer.variables))
        sizes = variable_bytes(self.variables)
        self.buckets = buckets(sizes, cfg.bucket_mb) if cfg.bucket_mb else [list(range(len(sizes)))]
        self._train_step = tf.function(self._step_graph)
        self._traced_step = tf.function(lambda x, y, stop: self._step_graph(x, y, stop, True))
        self._predict = tf.function(lambda x: forward(self.elements, x))
        self._lr = LearningRate(self.optimizer)

    def _step_graph(self, x: tf.Tensor, y: tf.Tensor, stop: tf.Tensor, timed: bool = False):
        """x holds `accumulate` slices; their averaged mean-loss gradients equal the slice's.

        The stop flag and the loss ride in the first bucket's allreduce, so the step needs no
        collective of its own to agree on stopping; every rank sees the same averaged loss, so
        all judge its finiteness alike. `timed` also returns when the backward ended and when
        each bucket's average arrived (seconds since the step began): the overlap trace."""
        began = [_clock([x])] if timed else []
        slices = self.cfg.accumulate
        grads = [tf.zeros_like(v) for v in self.variables]
        loss = tf.constant(0.0)
        for i in range(slices):
            with tf.control_dependencies(began), tf.GradientTape() as tape:
                part = loss_fn(y[i], forward(self.elements, x[i])) / slices
            grads = [g + d for g, d in zip(grads, tape.gradient(part, self.variables), strict=True)]
            loss += part
        raw, arrived = grads, []
        if self.hvd is not None:
            grads, loss, stop, arrived = average_in_buckets(
                self.hvd, raw, self.buckets, loss, stop, self.cfg.fp16_allreduce
            )
        if self.cfg.clip_norm is not None:
            grads, _ = tf.clip_by_global_norm(grads, self.cfg.clip_norm)
        self.optimizer.apply_gradients(zip(grads, self.variables, strict=True))
        if not timed:
            return loss, stop
        return loss, stop, tf.stack([_clock(after) - began[0] for after in [raw, *arrived]])

    @property
    def base_learning_rate(self) -> float:
        return self.cfg.lr

    def set_learning_rate(self, lr: float) -> None:
        self._lr.set(lr)

    def _inputs(self, global_indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        local = shard(global_indices, self.world.rank, self.world.size)
        k = self.cfg.accumulate
        x, y = self.train.take(local)
        return x.reshape(k, len(local) // k, *self.data.input_shape), y.reshape(k, len(local) // k)

    def step(self, global_indices: np.ndarray) -> float:
        return self.step_agreeing(global_indices, False)[0]

    def step_agreeing(self, global_indices: np.ndarray, stop_requested: bool) -> tuple[float, bool]:
        """One update; (the job's loss, whether any rank asked to stop)."""
        loss, anyone = self._train_step(*self._inputs(global_indices), np.float32(stop_requested))
        return float(loss), float(anyone) > 0

    def traced_step(self, global_indices: np.ndarray) -> dict:
        """One update, with when (ms after the step began) the backward ended and each bucket's
        average arrived: a bucket that arrives before the backward ends overlapped it."""
        _, _, times = self._traced_step(*self._inputs(global_indices), np.float32(0))
        ms = [float(t) * 1e3 for t in times.numpy()]
        return {"backward_end_ms": ms[0], "bucket_arrival_ms": ms[1:]}

    def evaluate(self) -> dict[str, float]:
        world = self.world
        return score_shards(
            AccuracyScorer(),
            self._predict,
            self.data.validation,
            world.comm,
            world.rank,
            world.size,
        )

    def gather_weights(self) -> dict[str, np.ndarray] | None:
        """Replicas are identical, so rank 0's copy is the model."""
        return named_weights(self.elements) if self.world.rank == 0 else None


def _clock(after: list) -> tf.Tensor:
    """Seconds on the host clock once every tensor in `after` exists. tf.timestamp is stateful,
    and tf.function runs stateful ops in program order, so timestamps taken after the backward
    and after each bucket would wait for one another (and every bucket would seem to arrive
    after the backward ended). A stateless host call is ordered only by its inputs."""
    return tf.numpy_function(
        lambda *_: np.float64(time.perf_counter()), after, tf.float64, stateful=False
    )
