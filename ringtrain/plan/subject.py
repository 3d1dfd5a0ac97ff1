"""What `plan calibrate` measures: a compiled Keras model, a built-in's or a user's own.

measure.py asks it the same questions either way: the pipeline plan the executor would cut
(its units, their sizes and stages), rows of the data, a fresh optimizer like the run's for a
stage's step, and ringtrain's own data-parallel engine on the model, as `ringtrain train`
would run it.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from ringtrain.config import TrainConfig, is_model_function
from ringtrain.runtime import World


class Subject:
    """`--model mlp|cnn|transformer` on `--dataset` with `--optimizer`, or `--model
    PATH.py:FUNCTION` (with its --model-arg) on `--data` or `--dataset`."""

    def __init__(self, args: argparse.Namespace):
        from ringtrain.keras_model.graph import split_graph
        from ringtrain.pipeline.split import GraphPlan

        self.args = args
        cfg = TrainConfig(
            model=args.model,
            dataset=args.dataset,
            seed=args.seed,
            optimizer=args.optimizer or TrainConfig.optimizer,
        )
        if is_model_function(args.model):
            from ringtrain.keras_model.source import build_user_model, load_user_data

            self.data = load_user_data(args.data, cfg)
            self.model = build_user_model(args.model, args.model_arg, args.seed)
        else:
            from ringtrain.data import load_dataset
            from ringtrain.models import builtin

            self.data = load_dataset(args.dataset, args.seed)
            self.model = builtin(cfg, self.data.input_shape, self.data.n_classes)
        self.plan = GraphPlan(self.model, split_graph(self.model, self.data.train.x))
        self.n_examples = self.data.n_examples

    def rows(self, samples: int) -> tuple[Any, Any]:
        return self.data.train.take(np.arange(samples) % self.n_examples)

    def fresh_optimizer(self):
        """The compiled optimizer's kind and settings (schedule, clipping), with new slots."""
        compiled = self.model.optimizer
        return type(compiled).from_config(compiled.get_config())

    def engine(self, cfg: TrainConfig, world: World):
        from ringtrain.dataparallel.engine import DataParallelEngine

        return DataParallelEngine(self.model, self.data, cfg, world)
