"""The custom-loop train step for `single` and `data`: one tf.function, gradients averaged by
Horovod when there is more than one replica."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from ringtrain.checkpoint import Checkpointable
from ringtrain.config import TrainConfig
from ringtrain.data import Dataset, shard
from ringtrain.dataparallel.collectives import average_gradients, broadcast_state
from ringtrain.evaluate import sharded_accuracy
from ringtrain.models import ModelSpec, forward, loss_fn, trainable_variables
from ringtrain.optim import make_optimizer
from ringtrain.runtime import World
from ringtrain.weights import named_weights, replica_checksums


class DataParallelEngine(Checkpointable):
    """Every rank holds the whole model and trains on its slice of each global batch."""

    def __init__(self, spec: ModelSpec, data: Dataset, cfg: TrainConfig, world: World):
        self.data, self.cfg, self.world = data, cfg, world
        self.hvd = world.hvd if world.size > 1 else None
        self.elements = spec.build(range(len(spec)), cfg.seed)
        self.variables = trainable_variables(self.elements)
        self.optimizer = make_optimizer(cfg)
        self.optimizer.build(self.variables)
        if self.hvd is not None:
            broadcast_state(self.hvd, self.variables + list(self.optimizer.variables))
        self._train_step = tf.function(self._step_graph)
        self._predict = tf.function(lambda x: tf.argmax(forward(self.elements, x), axis=-1))

    def _step_graph(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        """x holds `accumulate` slices; their averaged mean-loss gradients equal the slice's."""
        slices = self.cfg.accumulate
        grads = [tf.zeros_like(v) for v in self.variables]
        loss = tf.constant(0.0)
        for i in range(slices):
            with tf.GradientTape() as tape:
                part = loss_fn(y[i], forward(self.elements, x[i])) / slices
            grads = [g + d for g, d in zip(grads, tape.gradient(part, self.variables), strict=True)]
            loss += part
        if self.hvd is not None:  # the loss rides in the same fused allreduce: one Horovod cycle
            *grads, loss = average_gradients(self.hvd, [*grads, loss], self.cfg.fp16_allreduce)
        if self.cfg.clip_norm is not None:
            grads, _ = tf.clip_by_global_norm(grads, self.cfg.clip_norm)
        self.optimizer.apply_gradients(zip(grads, self.variables, strict=True))
        return loss

    def set_learning_rate(self, lr: float) -> None:
        self.optimizer.learning_rate.assign(lr)

    def step(self, global_indices: np.ndarray) -> float:
        local = shard(global_indices, self.world.rank, self.world.size)
        k = self.cfg.accumulate
        x = self.data.x[local].reshape(k, len(local) // k, *self.data.input_shape)
        y = self.data.y[local].reshape(k, len(local) // k)
        return float(self._train_step(x, y))

    def evaluate(self) -> float:
        predict = lambda x: self._predict(x).numpy()  # noqa: E731
        return sharded_accuracy(
            predict, self.data, self.world.comm, self.world.rank, self.world.size
        )

    def gather_weights(self) -> dict[str, np.ndarray] | None:
        """Replicas are identical, so rank 0's copy is the model."""
        return named_weights(self.elements) if self.world.rank == 0 else None

    def layout(self) -> dict:
        return {"layout": "whole model"}

    def checkpoint_part(self) -> str | None:
        """Replicas are identical, so rank 0 alone writes."""
        return "model" if self.world.rank == 0 else None

    def read_part(self) -> str:
        return "model"

    def extra_metrics(self) -> dict:
        return {"replica_checksums": replica_checksums(self.world.comm, self.variables)}

    def epoch_scalars(self) -> dict[str, float]:
        """Nothing beyond what the loop measures: data parallelism has no bubble."""
        return {}
