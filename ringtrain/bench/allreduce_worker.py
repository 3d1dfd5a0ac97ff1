"""Runs inside every rank of `mpirun -np N`: allreduce timings for each contender and size.

Rounds alternate the contenders (Horovod, mpi4py's Allreduce, the hand-written ring, then
memcpy on rank 0 alone); within its turn a contender runs every size. Each rank times its own
calls and the slowest rank's time counts, since a collective is done when its last rank is.
Horovod runs only during its own turn (its idle thread would tax the others). Rank 0 writes
every raw timing to the JSON file given.

    mpirun -np N python -m ringtrain.bench.allreduce_worker OUT ROUNDS SIZES BUDGET MAX_ITERS
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext

import numpy as np

from ringtrain import runtime
from ringtrain.bench.common import horovod_running, idle_barrier
from ringtrain.bench.ring import ring_allreduce


def iterations(nbytes: int, budget: int, max_iters: int) -> int:
    """Enough calls to move about `budget` bytes: many small ones, a few large ones."""
    return int(min(max_iters, max(5, budget // nbytes)))


def _slowest_rank_seconds(comm, op: Callable[[], object], iters: int) -> float:
    from mpi4py import MPI

    op()  # first touch of the pages, Horovod's first negotiation
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    mine = np.array([(time.perf_counter() - start) / iters])
    comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
    return float(mine[0])


def _memcpy_seconds(comm, array: np.ndarray, iters: int) -> float | None:
    """np.copyto on rank 0 while the others sleep: one core's memory bandwidth."""
    if comm.Get_rank() == 0:
        target = np.empty_like(array)
        np.copyto(target, array)
        start = time.perf_counter()
        for _ in range(iters):
            np.copyto(target, array)
        seconds = (time.perf_counter() - start) / iters
    idle_barrier(comm)
    return seconds if comm.Get_rank() == 0 else None


def _horovod(comm, array: np.ndarray) -> Callable[[], object]:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    tensor = tf.constant(array)
    return lambda: hvd.allreduce(tensor, op=hvd.Sum)


def _mpi_allreduce(comm, array: np.ndarray) -> Callable[[], object]:
    from mpi4py import MPI

    received = np.empty_like(array)
    return lambda: comm.Allreduce(array, received, op=MPI.SUM)


def _ring(comm, array: np.ndarray) -> Callable[[], object]:
    return lambda: ring_allreduce(comm, array)


COLLECTIVES = {"horovod": _horovod, "mpi4py Allreduce": _mpi_allreduce, "ring": _ring}


def _one_round(comm, arrays: dict[int, np.ndarray], budget: int, max_iters: int) -> list[dict]:
    rows = []
    for name, make in COLLECTIVES.items():
        with horovod_running(comm) if name == "horovod" else nullcontext():
            for nbytes, array in arrays.items():
                iters = iterations(nbytes, budget, max_iters)
                seconds = _slowest_rank_seconds(comm, make(comm, array), iters)
                rows.append(
                    {"contender": name, "bytes": nbytes, "iters": iters, "seconds": seconds}
                )
    for nbytes, array in arrays.items():
        iters = iterations(nbytes, budget, max_iters)
        seconds = _memcpy_seconds(comm, array, iters)
        rows.append({"contender": "memcpy", "bytes": nbytes, "iters": iters, "seconds": seconds})
    return rows


def main(out_path: str, rounds: int, sizes: list[int], budget: int, max_iters: int) -> None:
    world = runtime.start(with_horovod=False)
    import tensorflow as tf

    rng = np.random.default_rng(world.rank)
    arrays = {n: rng.random(n // 4, dtype=np.float32) for n in sizes}
    rows = []
    for round_index in range(rounds):
        rows += [
            {"round": round_index, **r} for r in _one_round(world.comm, arrays, budget, max_iters)
        ]
    if world.rank == 0:
        settings = (
            "HOROVOD_CYCLE_TIME",
            "HOROVOD_FUSION_THRESHOLD",
            "OMPI_MCA_mpi_yield_when_idle",
        )
        with open(out_path, "w") as out:
            json.dump(
                {
                    "ranks": world.size,
                    "rows": rows,
                    "threads": {
                        "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
                        "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
                    },
                    "environment": {k: os.environ.get(k) for k in settings},
                },
                out,
            )


if __name__ == "__main__":
    main(
        sys.argv[1],
        int(sys.argv[2]),
        [int(s) for s in sys.argv[3].split(",")],
        int(sys.argv[4]),
        int(sys.argv[5]),
    )
