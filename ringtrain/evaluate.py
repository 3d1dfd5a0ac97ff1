"""Held-out accuracy computed in shards: each rank scores a strided share, counts are summed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ringtrain.data import Dataset


def sharded_accuracy(
    predict: Callable[[np.ndarray], np.ndarray],
    data: Dataset,
    comm,
    part: int,
    parts: int,
    chunk: int = 512,
) -> float:
    """predict maps a feature batch to class ids; comm must include every part exactly once."""
    mine = np.arange(len(data.x_test))[part::parts]
    correct = 0
    for start in range(0, len(mine), chunk):
        idx = mine[start : start + chunk]
        correct += int(np.sum(predict(data.x_test[idx]) == data.y_test[idx]))
    return count_accuracy(comm, correct, len(mine))


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
        self.correct += int(np.sum(np.argmax(scores.numpy(), axis=-1) == y))
        self.total += len(y)

    def result(self, comm, _scored_here: bool) -> dict[str, float]:
        return {"accuracy": count_accuracy(comm, self.correct, self.total)}
