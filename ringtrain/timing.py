"""How ranks time what they run, the same way wherever a figure is measured (the benchmarks,
`ringtrain plan calibrate`): a step over a run of batches, and a collective as its slowest
rank saw it, since a collective is done when its last rank is."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

Collective = Callable[[], object]  # one call; returns the reduced array (or tensor)


def timed_steps(step, batches: np.ndarray) -> float:
    """ms per step over `batches`, after one untimed step."""
    step(batches[0])
    start = time.perf_counter()
    for batch in batches[1:]:
        step(batch)
    return 1e3 * (time.perf_counter() - start) / (len(batches) - 1)


def slowest_rank_seconds(comm, op: Collective, iters: int) -> float:
    """The slowest rank's mean seconds per call over `iters` calls back to back, after a first
    call that is not timed."""
    from mpi4py import MPI

    op()  # first touch of the pages, Horovod's first negotiation
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    mine = np.array([(time.perf_counter() - start) / iters])
    comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
    return float(mine[0])


def horovod_sum(comm, array: np.ndarray) -> Collective:
    """Called from Python on a tensor Python holds: Horovod reduces it out of place."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    tensor = tf.constant(array)
    return lambda: hvd.allreduce(tensor, op=hvd.Sum)
