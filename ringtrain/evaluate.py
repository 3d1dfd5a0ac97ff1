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
