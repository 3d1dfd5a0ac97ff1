"""Examples in `.npy` shards, read through memory maps: a training set larger than memory.

A dataset is pairs of files `x-NNNNN.npy` and `y-NNNNN.npy` (the same NNNNN, the same number of
rows). Rows are copied out of a shard's map when a batch asks for them. At most `OPEN_SHARDS`
maps are held at once, the least recently read unmapped first: pages read through a map count
in the process's resident memory (VmHWM) until the map is closed, so a rank's memory stays
that of a few shards, however many the dataset has.

Shuffling keeps the reads local, as TF's file-based input does: the files in an order drawn from
(seed, epoch), then the rows permuted within consecutive windows of `buffer` rows.
"""

from __future__ import annotations

import glob
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from ringtrain.ahead import ReadAhead
from ringtrain.errors import UserError

OPEN_SHARDS = 2  # a window of rows spans at most two shards when shards hold a buffer or more
SHARD_NAME = re.compile(r"(?P<part>[xy])-(?P<index>\d+)\.npy")


def npy_header(path: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) from a `.npy` file's header, without reading or mapping its data."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"data file {path} is not a readable .npy file: {exc}") from None
    if dtype.hasobject:  # would need pickle to read
        raise UserError(f"data file {path} holds Python objects; store numbers")
    if fortran and len(shape) > 1:
        raise UserError(f"data file {path} is in Fortran order; save it C-ordered")
    if not shape:
        raise UserError(f"data file {path} holds a scalar, not one row per example")
    return tuple(shape), dtype


class ShardedRows:
    """One array split over `.npy` files, indexed by global row like an array in memory."""

    def __init__(self, paths: Sequence[str]):
        self.paths = list(paths)
        headers = [npy_header(p) for p in self.paths]
        first_shape, self.dtype = headers[0]
        for path, (shape, dtype) in zip(self.paths, headers, strict=True):
            if shape[1:] != first_shape[1:] or dtype != self.dtype:
                raise UserError(
                    f"data file {path} holds rows of {shape[1:]} {dtype}, but "
                    f"{self.paths[0]} holds {first_shape[1:]} {self.dtype}"
                )
        self.rows = [shape[0] for shape, _ in headers]
        self.offsets = np.cumsum([0, *self.rows])
        self.shape = (int(self.offsets[-1]), *first_shape[1:])
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        """The rows `index` (an index array or a slice), in that order, copied out."""
        if isinstance(index, slice):
            index = np.arange(len(self))[index]
        index = np.asarray(index, np.int64)
        out = np.empty((len(index), *self.shape[1:]), self.dtype)
        shard_of = np.searchsorted(self.offsets, index, side="right") - 1
        for s in dict.fromkeys(shard_of.tolist()):  # shards in the order first asked for
            mine = shard_of == s
            out[mine] = self._mapped(s)[index[mine] - self.offsets[s]]
        return out

    def _mapped(self, s: int) -> np.ndarray:
        with self._lock:  # the read-ahead thread and the step's own reads share the maps
            return self._map(s)

    def _map(self, s: int) -> np.ndarray:
        if s in self._maps:
            self._maps.move_to_end(s)
        else:
            while len(self._maps) >= OPEN_SHARDS:  # unmapped as its last reference goes
                self._maps.popitem(last=False)
            self._maps[s] = np.load(self.paths[s], mmap_mode="r", allow_pickle=False)
        return self._maps[s]


def matching_files(pattern: str, flag: str) -> list[str]:
    """The files a --data-files or --validation-files GLOB matches, in name order, or one
    line saying there are none."""
    paths = sorted(p for p in glob.glob(os.path.expanduser(pattern)) if not os.path.isdir(p))
    if not paths:
        raise UserError(f"{flag} {pattern} matches no file")
    return paths


def npy_shards(pattern: str, flag: str) -> tuple[ShardedRows, ShardedRows]:
    """(x, y) of the `x-NNNNN.npy`/`y-NNNNN.npy` pairs that `pattern` matches."""
    return npy_pairs(matching_files(pattern, flag), flag)


def npy_pairs(paths: Sequence[str], flag: str) -> tuple[ShardedRows, ShardedRows]:
    """(x, y) of the `x-NNNNN.npy`/`y-NNNNN.npy` pairs among `paths`."""
    parts: dict[str, dict[str, str]] = {"x": {}, "y": {}}
    for path in paths:
        named = SHARD_NAME.fullmatch(os.path.basename(path))
        if named is None:
            raise UserError(f"{flag}: {path} is not named x-NNNNN.npy or y-NNNNN.npy")
        parts[named["part"]][named["index"]] = path
    for part, other in (("x", "y"), ("y", "x")):
        for index, path in sorted(parts[part].items()):
            if index not in parts[other]:
                raise UserError(f"{flag}: {path} has no {other}-{index}.npy beside it")
    order = sorted(parts["x"])
    x = ShardedRows([parts["x"][i] for i in order])
    y = ShardedRows([parts["y"][i] for i in order])
    for i, rows_x, rows_y in zip(order, x.rows, y.rows, strict=True):
        if rows_x != rows_y:
            raise UserError(f"{flag}: x-{i}.npy holds {rows_x} rows but y-{i}.npy {rows_y}")
    return x, y


class ShardedExamples(ReadAhead):
    """The x and y shards' rows by position, read ahead (ringtrain.ahead) a step early."""

    def __init__(self, x: ShardedRows, y: ShardedRows):
        row = (np.empty(x.shape[1:], x.dtype), np.empty(y.shape[1:], y.dtype))
        super().__init__(lambda indices: (x[indices], y[indices]), len(x), row)
        self.file_rows = x.rows  # what --shuffle and --shard-policy file deal in


def shard_order(rows: Sequence[int], seed: int, epoch: int, buffer: int) -> np.ndarray:
    """An epoch's order of the rows of shards holding `rows` each: the shards in an order
    drawn from (seed, epoch), then the rows permuted within consecutive windows of `buffer`."""
    rng = np.random.default_rng([seed, epoch])
    files = rng.permutation(len(rows))
    return _windows_shuffled(_rows_of(rows, files), rng, buffer)


def _rows_of(rows: Sequence[int], files) -> np.ndarray:
    offsets = np.cumsum([0, *rows])
    return np.concatenate([np.arange(offsets[f], offsets[f + 1]) for f in files])


def _windows_shuffled(order: np.ndarray, rng, buffer: int) -> np.ndarray:
    for start in range(0, len(order), buffer):
        order[start : start + buffer] = rng.permutation(order[start : start + buffer])
    return order


def reader_streams(
    rows: Sequence[int], readers: int, seed: int, epoch: int, buffer: int, shuffle: bool
) -> list[np.ndarray]:
    """--shard-policy file: each reader's own files and the order it reads their rows in. The
    files, in name order or in one drawn from (seed, epoch), are dealt round-robin; a reader's
    rows are then permuted within windows of `buffer` (from seed, epoch and reader)."""
    files = np.random.default_rng([seed, epoch]).permutation(len(rows)) if shuffle else None
    files = np.arange(len(rows)) if files is None else files
    streams = []
    for reader in range(readers):
        order = _rows_of(rows, files[reader::readers])
        if shuffle:
            order = _windows_shuffled(order, np.random.default_rng([seed, epoch, reader]), buffer)
        streams.append(order)
    return streams
