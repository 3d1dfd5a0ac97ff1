"""The input pipeline of `ringtrain bench input` alone, in one process, without training.

    python -m ringtrain.bench.input_worker 'SET/*.tfrecord' SECONDS

It indexes the TFRecord files as a rank does (ringtrain.records), then reads and parses global
batches in the order training takes them (the shuffled first epoch) until SECONDS have passed
or the set is read, on one compute thread as a bench rank has. It prints one protocol line:
records/s, bytes/s and the CPU seconds the pipeline used, which is what a read-ahead takes from
a rank's step when both share a core.
"""

from __future__ import annotations

import sys
import time

from ringtrain.bench import common
from ringtrain.bench.input_bench import BATCH, SEED


def read_bytes() -> int:
    """What this process has read from storage so far (/proc/self/io; 0 elsewhere)."""
    try:
        with open("/proc/self/io") as io:
            return next(int(ln.split()[1]) for ln in io if ln.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return 0


def main(pattern: str, seconds: float) -> None:
    from ringtrain.tensorflow_loader import tf

    tf.config.threading.set_intra_op_parallelism_threads(1)  # a bench rank's share
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from ringtrain.config import TrainConfig
    from ringtrain.data import batches_of
    from ringtrain.records import parsed_records
    from ringtrain.shards import shard_order
    from ringtrain.synthetic_files import parse_image

    started, disk = time.perf_counter(), read_bytes()
    records = parsed_records(pattern, parse_image, "--data-files")
    indexed, cpu, disk_indexed = time.perf_counter(), time.process_time(), read_bytes()
    examples = records.examples()
    count, until = 0, indexed + seconds
    order = shard_order(records.files.rows, SEED, 0, TrainConfig().shuffle_buffer)
    for batch in batches_of(order, BATCH, False):
        images, _ = examples.take(batch)
        count += len(images)
        if time.perf_counter() > until:
            break
    ended = time.perf_counter()
    common.reply(
        {
            "set_records": records.n_examples,
            "records": count,
            "record_bytes": int(records.files.offsets[0][0, 1]),
            "index_seconds": indexed - started,
            "seconds": ended - indexed,
            "records_per_sec": count / (ended - indexed),
            "cpu_seconds": time.process_time() - cpu,
            "index_read_bytes": disk_indexed - disk,
            "read_bytes": read_bytes() - disk_indexed,
        }
    )


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
