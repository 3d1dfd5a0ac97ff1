"""A user's own tf.data.Dataset, read in its own order, a global batch at a time.

ringtrain never reorders a Dataset (Keras's fit ignores `shuffle` for one too): global batch t
is its elements [t*B, (t+1)*B). Every rank that reads examples reads each global batch whole
and keeps its share, as tf.data's DATA sharding policy does, so the batches are the same under
every strategy and rank count, and a run resumed at step s starts reading at element s*B
(`skip`), whatever the rank count was. Only a rank that uses examples reads: a pipeline's
middle stages never do. The next global batch is read ahead while a step computes. Held-out
data is read into memory once.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ringtrain.ahead import columns
from ringtrain.data import Examples
from ringtrain.errors import UserError
from ringtrain.tensorflow_loader import tf


def is_dataset(value: Any) -> bool:
    return isinstance(value, tf.data.Dataset)


def check_elements(dataset, flag: str) -> None:
    """Unbatched (features, label) pairs of fixed shapes, or one line saying what is not."""
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise UserError(f"{flag}: the dataset's elements must be (features, label) pairs")
    for path, part in parts(spec[1], "label"):
        if part.shape.rank and part.shape[0] is None:
            raise UserError(
                f"{flag}: the dataset is already batched ({path} has shape {part.shape}); "
                "return unbatched elements and ringtrain batches them"
            )
    for path, part in parts({"features": spec[0], "label": spec[1]}, ""):
        if part.shape.rank is None or None in part.shape:
            raise UserError(
                f"{flag}: element part {path} has no fixed shape ({part.shape}); every element "
                "must have the same shapes and dtypes"
            )


def parts(spec, path: str):
    """(path, TensorSpec) of every array in an element's structure: features/token_ids."""
    if isinstance(spec, dict):
        items = spec.items()
    elif isinstance(spec, tuple | list):
        items = enumerate(spec)
    else:
        yield path, spec
        return
    for key, value in items:
        yield from parts(value, f"{path}/{key}" if path else str(key))


def _finite(dataset, flag: str) -> int:
    """The dataset's declared length (tf.data.UNKNOWN_CARDINALITY when it cannot tell)."""
    n = int(dataset.cardinality())
    if n == tf.data.INFINITE_CARDINALITY:
        raise UserError(
            f"{flag}: the dataset is infinite (repeat()); give one epoch of it, ringtrain "
            "repeats it for every epoch"
        )
    return n


def _not_empty(n: int, flag: str) -> int:
    if n == 0:
        raise UserError(f"{flag}: the dataset holds no examples")
    return n


def count(dataset, flag: str) -> int:
    """The dataset's length: its own, or counted once by reading it through."""
    n = _finite(dataset, flag)
    if n == tf.data.UNKNOWN_CARDINALITY:
        n = int(dataset.reduce(np.int64(0), lambda total, _: total + 1))
    return _not_empty(n, flag)


class _Window:
    """The global batch last read: reading goes forward from it, and any other position
    starts a new iterator there (`skip`), as a new epoch or a resumed run does."""

    def __init__(self, dataset, n_examples: int, batch: int):
        self.dataset, self.n_examples, self.batch = dataset, n_examples, batch
        self.iterator, self.next = None, 0
        self.start, self.values = 0, None

    def rows(self, part: list, indices: np.ndarray) -> np.ndarray:
        """The rows at global positions `indices` of one part of the elements (`part`: its
        path, e.g. [0, "token_ids"]): within one global batch, or a run of them (--loop fit
        takes a rank's share of a whole epoch at once)."""
        indices = np.asarray(indices)
        first = int(indices.min()) if len(indices) else self.start
        last = int(indices.max()) + 1 if len(indices) else first
        if self.values is None or first < self.start or last > self.start + self._size():
            self._read_from(first)
            while last > self.start + self._size():
                more = next(self.iterator)
                self.values = tf.nest.map_structure(_joined, self.values, more)
                self.next += len(tf.nest.flatten(more)[0])
        value = self.values
        for key in part:
            value = value[key]
        return value[indices - self.start]

    def _size(self) -> int:
        return len(tf.nest.flatten(self.values)[0])

    def _read_from(self, position: int) -> None:
        aligned = position - position % self.batch  # global batches start at multiples of B
        if self.iterator is None or aligned != self.next:
            # prefetch: tf.data's own thread reads the next global batch while this one trains
            batches = self.dataset.skip(aligned).batch(self.batch).prefetch(1)
            self.iterator, self.next = batches.as_numpy_iterator(), aligned
        self.start, self.values = self.next, next(self.iterator)
        self.next += self._size()


def _joined(*pieces: np.ndarray) -> np.ndarray:
    return np.concatenate(pieces)


def streamed(dataset, batch: int, flag: str) -> Examples:
    """The dataset's examples, read as the global batches of `batch` ask for them."""
    check_elements(dataset, flag)
    options = tf.data.Options()  # tf.data's threads within the rank's share of the cores
    options.threading.private_threadpool_size = max(
        1, tf.config.threading.get_intra_op_parallelism_threads()
    )
    window = _Window(dataset.with_options(options), count(dataset, flag), batch)
    features, labels = dataset.element_spec
    return Examples(columns(window, features, [0]), columns(window, labels, [1]))


def in_memory(dataset, flag: str) -> Examples:
    """The whole dataset as arrays: for held-out data, which every rank scores in shares."""
    check_elements(dataset, flag)
    _finite(dataset, flag)
    batches = list(dataset.batch(4096).as_numpy_iterator())  # read once, counted as read
    _not_empty(len(batches), flag)
    joined = tf.nest.map_structure(_joined, *batches)
    return Examples(*joined)


def first_batch_digest(examples: Examples, batch: int) -> np.ndarray:
    """A fingerprint of global batch 0's bytes: equal on every rank iff they read alike."""
    first = np.arange(min(batch, len(examples)))
    digest = hashlib.sha256()
    for array in tf.nest.flatten(examples.take(first)):
        digest.update(np.ascontiguousarray(array).tobytes())
    return np.frombuffer(digest.digest(), np.uint8).copy()


def check_same_order(comm, wait, examples: Examples, batch: int, flag: str) -> None:
    """Every rank's first global batch must be the same examples in the same order; an
    unseeded shuffle gives each rank its own. A collective: every rank reaches one verdict."""
    mine = first_batch_digest(examples, batch)
    every = np.empty(len(mine) * comm.Get_size(), np.uint8)
    wait(comm.Iallgather(mine, every), None, "the other ranks' first batches")
    rows = every.reshape(comm.Get_size(), -1)
    others = [r for r, row in enumerate(rows) if (row != rows[0]).any()]
    if others:  # every rank holds the same rows, so every rank says the same
        raise UserError(
            f"{flag}: the dataset's first global batch differs between ranks (rank "
            f"{others[0]}'s from rank 0's); its order must not depend on the rank: seed any "
            "shuffle (shuffle(buffer, seed=...))"
        ).on_every_rank(comm.Get_rank())


def shared_lengths(comm, wait, mine: int) -> list[int]:
    """Every rank's own Dataset's length (--shard-policy off), in rank order; a collective."""
    every = np.empty(comm.Get_size(), np.int64)
    wait(comm.Iallgather(np.array([mine], np.int64), every), None, "the other ranks' lengths")
    return [int(n) for n in every]
