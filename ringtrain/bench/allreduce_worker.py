"""Runs inside every rank of `mpirun -np N`: allreduce timings for each contender and size.

Rounds alternate the contenders (Horovod called from Python and inside a compiled step,
mpi4py's Allreduce out of place and in place, the hand-written ring, then memcpy on rank 0
alone); within its turn a contender runs every size.
Each rank times its own calls and the slowest rank's time counts, since a collective is done
when its last rank is. Horovod runs only during its own turn (its idle thread would tax the
others). After its timed calls each collective is checked: one more call on a fresh buffer
must give, on every rank, exactly the sum every rank computes locally from all ranks' inputs
(whole numbers in float32, so the sum is exact in any order). memcpy copies a buffer twice the
last-level cache, so it measures memory, not cache. Rank 0 writes every raw timing, the check
and every rank's Cpus_allowed_list to the JSON file given.

    mpirun -np N python -m ringtrain.bench.allreduce_worker OUT ROUNDS SIZES BUDGET MAX_ITERS
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from ringtrain import runtime
from ringtrain.bench.common import (
    horovod_running,
    idle_barrier,
    ranks_cpus_allowed,
    settings_in_force,
)
from ringtrain.bench.ring import ring_allreduce
from ringtrain.timing import Collective, horovod_sum, slowest_rank_seconds


def iterations(nbytes: int, budget: int, max_iters: int) -> int:
    """Enough calls to move about `budget` bytes: many small ones, a few large ones."""
    return int(min(max_iters, max(5, budget // nbytes)))


def payload(rank: int, nbytes: int) -> np.ndarray:
    """A rank's input: whole numbers below 1024 as float32, whose sums are exact in any order."""
    rng = np.random.default_rng(rank)
    return rng.integers(0, 1024, nbytes // 4).astype(np.float32)


def last_level_cache_bytes() -> int:
    """The largest cache of cpu0, from sysfs (0 where it cannot be read)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        scale = {"K": 1024, "M": 1024 * 1024}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes, default=0)


def _memcpy_seconds(comm, nbytes: int, iters: int) -> float | None:
    """np.copyto on rank 0 while the others sleep: one core's memory bandwidth."""
    seconds = None
    if comm.Get_rank() == 0:
        source = payload(0, nbytes)
        target = np.empty_like(source)
        np.copyto(target, source)
        start = time.perf_counter()
        for _ in range(iters):
            np.copyto(target, source)
        seconds = (time.perf_counter() - start) / iters
    idle_barrier(comm)
    return seconds


def horovod_in_step(comm, array: np.ndarray) -> Collective:
    """As ringtrain's compiled step calls it: on the flat buffer the step concatenates from its
    gradients, which nothing else holds, so ringtrain's Horovod build reduces it in its own
    buffer (MPI_IN_PLACE). The call is timed with its concatenation; `.producer`, the
    concatenation alone, is timed right after it and subtracted."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    halves = [tf.constant(part) for part in np.array_split(array, 2)]

    @tf.function
    def step(*parts):
        return hvd.allreduce(tf.concat(parts, 0), op=hvd.Sum)

    @tf.function
    def concat(*parts):
        return tf.concat(parts, 0)

    def op():
        return step(*halves)

    op.producer = lambda: concat(*halves)
    return op


def mpi_out_of_place(comm, array: np.ndarray) -> Collective:
    from mpi4py import MPI

    received = np.empty_like(array)

    def op() -> np.ndarray:
        comm.Allreduce(array, received, op=MPI.SUM)
        return received

    return op


def mpi_in_place(comm, array: np.ndarray) -> Collective:
    """The sum replaces the buffer: no second buffer, no copy. Over the timed calls the values
    grow to inf, which SIMD adds at full speed; the check makes a fresh buffer."""
    from mpi4py import MPI

    buffer = array.copy()

    def op() -> np.ndarray:
        comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        return buffer

    return op


def _ring(comm, array: np.ndarray) -> Collective:
    return lambda: ring_allreduce(comm, array)


COLLECTIVES = {
    "horovod": horovod_sum,
    "horovod in a step": horovod_in_step,
    "mpi4py Allreduce": mpi_out_of_place,
    "mpi4py Allreduce IN_PLACE": mpi_in_place,
    "ring": _ring,
}


def self_check(name: str, make, comm, array: np.ndarray, expected: np.ndarray) -> str | None:
    """None if a fresh call gives exactly the expected sum on this rank, else what went wrong."""
    got = np.asarray(make(comm, array)())
    if got.shape == expected.shape and np.array_equal(got, expected):
        return None
    wrong = int(np.sum(got != expected)) if got.shape == expected.shape else got.size
    return (
        f"{name}, {array.nbytes} bytes, rank {comm.Get_rank()}: {wrong} of {expected.size} "
        "elements differ from the locally computed sum"
    )


def _one_round(comm, inputs: dict, budget: int, max_iters: int, checks: list) -> list[dict]:
    """Every collective at every size, each checked after its timed calls."""
    rows = []
    for name, make in COLLECTIVES.items():
        with horovod_running(comm) if name.startswith("horovod") else nullcontext():
            for nbytes, (array, expected) in inputs.items():
                op = make(comm, array)
                iters = iterations(nbytes, budget, max_iters)
                row = {"contender": name, "bytes": nbytes, "iters": iters}
                row["seconds"] = slowest_rank_seconds(comm, op, iters)
                if hasattr(op, "producer"):  # what made the input is not the allreduce's time
                    row["producer_seconds"] = slowest_rank_seconds(comm, op.producer, iters)
                    row["seconds"] -= row["producer_seconds"]
                checks.append(self_check(name, make, comm, array, expected))
                rows.append(row)
    return rows


def _memcpy_rows(comm, budget: int, max_iters: int) -> list[dict]:
    """One copy of twice the last-level cache; none where the cache size is unknown, since a
    copy that fits in cache would pass for memory bandwidth."""
    nbytes = 2 * last_level_cache_bytes()
    if not nbytes:
        return []
    iters = iterations(nbytes, budget, max_iters)
    seconds = _memcpy_seconds(comm, nbytes, iters)
    return [{"contender": "memcpy", "bytes": nbytes, "iters": iters, "seconds": seconds}]


def main(out_path: str, rounds: int, sizes: list[int], budget: int, max_iters: int) -> None:
    world = runtime.start(with_horovod=False, horovod_later=True)
    import tensorflow as tf

    inputs = {
        n: (payload(world.rank, n), sum(payload(r, n) for r in range(world.size))) for n in sizes
    }
    rows, checks = [], []
    for round_index in range(rounds):
        measured = _one_round(world.comm, inputs, budget, max_iters, checks)
        measured += _memcpy_rows(world.comm, budget, max_iters)
        rows += [{"round": round_index, **r} for r in measured]
    failures = world.comm.gather([c for c in checks if c is not None], root=0)
    cpus = ranks_cpus_allowed(world.comm)
    if world.rank == 0:
        report = {
            "ranks": world.size,
            "rows": rows,
            "self_check": {
                "checked": len(checks) * world.size,
                "failures": [f for per_rank in failures for f in per_rank],
            },
            "cpus_allowed_list": cpus,
            "last_level_cache_bytes": last_level_cache_bytes(),
            "threads": {
                "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
                "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
            },
            "environment": settings_in_force(),
        }
        Path(out_path).write_text(json.dumps(report))


if __name__ == "__main__":
    main(
        sys.argv[1],
        int(sys.argv[2]),
        [int(s) for s in sys.argv[3].split(",")],
        int(sys.argv[4]),
        int(sys.argv[5]),
    )
