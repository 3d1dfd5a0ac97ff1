"""The few Horovod calls data parallelism needs, in the form that works with Keras 3.

Keras 3 variables are not tf.Variables, so Horovod's DistributedGradientTape and
broadcast_variables fail on them; we allreduce plain gradient lists and broadcast the backing
tf.Variable (`v.value`) instead.
"""

from __future__ import annotations

from collections.abc import Sequence

MiB = 1 << 20


def average_gradients(hvd, grads: list, fp16: bool = False, process_set=None) -> list:
    """Ring-allreduce average of a gradient list, fused into one grouped collective."""
    compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
    kwargs = {"process_set": process_set} if process_set is not None else {}
    return hvd.grouped_allreduce(grads, op=hvd.Average, compression=compression, **kwargs)


def buckets(nbytes: Sequence[int], cap_mb: float) -> list[list[int]]:
    """Tensor indices in the order the backward produces them (last layer first), cut into
    groups of at most `cap_mb` MiB, so each group's allreduce can start while the backward
    still runs. A tensor larger than the cap is a group of its own."""
    groups: list[list[int]] = [[]]
    filled = 0
    for i in reversed(range(len(nbytes))):
        if groups[-1] and filled + nbytes[i] > cap_mb * MiB:
            groups.append([])
            filled = 0
        groups[-1].append(i)
        filled += nbytes[i]
    return groups if groups[0] else []


def broadcast_state(hvd, variables: Sequence, root_rank: int = 0, process_set=None) -> None:
    """Make every replica start from the root's weights and optimizer slots."""
    kwargs = {"process_set": process_set} if process_set is not None else {}
    hvd.broadcast_variables([v.value for v in variables], root_rank=root_rank, **kwargs)
