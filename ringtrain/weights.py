"""Weights on disk under stable names (layerNN/<path inside the element>), the same for every
strategy, so any run's output loads into the single-process model with one call."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ringtrain.errors import UserError


def named_weights(elements: Sequence) -> dict[str, np.ndarray]:
    """Trainable weights of built elements, keyed by their stable names, in model order."""
    return {v.path: np.asarray(v.numpy()) for e in elements for v in e.trainable_weights}


def save_npz(path: str, weights: dict[str, np.ndarray]) -> None:
    """Write atomically: a crash leaves either the old file or the new one, never half of one."""
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    np.savez(tmp, **weights)
    os.replace(tmp, path)


def load_weights(elements: Sequence, path: str) -> None:
    """Load a --weights-out file into built elements (e.g. ModelSpec.build(range(n), seed))."""
    with np.load(path, allow_pickle=False) as stored:
        for element in elements:
            for variable in element.trainable_weights:
                if variable.path not in stored.files:
                    raise UserError(f"{path} has no weight {variable.path}")
                variable.assign(stored[variable.path])


UPDATE_RTOL, UPDATE_ATOL = 1e-4, 1e-7
# --fp16-allreduce rounds every averaged gradient to half precision (11 significant bits) on
# purpose, so its updates are held to their own, measured bound instead of UPDATE_RTOL.
FP16_ALLREDUCE_RTOL = 1e-2


@dataclass(frozen=True)
class UpdateComparison:
    """How far one run's weight update is from a reference update, tensor by tensor.

    `worst_tensor` used the largest share of its allowance: `worst_ratio` is that tensor's
    ||dw_run - dw_ref|| over rtol * ||dw_ref|| + atol (at most 1 passes), `worst_relative` its
    ||dw_run - dw_ref|| / ||dw_ref||.
    """

    worst_tensor: str
    worst_ratio: float
    worst_relative: float
    passed: bool


def compare_updates(
    initial: dict[str, np.ndarray],
    run: dict[str, np.ndarray],
    reference: dict[str, np.ndarray],
    rtol: float = UPDATE_RTOL,
    atol: float = UPDATE_ATOL,
) -> UpdateComparison:
    """Compare updates (final minus initial weights), not weights: the unchanged initial
    weights would otherwise dominate the scale and hide a wrong update. The absolute term keeps
    tensors that barely move (a dead unit's bias) from failing on rounding alone."""
    if not initial.keys() == run.keys() == reference.keys():
        names = (initial.keys() | run.keys() | reference.keys()) - (
            initial.keys() & run.keys() & reference.keys()
        )
        raise ValueError(f"different weight names: {sorted(names)}")
    rows = []
    for name in sorted(reference):
        start = initial[name].astype(np.float64)
        ref_update = reference[name].astype(np.float64) - start
        miss = float(np.linalg.norm(run[name].astype(np.float64) - start - ref_update))
        scale = float(np.linalg.norm(ref_update))
        relative = miss / scale if scale > 0 else (0.0 if miss == 0 else float("inf"))
        rows.append((miss / (rtol * scale + atol), relative, name))
    ratio, relative, name = max(rows)
    return UpdateComparison(name, ratio, relative, ratio <= 1.0)


def variable_bytes(variables: Sequence) -> list[int]:
    """Each variable's size in bytes: what its gradient moves in an allreduce."""
    return [int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables]


def replica_checksums(comm, variables) -> list[float]:
    """Every rank's weight checksum, gathered as a buffer, so a test can see all replicas agree."""
    mine = np.array([sum(float(np.sum(np.abs(v.numpy()), dtype=np.float64)) for v in variables)])
    every = np.empty(comm.Get_size(), dtype=np.float64)
    comm.Allgather(mine, every)
    return every.tolist()
