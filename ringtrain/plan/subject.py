"""What `plan calibrate` measures: a built-in model, or a user's own compiled Keras model.

measure.py asks both the same questions: the pipeline plan the executor would cut (its units,
their sizes and stages), rows of the data, a fresh optimizer like the run's for a stage's
step, and ringtrain's own data-parallel engine on the model, as `ringtrain train` would run it.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from ringtrain.config import TrainConfig, is_model_function
from ringtrain.runtime import World


class BuiltinSubject:
    """`--model mlp|cnn|transformer` on `--dataset`, with `--optimizer`."""

    def __init__(self, args: argparse.Namespace):
        from ringtrain.data import load_dataset
        from ringtrain.models import BUILTIN
        from ringtrain.pipeline.split import ElementPlan

        self.args = args
        self.data = load_dataset(args.dataset, args.seed)
        self.spec = BUILTIN[args.model](self.data.input_shape, self.data.n_classes)
        self.plan = ElementPlan(self.spec, args.seed)
        self.n_examples = len(self.data.x)

    def rows(self, samples: int) -> tuple[Any, Any]:
        at = np.arange(samples) % self.n_examples
        return self.data.x[at], self.data.y[at]

    def fresh_optimizer(self):
        import keras

        kind = keras.optimizers.SGD if self.args.optimizer == "sgd" else keras.optimizers.Adam
        return kind(learning_rate=1e-6)

    def engine(self, cfg: TrainConfig, world: World):
        from ringtrain.dataparallel.engine import DataParallelEngine

        return DataParallelEngine(self.spec, self.data, cfg, world)


class KerasSubject:
    """`--model PATH.py:FUNCTION` (with its --model-arg) on `--data` or `--dataset`."""

    def __init__(self, args: argparse.Namespace):
        from ringtrain.keras_model.graph import split_graph
        from ringtrain.keras_model.source import build_user_model, load_user_data
        from ringtrain.pipeline.split import GraphPlan

        self.args = args
        self.data = load_user_data(args.data, TrainConfig(dataset=args.dataset, seed=args.seed))
        self.model = build_user_model(args.model, args.model_arg, args.seed)
        self.plan = GraphPlan(self.model, split_graph(self.model, self.data.train.x))
        self.n_examples = self.data.n_examples

    def rows(self, samples: int) -> tuple[Any, Any]:
        return self.data.train.take(np.arange(samples) % self.n_examples)

    def fresh_optimizer(self):
        """The compiled optimizer's kind and settings (schedule, clipping), with new slots."""
        compiled = self.model.optimizer
        return type(compiled).from_config(compiled.get_config())

    def engine(self, cfg: TrainConfig, world: World):
        from ringtrain.dataparallel.keras_engine import KerasDataParallelEngine

        return KerasDataParallelEngine(self.model, self.data, cfg, world)


def subject_of(args: argparse.Namespace) -> BuiltinSubject | KerasSubject:
    return KerasSubject(args) if is_model_function(args.model) else BuiltinSubject(args)
