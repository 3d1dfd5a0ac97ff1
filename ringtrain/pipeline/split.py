"""What a pipeline's stages are cut from: a compiled Keras model's graph (a built-in's too).

The executor asks the plan how many units the model has (the blocks of its graph between
valid cuts, which a partition groups into stages), what each unit costs, how to build stage s
from units [a, b), and how the values crossing each boundary travel (`codec`).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable

import numpy as np

from ringtrain.config import TrainConfig
from ringtrain.keras_model import compiled, deferred
from ringtrain.pipeline.ir import Op, Tensor
from ringtrain.pipeline.profile import time_unit, untouched
from ringtrain.pipeline.stage import Stage, is_float
from ringtrain.tensorflow_loader import tf


class GraphPlan:
    """A compiled Sequential or functional model, cut between the blocks of its flattened graph.
    A stage is a keras.Model over its cut tensors, sharing the user's layers (and so their
    weights and names). A model built weightless gets values for this rank's stages only."""

    def __init__(self, model, split):
        self.model, self.split = model, split
        self.kind = compiled.reduction_kind(model)
        self._pieces: dict[tuple, list] = {}
        self._codecs: dict[tuple, tuple] = {}

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
        seed) is put back, so timing leaves the run's weights as they were. On a model built
        weightless a unit holds its values only while it is timed."""
        timings = []
        bounds = [(i, i + 1) for i in range(self.n_units)]
        for i in range(self.n_units):
            stage = self.build(i, bounds, 1)
            with deferred.held(self.model, stage.weights), untouched(stage):
                timings.append(time_unit(stage, self.stand_in(bounds, i, samples)))
            del stage
            gc.collect()  # its compiled calls, and with them the values they captured
        return timings

    def hold_only(self, stages: Iterable[int], bounds: list[tuple[int, int]]) -> None:
        """On a model built weightless, materialize what this rank holds (its stages' weights,
        the optimizer's and the metrics' variables) and nothing of the other stages'."""
        waiting = deferred.pending(self.model)
        if waiting is not None:
            mine = set(stages)
            pieces = self.pieces(bounds)
            others = {id(v) for s, p in enumerate(pieces) if s not in mine for v in p.weights}
            waiting.keep_only(others)

    def stand_in(self, bounds: list[tuple[int, int]], s: int, samples: int) -> tuple:
        """Values of stage s's input tensors' shapes and dtypes, for timing it alone: normal
        floats, and ones for integer inputs (token ids, masks)."""
        return tuple(_stand_in(t, samples) for t in self.pieces(bounds)[s].inputs)

    def pieces(self, bounds: list[tuple[int, int]]) -> list:
        key = tuple(bounds)
        if key not in self._pieces:
            self._pieces[key] = self.split.stage_models(bounds)
        return self._pieces[key]

    def build(self, s: int, bounds: list[tuple[int, int]], microbatches: int) -> Stage:
        return Stage(s, len(bounds), self.pieces(bounds)[s], self.model, microbatches)

    def codec(self, t: Tensor, bounds: list[tuple[int, int]]):
        """Made once per stage: every message asks, and reading a piece's tensors is slow."""
        key = (t.stage, tuple(bounds))
        if key not in self._codecs:
            self._codecs[key] = Stage.codecs_of(self.pieces(bounds)[t.stage])
        sends, gradients = self._codecs[key]
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
