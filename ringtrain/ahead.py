"""Examples read from files a step ahead, on a thread of their own.

The order of the examples is known before a step runs (a function of the seed and the epoch),
so the loop names the positions the next step will take while the current one computes, and
`ReadAhead` reads them then (`pread`, memory-map copies, parsing all release Python's lock).
A step takes its rows from a read ahead that holds them, waiting for it if it is not done
(that wait is the step's input wait), or else reads them itself. The last read is kept: a
step asks for its features and its labels separately.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

KEPT = 2  # reads ahead held at once: the next step's, and the one before it


def mapped(function: Callable, value: Any) -> Any:
    """`function` on every array of a (features, label) structure of tuples and dicts."""
    if isinstance(value, dict):
        return {key: mapped(function, part) for key, part in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(mapped(function, part) for part in value)
    return function(value)


class ReadAhead:
    """Rows by position from `read(indices) -> (features, label)`, read ahead on request."""

    def __init__(self, read: Callable[[np.ndarray], Any], n_examples: int, spec: Any = None):
        """`spec`: one example's (features, label), as TensorSpecs or arrays of their shapes
        and dtypes (a subclass may set it once it has read one)."""
        self.read, self.n_examples, self.spec = read, n_examples, spec
        self._last: tuple[bytes, Any] | None = None
        self._ahead: list[tuple[np.ndarray, Future]] = []  # (sorted positions, their read)
        self._thread: ThreadPoolExecutor | None = None

    def columns(self) -> tuple[Any, Any]:
        """(features, labels) as columns indexed by position like arrays (for Examples)."""
        features, labels = self.spec
        return columns(self, features, [0]), columns(self, labels, [1])

    def read_ahead(self, positions: np.ndarray) -> None:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="ringtrain-input")
        positions = np.unique(np.asarray(positions, np.int64))
        if len(positions):
            read = self._thread.submit(self.read, positions)
            self._ahead = [*self._ahead[1 - KEPT :], (positions, read)]

    def rows(self, part: list, indices) -> np.ndarray:
        """One part of the examples at `indices` (`part`: its path, e.g. [0, "ids"])."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        value = self._from_ahead(indices)
        if value is None:
            value = self.read_now(indices)
        for key in part:
            value = value[key]
        return value

    def read_now(self, indices: np.ndarray) -> Any:
        key = indices.tobytes()
        if self._last is None or self._last[0] != key:
            self._last = (key, self.read(indices))
        return self._last[1]

    def _from_ahead(self, indices: np.ndarray) -> Any:
        for positions, read in reversed(self._ahead):
            at = np.minimum(np.searchsorted(positions, indices), len(positions) - 1)
            if len(indices) and (positions[at] == indices).all():
                return mapped(lambda whole, at=at: whole[at], read.result())
        return None


class _Column:
    """One part of the elements, indexed by global position like an array. `window` reads
    them: anything with `n_examples` and `rows(part, indices)`; `spec` is one element's part
    (a TensorSpec, or an array of its shape and dtype)."""

    def __init__(self, window, part: list, spec):
        self.window, self.part = window, part
        self.shape = (window.n_examples, *spec.shape)
        self.dtype = np.dtype(getattr(spec.dtype, "as_numpy_dtype", spec.dtype))

    def __len__(self) -> int:
        return self.window.n_examples

    def __getitem__(self, indices) -> np.ndarray:
        return self.window.rows(self.part, indices)


def columns(window, spec, part: list):
    """A column per array of the elements' structure: a dict's keys stay keys."""
    if isinstance(spec, dict):
        return {key: columns(window, value, [*part, key]) for key, value in spec.items()}
    return _Column(window, part, spec)
