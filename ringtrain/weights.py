"""Weights on disk under stable names (the variables' paths: layerNN/... for a built-in), the
same for every strategy, so any run's output loads into the single-process model with one
call."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ringtrain.errors import UserError


def by_path(variables: Sequence) -> dict[str, np.ndarray]:
    """The variables' values keyed by their paths, in the order given."""
    return {v.path: np.asarray(v.numpy()) for v in variables}


def save_npz(path: str, weights: dict[str, np.ndarray]) -> None:
    """Write atomically: a crash leaves either the old file or the new one, never half of one."""
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    np.savez(tmp, **weights)
    os.replace(tmp, path)


def load_weights(model, path: str) -> None:
    """Load a --weights-out file into a model of the same layers (e.g. a built-in made by
    ringtrain.mlp with the run's shapes): each weight by its path, never unpickled."""
    with np.load(path, allow_pickle=False) as stored:
        for variable in model.trainable_weights:
            if variable.path not in stored.files:
                raise UserError(f"{path} has no weight {variable.path}")
            variable.assign(stored[variable.path])


def variable_bytes(variables: Sequence) -> list[int]:
    """Each variable's size in bytes: what its gradient moves in an allreduce."""
    return [int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables]


def replica_checksums(comm, variables) -> list[float]:
    """Every rank's weight checksum, gathered as a buffer, so a test can see all replicas agree."""
    mine = np.array([sum(float(np.sum(np.abs(v.numpy()), dtype=np.float64)) for v in variables)])
    every = np.empty(comm.Get_size(), dtype=np.float64)
    comm.Allgather(mine, every)
    return every.tolist()
