"""`ringtrain data make-synthetic`: image-classification shards made here, for tests and
benchmarks (nothing is downloaded), and `parse_image`, the parse function that reads them.

Each example is an H x W x C uint8 image, a class's fixed random pattern plus noise (so a model
can learn it), and an int64 label. TFRecord shards hold one `tf.train.Example` per record, with
`image` (the raw bytes), `label` and `shape`; `.npy` shards hold the same examples as pairs
`x-NNNNN.npy` (uint8) and `y-NNNNN.npy` (int64). The same seed gives the same examples in
either format. Shards are written a chunk at a time, so a set larger than memory can be made.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator

import numpy as np

from ringtrain.config import positive_whole_number
from ringtrain.errors import UserError

CHUNK = 512  # examples generated at a time
NOISE = 64  # uniform, on 0..255 pixel values


def parse_image(serialized):
    """One make-synthetic record as (image, label): uint8 H x W x C, int64. A model scales the
    image itself (keras.layers.Rescaling(1 / 255)), as it would a photograph's bytes."""
    from ringtrain.tensorflow_loader import tf

    found = tf.io.parse_single_example(
        serialized,
        {
            "image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64),
            "shape": tf.io.FixedLenFeature([3], tf.int64),
        },
    )
    image = tf.reshape(tf.io.decode_raw(found["image"], tf.uint8), found["shape"])
    return image, found["label"]


def examples(n: int, shape: tuple[int, ...], classes: int, seed: int, first: int = 0):
    """Examples [first, first + n) of the set (image uint8, label int64), drawn per chunk from
    (seed, chunk) alone, so any part is made without the rest."""
    patterns = np.random.default_rng([seed, 7]).integers(0, 256, (classes, *shape), np.int16)
    images = np.empty((n, *shape), np.uint8)
    labels = np.empty(n, np.int64)
    at = first
    while at < first + n:
        chunk = at // CHUNK
        rng = np.random.default_rng([seed, 11, chunk])
        y = rng.integers(0, classes, size=CHUNK)
        x = patterns[y] + rng.integers(-NOISE, NOISE + 1, (CHUNK, *shape), np.int16)
        lo, hi = at - chunk * CHUNK, min(CHUNK, first + n - chunk * CHUNK)
        images[at - first : at - first + hi - lo] = np.clip(x[lo:hi], 0, 255).astype(np.uint8)
        labels[at - first : at - first + hi - lo] = y[lo:hi]
        at += hi - lo
    return images, labels


def shard_sizes(n: int, shards: int) -> list[int]:
    return [len(part) for part in np.array_split(np.arange(n), shards)]


def _chunks(size: int, first: int, shape, classes: int, seed: int) -> Iterator:
    for start in range(0, size, CHUNK):
        yield start, examples(min(CHUNK, size - start), shape, classes, seed, first + start)


def write_tfrecord(path: str, size: int, first: int, shape, classes: int, seed: int) -> None:
    from ringtrain.tensorflow_loader import tf

    def feature(**kind) -> tf.train.Feature:
        return tf.train.Feature(**kind)

    dims = feature(int64_list=tf.train.Int64List(value=list(shape)))
    with tf.io.TFRecordWriter(path) as writer:
        for _, (images, labels) in _chunks(size, first, shape, classes, seed):
            for image, label in zip(images, labels, strict=True):
                record = tf.train.Example(
                    features=tf.train.Features(
                        feature={
                            "image": feature(
                                bytes_list=tf.train.BytesList(value=[image.tobytes()])
                            ),
                            "label": feature(int64_list=tf.train.Int64List(value=[int(label)])),
                            "shape": dims,
                        }
                    )
                )
                writer.write(record.SerializeToString())


def write_npy(folder: str, index: int, size: int, first: int, shape, classes: int, seed: int):
    x = np.lib.format.open_memmap(
        os.path.join(folder, f"x-{index:05d}.npy"), "w+", np.uint8, (size, *shape)
    )
    y = np.lib.format.open_memmap(
        os.path.join(folder, f"y-{index:05d}.npy"), "w+", np.int64, (size,)
    )
    for start, (images, labels) in _chunks(size, first, shape, classes, seed):
        x[start : start + len(images)] = images
        y[start : start + len(labels)] = labels
        x.flush()  # written pages leave this process's memory as they go
    del x, y


def make_synthetic(
    out: str, fmt: str, n: int, shape: tuple[int, ...], classes: int, shards: int, seed: int
) -> list[str]:
    """Write the set's shards into `out` (made if missing; refused if it holds shards)."""
    os.makedirs(out, exist_ok=True)
    taken = [f for f in os.listdir(out) if f.endswith((".tfrecord", ".npy"))]
    if taken:
        raise UserError(f"{out} already holds shards ({sorted(taken)[0]}); give an empty folder")
    written, first = [], 0
    for index, size in enumerate(shard_sizes(n, shards)):
        if fmt == "tfrecord":
            path = os.path.join(out, f"data-{index:05d}-of-{shards:05d}.tfrecord")
            write_tfrecord(path, size, first, shape, classes, seed)
        else:
            write_npy(out, index, size, first, shape, classes, seed)
            path = os.path.join(out, f"x-{index:05d}.npy")
        written.append(path)
        first += size
        end = "" if sys.stdout.isatty() else "\n"  # a terminal's line is rewritten in place
        print(f"\rwrote shard {index + 1}/{shards} ({first}/{n} examples)", end=end, flush=True)
    if sys.stdout.isatty():
        print()
    return written


def _shape(text: str) -> tuple[int, int, int]:
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not H,W,C (three positive whole numbers)")
    return dims


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    make = sub.add_parser(
        "make-synthetic",
        prog=f"{p.prog} make-synthetic",
        help="write image-classification shards (TFRecord or .npy) for tests and benchmarks",
    )
    make.add_argument("out", metavar="OUT/", help="the folder to write (empty or missing)")
    make.add_argument("--format", choices=["tfrecord", "npy"], default="tfrecord")
    make.add_argument("--examples", type=positive_whole_number, required=True, metavar="N")
    make.add_argument("--shape", type=_shape, default=(32, 32, 3), metavar="H,W,C")
    make.add_argument("--classes", type=positive_whole_number, default=10, metavar="K")
    make.add_argument("--shards", type=positive_whole_number, default=8, metavar="S")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(prog=make.prog)


def run_data_command(args: argparse.Namespace) -> int:
    if args.shards > args.examples:
        raise UserError(f"--shards {args.shards} exceeds --examples {args.examples}")
    if args.classes < 2:
        raise UserError("--classes must be at least 2")
    make_synthetic(
        args.out, args.format, args.examples, args.shape, args.classes, args.shards, args.seed
    )
    how = "--data ringtrain.synthetic_files:parse_image " if args.format == "tfrecord" else ""
    pattern = "*.tfrecord" if args.format == "tfrecord" else "*.npy"
    print(f"train on it with: --data-files '{os.path.join(args.out, pattern)}' {how}".rstrip())
    return 0
