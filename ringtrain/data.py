"""Datasets and the global batch order that every strategy shares.

The order of examples is a function of (seed, epoch) only, so step t sees the same global batch
whatever the strategy or number of ranks; ranks and microbatches take contiguous slices of it.
"""

from __future__ import annotations

import importlib.util
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringtrain.errors import UserError


@dataclass
class Dataset:
    """Arrays in memory: features float32, labels int32."""

    x: np.ndarray
    y: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def n_classes(self) -> int:
        return int(max(self.y.max(), self.y_test.max())) + 1

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    @property
    def n_examples(self) -> int:
        return len(self.x)

    keeps_partial_batch = False  # the built-in runs drop an epoch's last partial batch

    def read_ahead(self, positions: np.ndarray) -> None:
        """Arrays in memory: nothing to read ahead."""

    def choose_policy(self, asked: str, readers: int) -> str:
        return data_policy(asked, "a --dataset")

    def epoch_order(self, global_batch: int, seed: int, epoch: int, shuffle: bool) -> list:
        return epoch_order(self.n_examples, global_batch, seed, epoch, shuffle, False)

    @property
    def train(self) -> Examples:
        return Examples(self.x, self.y)

    @property
    def validation(self) -> Examples:
        return Examples(self.x_test, self.y_test)


def _rows(arrays) -> int:
    """Examples in an array or a dict of arrays (Keras's form for several inputs or outputs)."""
    if isinstance(arrays, dict):
        return len(next(iter(arrays.values())))
    return len(arrays)


class ReadClock:
    """Seconds this process spent reading examples since the last lap. Nothing reads ahead
    yet, so a step's reads are its input wait."""

    def __init__(self):
        self.seconds = 0.0

    def lap(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


READS = ReadClock()


def take(arrays, indices: np.ndarray):
    """The rows `indices` of an array or of each array in a dict (timed by READS)."""
    start = time.perf_counter()
    if isinstance(arrays, dict):
        rows = {k: v[indices] for k, v in arrays.items()}
    else:
        rows = arrays[indices]
    READS.seconds += time.perf_counter() - start
    return rows


@dataclass
class Examples:
    """A user's examples as Keras's `fit` takes them: x and y are arrays, or dicts of arrays
    keyed by input or output name. Nothing is held out: validation data comes separately."""

    x: Any
    y: Any

    def __post_init__(self):
        counts = {_rows(a) for part in (self.x, self.y) for a in _arrays(part)}
        if len(counts) != 1:
            raise UserError(f"x and y must have one row per example; got row counts {counts}")
        if not counts.pop():
            raise UserError("x and y hold no examples")

    def __len__(self) -> int:
        return _rows(self.x)

    def take(self, indices: np.ndarray) -> tuple[Any, Any]:
        return take(self.x, indices), take(self.y, indices)


def _arrays(part) -> list:
    return list(part.values()) if isinstance(part, dict) else [part]


@dataclass
class UserData:
    """Training examples and optional validation examples, for a user's own Keras model.
    `shard_rows`: the rows of each file the training examples are read from (None: arrays in
    memory), which --shuffle then reorders file by file, within windows of `shuffle_buffer`.
    `in_order`: a tf.data.Dataset's examples, which keep its own order (never shuffled).
    `reader`: what reads the training examples from files, and can read some ahead."""

    train: Examples
    validation: Examples | None = None
    shard_rows: list[int] | None = None
    shuffle_buffer: int = 0
    in_order: bool = False
    reader: Any = None
    policy: str = "data"  # --shard-policy as chosen for this run's readers
    readers: int = 1
    stream_lengths: list[int] | None = None  # `off`: every rank's own Dataset's length

    def read_ahead(self, positions: np.ndarray) -> None:
        """Start reading the examples at `positions`, which a coming step will take."""
        if self.reader is not None:
            self.reader.read_ahead(positions)

    def choose_policy(self, asked: str, readers: int) -> str:
        """--shard-policy for `readers` replicas that read: `auto` is `file` when there are
        files, at least one per reader (as TF's AutoShardPolicy.AUTO), else `data`."""
        if asked == "off" and self.in_order:  # a Dataset that shards itself by rank
            self.policy, self.readers = "off", readers
            return "off"
        if not self.shard_rows:
            return data_policy(asked, "a tf.data.Dataset" if self.in_order else "arrays")
        files = len(self.shard_rows)
        if asked == "auto":
            asked = "file" if files >= readers else "data"
        if asked != "file":
            self._shared_by(readers)
            return data_policy(asked, "files")
        if files < readers:
            raise UserError(
                f"--shard-policy file: {files} file(s) for {readers} readers (data-parallel "
                "replicas); give at least one file per reader, or --shard-policy data"
            )
        self.policy, self.readers = "file", readers
        self._shared_by(1)
        return "file"

    def _shared_by(self, readers: int) -> None:
        files = getattr(self.reader, "files", None)  # .npy shards are memory maps instead
        if files is not None:
            files.shared_by(readers)

    @property
    def n_examples(self) -> int:
        """The examples an epoch takes: under `off`, every rank's own Dataset's."""
        return sum(self.stream_lengths) if self.stream_lengths else len(self.train)

    keeps_partial_batch = True  # as Keras's fit: an epoch is ceil(N / B) steps

    def epoch_order(self, global_batch: int, seed: int, epoch: int, shuffle: bool) -> list:
        shuffle = shuffle and not self.in_order
        steps = -(-self.n_examples // global_batch)
        if self.policy == "off":  # each reader's own Dataset, in its own order
            lengths = self.stream_lengths or [len(self.train)]
            return readers_batches([np.arange(n) for n in lengths], steps)
        if self.policy == "file":
            from ringtrain.shards import reader_streams

            buffer, readers = self.shuffle_buffer, self.readers
            streams = reader_streams(self.shard_rows, readers, seed, epoch, buffer, shuffle)
            return readers_batches(streams, steps)
        if self.shard_rows is None or not shuffle:
            return epoch_order(self.n_examples, global_batch, seed, epoch, shuffle, True)
        from ringtrain.shards import shard_order

        order = shard_order(self.shard_rows, seed, epoch, self.shuffle_buffer)
        return batches_of(order, global_batch, True)


def _holdout(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int) -> Dataset:
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Dataset(x[train], y[train], x[test], y[test])


def load_digits(test_fraction: float = 0.2) -> Dataset:
    """scikit-learn's 8x8 digits: ships inside that package, so it loads with no network. The
    file is read directly: importing scikit-learn would add a second to every rank's start."""
    spec = importlib.util.find_spec("sklearn")
    table = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
        table = np.loadtxt(path, delimiter=",") if path.is_file() else None
    if table is None:
        raise UserError("--dataset digits needs scikit-learn, which ships it; pip install it")
    x = (table[:, :-1].reshape(-1, 8, 8) / 16.0).astype(np.float32)[..., None]
    return _holdout(x, table[:, -1].astype(np.int32), test_fraction, seed=1234)


def load_synthetic(n: int, shape: tuple[int, ...], n_classes: int, seed: int) -> Dataset:
    """Gaussian blobs around one random centre per class: learnable, sized by flags, seeded."""
    rng = np.random.default_rng([seed, 7])
    centres = rng.normal(size=(n_classes, *shape)).astype(np.float32)
    y = rng.integers(0, n_classes, size=n).astype(np.int32)
    x = centres[y] + rng.normal(scale=1.0, size=(n, *shape)).astype(np.float32)
    return _holdout(x, y, 0.2, seed=seed)


def load_npz(path: str) -> Dataset:
    """A user's own arrays: x and y, and optionally x_test and y_test (else 20% is held out)."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            found = {k: arrays[k] for k in arrays.files}
    except FileNotFoundError as exc:
        raise UserError(f"dataset file {path} does not exist") from exc
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise UserError(f"dataset file {path} is not a readable .npz ({exc})") from exc
    missing = [k for k in ("x", "y") if k not in found]
    if missing:
        raise UserError(f"dataset file {path} lacks array(s) {', '.join(missing)}")
    x, y = _examples(path, found, "x", "y")
    if "x_test" not in found and "y_test" not in found:
        return _holdout(x, y, 0.2, seed=1234)
    x_test, y_test = _examples(path, found, "x_test", "y_test")
    if x_test.shape[1:] != x.shape[1:]:
        raise UserError(
            f"dataset file {path}: x_test rows have shape {x_test.shape[1:]}, x rows {x.shape[1:]}"
        )
    return Dataset(x, y, x_test, y_test)


def _examples(path: str, found: dict, xs: str, ys: str) -> tuple[np.ndarray, np.ndarray]:
    """Features as float32 and labels as int32, checked: NaN or infinite features would train
    to nonsense without a word, so they are refused here."""
    if xs not in found or ys not in found:
        raise UserError(f"dataset file {path} has {xs if xs in found else ys} without its pair")
    x, y = found[xs], found[ys]
    if x.ndim < 2 or len(x) == 0:
        raise UserError(f"dataset file {path}: {xs} must hold rows of features, got {x.shape}")
    if y.ndim != 1 or len(x) != len(y):
        raise UserError(
            f"dataset file {path}: {ys} must be 1-D with one label per row of {xs} "
            f"(got {xs} {x.shape}, {ys} {y.shape})"
        )
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
        raise UserError(f"dataset file {path}: {ys} must hold non-negative integer class labels")
    if x.dtype.kind not in "biuf":
        raise UserError(f"dataset file {path}: {xs} holds {x.dtype}, not real numbers")
    with np.errstate(over="ignore"):  # values beyond float32 become infinite, refused below
        x = x.astype(np.float32)
    bad = ~np.isfinite(x)
    if bad.any():
        row = int(np.argwhere(bad)[0][0])
        raise UserError(
            f"dataset file {path}: {xs} holds {int(bad.sum())} non-finite value(s) (NaN or "
            f"beyond float32), the first in row {row}"
        )
    return x, y.astype(np.int32)


def load_dataset(
    name: str, seed: int, synthetic_size: int = 2048, synthetic_shape: tuple[int, ...] = (8, 8, 1)
) -> Dataset:
    """Resolve the --dataset flag."""
    if name == "digits":
        return load_digits()
    if name == "synthetic":
        return load_synthetic(synthetic_size, tuple(synthetic_shape), 10, seed)
    if name.startswith("npz:"):
        return load_npz(name[4:])
    raise UserError(f"unknown dataset {name!r}; choose digits, synthetic or npz:PATH")


def epoch_order(
    n_examples: int, global_batch: int, seed: int, epoch: int, shuffle: bool, keep_partial: bool
) -> list[np.ndarray]:
    """The global batches of one epoch, as index arrays: a permutation drawn from (seed, epoch)
    alone, or the examples in order; the last partial batch kept (Keras's fit) or dropped."""
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(n_examples)
    else:
        order = np.arange(n_examples)
    return batches_of(order, global_batch, keep_partial)


def batches_of(order: np.ndarray, global_batch: int, keep_partial: bool) -> list[np.ndarray]:
    """An epoch's order of examples cut into global batches."""
    steps, _ = step_plan(len(order), global_batch, 1, None, keep_partial)
    return [order[t * global_batch : (t + 1) * global_batch] for t in range(steps)]


def epoch_batches(n_examples: int, global_batch: int, seed: int, epoch: int) -> np.ndarray:
    """Index matrix (steps_per_epoch, global_batch) of shuffled, full batches."""
    return np.stack(epoch_order(n_examples, global_batch, seed, epoch, True, False))


def step_plan(
    n_examples: int,
    global_batch: int,
    epochs: int | None,
    steps: int | None,
    keep_partial: bool = False,
) -> tuple[int, int]:
    """(total optimizer steps, steps per epoch) for --epochs or --steps."""
    per_epoch = -(-n_examples // global_batch) if keep_partial else n_examples // global_batch
    if per_epoch == 0:
        raise UserError(f"global batch {global_batch} exceeds the {n_examples} training examples")
    total = steps if steps is not None else (epochs or 1) * per_epoch
    return total, per_epoch


def data_policy(asked: str, source: str) -> str:
    """`data` (or `auto`, which means it here): every reader takes its share of each global
    batch, the same examples under every strategy and rank count. `source` cannot be read by
    the other policies."""
    if asked in ("auto", "data"):
        return "data"
    if asked == "file":
        raise UserError(f"--shard-policy file needs --data-files; {source} is sharded by data")
    raise UserError(
        "--shard-policy off is for a tf.data.Dataset that shards itself by rank "
        f"(dataset.shard(size, rank)); {source} is sharded by data or file"
    )


class ReadersBatch(np.ndarray):
    """A global batch of readers' own shares (--shard-policy file or off): reader r's examples
    are [bounds[r], bounds[r + 1]), from its own files or Dataset, and their counts may
    differ by one."""

    bounds: tuple[int, ...] = ()


def readers_batches(streams: list[np.ndarray], steps: int) -> list[np.ndarray]:
    """An epoch of `steps` global batches, each reader's stream cut into `steps` consecutive
    parts: every row once, every share non-empty (a stream shorter than `steps` is refused).
    A stream's positions are the reader's own (under `off`, in its own Dataset)."""
    short = [r for r, s in enumerate(streams) if len(s) < steps]
    if short:
        raise UserError(
            f"--shard-policy file or off: reader {short[0]}'s share holds "
            f"{len(streams[short[0]])} examples, fewer than the {steps} steps of an epoch; "
            "balance the shares or use --shard-policy data"
        )
    parts = [np.array_split(stream, steps) for stream in streams]
    batches = []
    for t in range(steps):
        shares = [p[t] for p in parts]
        batch = np.concatenate(shares).view(ReadersBatch)
        batch.bounds = tuple(int(b) for b in np.cumsum([0, *map(len, shares)]))
        batches.append(batch)
    return batches


def shard(indices: np.ndarray, part: int, parts: int) -> np.ndarray:
    """The part-th contiguous slice of a batch: ranks, replicas and microbatches all use it."""
    size = len(indices) // parts
    return indices[part * size : (part + 1) * size]


def uneven_shard(indices: np.ndarray, part: int, parts: int) -> np.ndarray:
    """The part-th contiguous slice, every example in one: a partial batch of n leaves the
    first n mod parts slices one longer (some may be empty). A ReadersBatch is cut where its
    readers' shares meet."""
    bounds = getattr(indices, "bounds", ())
    if len(bounds) == parts + 1:
        return np.asarray(indices)[bounds[part] : bounds[part + 1]]
    return np.array_split(np.asarray(indices), parts)[part]
