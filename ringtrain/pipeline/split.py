"""What a pipeline's stages are cut from: ringtrain's built-in element lists, or a user's graph.

The executor asks a plan the same questions either way: how many units the model has (the
pieces a partition groups into stages: elements, or blocks of a graph between valid cuts),
what each unit costs, how to build stage s from units [a, b), and how the values crossing
each boundary travel (`codec`).
"""

from __future__ import annotations

import numpy as np

from ringtrain.config import TrainConfig
from ringtrain.evaluate import AccuracyScorer
from ringtrain.keras_model import compiled
from ringtrain.models import ModelSpec
from ringtrain.optim import make_optimizer
from ringtrain.pipeline.ir import Op, Tensor
from ringtrain.pipeline.profile import time_unit, untouched
from ringtrain.pipeline.stage import FloatCodec, KerasStage, Stage, is_float
from ringtrain.tensorflow_loader import tf


class ElementPlan:
    """A built-in model: elements of one float tensor in and out, equal microbatches."""

    even_microbatches = True

    def __init__(self, spec: ModelSpec, seed: int):
        self.spec, self.seed, self.shapes = spec, seed, spec.shapes()

    @property
    def n_units(self) -> int:
        return len(self.spec)

    def unit_params(self) -> list[float]:
        """Each element's parameter count; elements are built one at a time and dropped."""
        counts = []
        for i in range(len(self.spec)):
            element = self.spec.build([i], self.seed)[0]
            counts.append(float(sum(int(np.prod(v.shape)) for v in element.trainable_weights)))
        return counts

    def boundary_words(self) -> list[float]:
        """Per example, 4-byte words entering each element, then leaving the last."""
        return [float(np.prod(shape)) for shape in self.shapes]

    def unit_seconds(self, samples: int) -> list[dict[Op, float]]:
        """Each element's F, B, BI and BW on `samples` examples, built alone and dropped."""
        bounds = [(i, i + 1) for i in range(len(self.spec))]
        return [
            time_unit(self.build(i, bounds, 1), self.stand_in(bounds, i, samples))
            for i in range(len(bounds))
        ]

    def stand_in(self, bounds: list[tuple[int, int]], s: int, samples: int):
        """An input of stage s's shape, for timing it alone."""
        return tf.random.normal((samples, *self.shapes[bounds[s][0]]))

    def build(self, s: int, bounds: list[tuple[int, int]], microbatches: int) -> Stage:
        elements = self.spec.build(range(*bounds[s]), self.seed)
        return Stage(s, len(bounds), elements, microbatches)

    def codec(self, t: Tensor, bounds: list[tuple[int, int]]) -> FloatCodec:
        """Stage t.stage's output (ACT) or the gradient for its input (GRAD)."""
        first, last = bounds[t.stage]
        return FloatCodec(self.shapes[last if t.kind == "ACT" else first])

    def optimizer(self, cfg: TrainConfig):
        """(--optimizer at --lr, the global-norm clip --clip-norm sets across the stages)."""
        return make_optimizer(cfg), cfg.clip_norm

    def base_learning_rate(self, _optimizer, cfg: TrainConfig) -> float:
        return cfg.lr

    def loss_share(self, _local: int, _total: int, _replicas: int) -> None:
        """Equal microbatches: each carries 1/M of its replica's mean loss (Stage says so)."""
        return None

    def scorer(self) -> AccuracyScorer:
        return AccuracyScorer()


class GraphPlan:
    """A user's compiled functional model, cut between the blocks of its flattened graph.
    Every rank builds the whole model here; a stage is a keras.Model over its cut tensors,
    sharing the user's layers (and so their weights and names)."""

    even_microbatches = False  # a partial batch makes uneven microbatches, as in Keras's fit

    def __init__(self, model, split):
        self.model, self.split = model, split
        self.kind = compiled.reduction_kind(model)
        self._pieces: dict[tuple, list] = {}

    @property
    def n_units(self) -> int:
        return len(self.split.blocks)

    def unit_params(self) -> list[float]:
        return [float(block.params) for block in self.split.blocks]

    def boundary_words(self) -> list[float]:
        """Per example, 4-byte words crossing into each block (a mask with the hidden states),
        then the model's outputs."""
        split, n = self.split, self.n_units
        crossing = [
            split.flat.inputs
            if i == 0
            else split.flat.outputs
            if i == n
            else split.crossing(split.block_starts[i])
            for i in range(n + 1)
        ]
        return [
            sum(float(np.prod(t.shape[1:])) * np.dtype(str(t.dtype)).itemsize / 4 for t in ts)
            for ts in crossing
        ]

    def unit_seconds(self, samples: int) -> list[dict[Op, float]]:
        """Each block's F, B, BI and BW on `samples` examples, as a one-block stage model on
        stand-in inputs: normal floats, and ones for integer inputs (token ids, masks). The
        state a training forward moves (BatchNormalization's moving statistics, dropout's
        seed) is put back, so timing leaves the run's weights as they were."""
        timings = []
        bounds = [(i, i + 1) for i in range(self.n_units)]
        for i in range(self.n_units):
            stage = self.build(i, bounds, 1)
            with untouched(stage):
                timings.append(time_unit(stage, self.stand_in(bounds, i, samples)))
        return timings

    def stand_in(self, bounds: list[tuple[int, int]], s: int, samples: int) -> tuple:
        """Values of stage s's input tensors' shapes and dtypes, for timing it alone: normal
        floats, and ones for integer inputs (token ids, masks)."""
        return tuple(_stand_in(t, samples) for t in self.pieces(bounds)[s].inputs)

    def pieces(self, bounds: list[tuple[int, int]]) -> list:
        key = tuple(bounds)
        if key not in self._pieces:
            self._pieces[key] = self.split.stage_models(bounds)
        return self._pieces[key]

    def build(self, s: int, bounds: list[tuple[int, int]], microbatches: int) -> KerasStage:
        return KerasStage(s, len(bounds), self.pieces(bounds)[s], self.model, microbatches)

    def codec(self, t: Tensor, bounds: list[tuple[int, int]]):
        piece = self.pieces(bounds)[t.stage]
        sends, gradients = KerasStage.codecs_of(piece)
        return sends if t.kind == "ACT" else gradients

    def optimizer(self, _cfg: TrainConfig):
        """The compiled optimizer, over this rank's stages. Its global_clipnorm would clip by
        a stage's own norm, so the executor clips by the norm across stages instead."""
        optimizer = self.model.optimizer
        limit, optimizer.global_clipnorm = optimizer.global_clipnorm, None
        return optimizer, limit

    def base_learning_rate(self, optimizer, _cfg: TrainConfig) -> float | None:
        return compiled.base_learning_rate(optimizer)

    def loss_share(self, local: int, total: int, replicas: int) -> float:
        return compiled.loss_share(self.kind, local, total, replicas)

    def scorer(self):
        return compiled.CompiledMetrics(self.model)

    def split_at(self, names: list[str], n_stages: int):
        return self.split.bounds_at(names, n_stages)

    def check_cuts(self, names: list[str] | None, n_stages: int) -> None:
        """The cuts asked for exist: --split-at's layers, or enough blocks for the stages."""
        if names:
            self.split.bounds_at(names, n_stages)
        else:
            self.split.check(n_stages)


def _stand_in(tensor, samples: int):
    """A value of a symbolic tensor's per-example shape and dtype, for timing."""
    shape = (samples, *(int(d) for d in tensor.shape[1:]))
    if is_float(tensor.dtype):
        return tf.random.normal(shape, dtype=str(tensor.dtype))
    return tf.ones(shape, dtype=str(tensor.dtype))
