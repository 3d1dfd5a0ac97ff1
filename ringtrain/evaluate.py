"""Held-out scores computed in shards: each rank scores a strided share, counts are summed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

CHUNK = 512  # held-out examples per forward pass


def score_shards(scorer, predict: Callable, examples, comm, part: int, parts: int) -> dict:
    """Each of `parts` ranks scores a strided share of the held-out examples with the whole
    model (`predict` maps a chunk's features to its outputs); comm must include every part.
    `scorer` is an AccuracyScorer or a user's compiled metrics."""
    scorer.reset()
    mine = np.arange(len(examples))[part::parts]
    for start in range(0, len(mine), CHUNK):
        x, y = examples.take(mine[start : start + CHUNK])
        scorer.update(predict(x), y)
    return scorer.result(comm)


def count_accuracy(comm, correct: int, total: int) -> float:
    """Sum (correct, total) over every rank of comm; ranks that scored nothing pass zeros."""
    counts = np.array([correct, total], dtype=np.int64)
    comm.Allreduce(np.copy(counts), counts)
    return float(counts[0] / max(1, counts[1]))


class AccuracyScorer:
    """Held-out accuracy of class scores, counted where the last stage runs, summed over
    every rank (the others count nothing)."""

    def reset(self) -> None:
        self.correct = self.total = 0

    def update(self, scores, y: np.ndarray) -> None:
        self.correct += int(np.sum(np.argmax(np.asarray(scores), axis=-1) == y))
        self.total += len(y)

    def result(self, comm) -> dict[str, float]:
        return {"accuracy": count_accuracy(comm, self.correct, self.total)}
