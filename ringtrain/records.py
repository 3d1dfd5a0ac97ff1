"""Examples in TFRecord shards, read by record index and parsed by the user's function.

A TFRecord file is a sequence of records, each a length, its checksum, the bytes and theirs.
One pass over the lengths at start-up gives every record's offset (a sequential read of each
file: reading only the headers, a page each, was several times slower), so a record is
then read by index like a row of an array: global batch t takes the same records under every
strategy and rank count, --shuffle reorders them file by file within a buffer as it does
`.npy` shards, and a resumed run starts at any step. A rank reads only the records it trains
on, with `pread` (no memory map: its resident memory stays a batch's, however large the
files), and parses them as one batch: the parse function vectorized (pfor), or else in
parallel in tf.data within its share of the cores.

A shuffled batch's records lie scattered through a window of the file, and each read alone
costs the kernel a request of its own. Where few readers share the records
(`CHUNKED_READERS`), a reader instead asks the kernel for the whole chunk around a record
(`posix_fadvise(WILLNEED)`, one large request) the first time it needs a record from it; the
window's later batches find theirs in the page cache, which is not the reader's resident
memory. With N readers taking shares of every batch, each asks for all of a window's chunks,
so the disk reads up to N times the records' bytes (once per node, where the ranks of a node
share its page cache).

The parse function is the user's: `parse(serialized) -> (features, label)`, called per record,
as in `TFRecordDataset(files).map(parse)`. Shapes and dtypes are those of the first record;
any record that differs, or fails to parse, is named with its file and index.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from ringtrain.ahead import ReadAhead
from ringtrain.errors import UserError
from ringtrain.shards import matching_files

HEADER = struct.Struct("<QI")  # the record's length and the length's masked CRC-32C
FOOTER_BYTES = 4  # the data's masked CRC-32C
OPEN_FILES = 4
CHUNK_BYTES = 256 * 1024  # what a reader asks for around a record: about 20 images of 12 KB
CHUNKED_READERS = 4  # with more readers sharing the records, chunks would read too much
ASKED_CHUNKS = 1024  # chunks remembered as asked for: 256 MiB, more than a shuffle window


def record_offsets(path: str, flag: str) -> np.ndarray:
    """(offset of the data, length) of every record in an uncompressed TFRecord file."""
    try:
        size = os.path.getsize(path)
        found = []
        with open(path, "rb") as f:
            at = 0
            while at < size:
                header = f.read(HEADER.size)
                if len(header) < HEADER.size:
                    break
                length, _ = HEADER.unpack(header)
                if at + HEADER.size + length + FOOTER_BYTES > size:
                    break
                found.append((at + HEADER.size, length))
                at += HEADER.size + length + FOOTER_BYTES
                f.seek(at)
    except OSError as exc:
        raise UserError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    if at != size:
        raise UserError(
            f"{flag}: {path} is not an uncompressed TFRecord file (record {len(found)} is cut "
            "short)"
        )
    if not found:
        raise UserError(f"{flag}: {path} holds no records")
    return np.array(found, np.int64).reshape(-1, 2)


class RecordFiles:
    """The records of several files, indexed by global position in file-name order."""

    def __init__(self, paths: Sequence[str], flag: str):
        self.paths, self.flag = list(paths), flag
        self.offsets = [record_offsets(p, flag) for p in self.paths]
        self.rows = [len(o) for o in self.offsets]
        self.starts = np.cumsum([0, *self.rows])
        self._open: OrderedDict[int, int] = OrderedDict()
        self._asked: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._lock = threading.Lock()
        self.chunked = True  # ask the kernel for whole chunks (see the module's docstring)

    def shared_by(self, readers: int) -> None:
        """`readers` read shares of every batch: whole chunks only while they are few."""
        self.chunked = readers <= CHUNKED_READERS

    def __len__(self) -> int:
        return int(self.starts[-1])

    def where(self, index: int) -> str:
        """A record's file and index in it, for a message."""
        f = int(np.searchsorted(self.starts, index, side="right") - 1)
        return f"record {index - self.starts[f]} of {self.paths[f]}"

    def read(self, indices: np.ndarray) -> list[bytes]:
        """The serialized records at global positions `indices`, in that order."""
        files = np.searchsorted(self.starts, indices, side="right") - 1
        out: list[bytes] = []
        for index, f in zip(indices.tolist(), files.tolist(), strict=True):
            offset, length = (int(v) for v in self.offsets[f][index - self.starts[f]])
            data = os.pread(self._descriptor(f, offset, length), length, offset)
            if len(data) != length:
                raise UserError(f"{self.flag}: {self.where(index)} is cut short")
            out.append(data)
        return out

    def _descriptor(self, f: int, offset: int, length: int) -> int:
        """File f's descriptor, its chunks around [offset, offset + length) asked for."""
        with self._lock:  # the read-ahead thread and the step's own reads share the files
            descriptor = self._opened(f)
            if self.chunked:
                for chunk in range(offset // CHUNK_BYTES, (offset + length) // CHUNK_BYTES + 1):
                    self._ask(descriptor, f, chunk)
            return descriptor

    def _ask(self, descriptor: int, f: int, chunk: int) -> None:
        if (f, chunk) in self._asked:
            self._asked.move_to_end((f, chunk))
            return
        self._asked[(f, chunk)] = None
        if len(self._asked) > ASKED_CHUNKS:
            self._asked.popitem(last=False)
        os.posix_fadvise(descriptor, chunk * CHUNK_BYTES, CHUNK_BYTES, os.POSIX_FADV_WILLNEED)

    def _opened(self, f: int) -> int:
        if f in self._open:
            self._open.move_to_end(f)
            return self._open[f]
        while len(self._open) >= OPEN_FILES:
            os.close(self._open.popitem(last=False)[1])
        try:
            self._open[f] = os.open(self.paths[f], os.O_RDONLY)
        except OSError as exc:
            raise UserError(f"{self.flag}: cannot read {self.paths[f]}: {exc.strerror}") from None
        return self._open[f]


class ParsedRecords(ReadAhead):
    """Records parsed by the user's function, a batch of positions at a time, read ahead
    (ringtrain.ahead) while the step before computes."""

    def __init__(self, files: RecordFiles, parse: Callable, flag: str):
        from ringtrain.tensorflow_loader import tf

        super().__init__(self._batch_checked, len(files))
        self.files, self.parse, self.flag = files, parse, flag
        self.options = tf.data.Options()  # parsing threads within the rank's share of cores
        self.options.threading.private_threadpool_size = max(
            1, tf.config.threading.get_intra_op_parallelism_threads()
        )
        # Traced once: a Dataset built per batch traced `parse` anew each time, which cost
        # four times the parsing itself (20 ms against 5 for 128 images of 64x64x3).
        self._parsed = tf.function(self._parsed_graph, reduce_retracing=True)
        self.vectorized = True  # until the parse function is found not to vectorize
        first = self._batch(np.arange(1))
        if not (isinstance(first, tuple) and len(first) == 2):
            raise UserError(f"{flag}: the parse function must return (features, label)")
        self.spec = tf.nest.map_structure(lambda a: tf.TensorSpec(a.shape[1:], a.dtype), first)

    def examples(self):
        """The records as Examples, indexed by position like arrays."""
        from ringtrain.data import Examples

        return Examples(*self.columns())

    def _batch_checked(self, indices: np.ndarray):
        value = self._batch(indices)
        self._check(value, indices)
        return value

    def _batch(self, indices: np.ndarray):
        from ringtrain.tensorflow_loader import tf

        records = self.files.read(indices)
        if not records:
            return tf.nest.map_structure(lambda s: np.zeros((0, *s.shape), s.dtype), self.spec)
        try:
            return self._run(records)
        except (tf.errors.OpError, ValueError, TypeError) as exc:
            for record, index in zip(records, indices.tolist(), strict=True):
                try:
                    self._run([record])
                except (tf.errors.OpError, ValueError, TypeError) as bad:
                    raise UserError(
                        f"{self.flag}: {self.files.where(index)} does not parse: {_said(bad)}"
                    ) from None
            raise UserError(
                f"{self.flag}: the records at positions {indices[0]}.. do not batch "
                f"(their shapes differ): {_said(exc)}"
            ) from None

    def _run(self, records: list[bytes]):
        from ringtrain.tensorflow_loader import tf

        parsed = self._parsed(tf.constant(records, tf.string))
        return tf.nest.map_structure(np.asarray, parsed)

    def _parsed_graph(self, records):
        """The records parsed as one batch inside one graph: the parse function vectorized over
        them (TensorFlow's pfor: one parse op for the batch, not one per record), or where it
        cannot be, parsed record by record in parallel by tf.data and batched whole."""
        from ringtrain.tensorflow_loader import tf

        if self.vectorized:
            quiet = logging.getLogger("tensorflow")
            level = quiet.level
            quiet.setLevel(logging.ERROR)  # pfor's note on each looped op
            try:
                return tf.vectorized_map(self.parse, records, fallback_to_while_loop=True)
            except Exception:  # noqa: BLE001 - any op pfor cannot take: the map below
                self.vectorized = False
            finally:
                quiet.setLevel(level)
        return (
            tf.data.Dataset.from_tensor_slices(records)
            .map(self.parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .batch(tf.shape(records, out_type=tf.int64)[0])
            .with_options(self.options)
            .get_single_element()
        )

    def _check(self, value, indices: np.ndarray) -> None:
        from ringtrain.streamed import parts

        named = [parts({"features": v[0], "label": v[1]}, "") for v in (self.spec, value)]
        for (path, spec), (_, array) in zip(*named, strict=True):
            if (
                tuple(array.shape[1:]) != tuple(spec.shape)
                or array.dtype != spec.dtype.as_numpy_dtype
            ):
                raise UserError(
                    f"{self.flag}: element part {path} is {array.shape[1:]} "
                    f"{array.dtype} near {self.files.where(int(indices[0]))}, but "
                    f"{tuple(spec.shape)} {spec.dtype.name} in the first record; every record "
                    "must parse to the same shapes and dtypes"
                )


TF_OP_NAMES = re.compile(r"\{\{[^}]*\}\}\s*")
TF_MAP_PREFIX = re.compile(r"^.*transformation with iterator: [\w:]+: ")
TF_WHERE = ("Detected at node", "File ", "[[")  # a graph error's lines on where, not what


def _said(exc: Exception) -> str:
    """The user's own error inside TensorFlow's message, without the op names around it."""
    text = getattr(exc, "message", None) or str(exc)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if lines[0].startswith("in user code:"):  # a Python error while tracing: its last line
        return lines[-1]
    # a graph's error: a header and where the op was made, then the line that says it (the
    # map's, in tf.data)
    said = next((line for line in lines if TF_MAP_PREFIX.match(line)), None)
    if said is None:
        told = [line for line in lines[1:] if not line.startswith(TF_WHERE)]
        said = told[0] if lines[0].startswith("Graph execution error") and told else lines[0]
    return TF_MAP_PREFIX.sub("", TF_OP_NAMES.sub("", said))


def parsed_records(pattern: str, parse: Callable, flag: str) -> ParsedRecords:
    """The TFRecord files `pattern` matches, parsed by `parse`."""
    return ParsedRecords(RecordFiles(matching_files(pattern, flag), flag), parse, flag)
