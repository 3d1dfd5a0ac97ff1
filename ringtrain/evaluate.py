"""Held-out scores computed in shards: each rank scores a strided share, counts are summed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

CHUNK = 512  # held-out examples per forward pass


def score_shards(scorer, predict: Callable, examples, comm, part: int, parts: int) -> dict:
    """Each of `parts` ranks scores a strided share of the held-out examples with the whole
    model (`predict` maps a chunk's features to its outputs); comm must include every part.
    `scorer` holds the compiled metrics (keras_model.compiled.CompiledMetrics)."""
    scorer.reset()
    mine = np.arange(len(examples))[part::parts]
    for start in range(0, len(mine), CHUNK):
        x, y = examples.take(mine[start : start + CHUNK])
        scorer.update(predict(x), y)
    return scorer.result(comm)
