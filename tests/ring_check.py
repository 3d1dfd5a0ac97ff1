"""Runs inside every rank of one mpirun: ringtrain's ring allreduce against MPI's Allreduce,
for sizes divisible by the rank count or not (and smaller than it), in three dtypes. Rank 0
prints one JSON line with every failure from every rank.

    mpirun -np N python tests/ring_check.py
"""

from __future__ import annotations

import json

import numpy as np
from mpi4py import MPI

from ringtrain.bench.ring import ring_allreduce

SIZES = [0, 1, 2, 3, 5, 7, 64, 1000, 1001, 4099, 65537]
DTYPES = [np.float32, np.float64, np.int32]
TOLERANCE = {np.float32: 1e-6, np.float64: 1e-12}


def cases(n: int, dtype, rank: int) -> list[tuple[str, np.ndarray]]:
    """Whole numbers sum exactly in any order, so there the results must be identical; random
    floats may round differently, since the ring adds in another order than MPI."""
    rng = np.random.default_rng([n, rank])
    found = [("whole", rng.integers(-1000, 1000, n).astype(dtype))]
    if dtype in TOLERANCE:
        found.append(("random", rng.standard_normal(n).astype(dtype)))
    return found


def check(comm, name: str, x: np.ndarray, tolerance: float | None) -> dict | None:
    original = x.copy()
    expected = np.empty_like(x)
    comm.Allreduce(np.ascontiguousarray(x), expected, op=MPI.SUM)
    got = ring_allreduce(comm, x)
    if tolerance is None:
        same = np.array_equal(got, expected)
    else:
        same = np.allclose(got, expected, rtol=tolerance, atol=tolerance)
    ok = same and got.dtype == x.dtype and got.shape == x.shape and np.array_equal(x, original)
    return None if ok else {"rank": comm.Get_rank(), "case": name}


def main() -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    failures, checked = [], 0
    for n in SIZES:
        for dtype in DTYPES:
            for kind, x in cases(n, dtype, rank):
                tolerance = TOLERANCE[dtype] if kind == "random" else None
                failures.append(check(comm, f"{kind} {np.dtype(dtype).name} n={n}", x, tolerance))
                checked += 1
    grid = np.arange(48, dtype=np.float64).reshape(6, 8)[:, ::2] * (rank + 1)  # 2-D, strided
    failures.append(check(comm, "2-D strided float64", grid, None))
    checked += 1
    gathered = comm.gather([f for f in failures if f], root=0)
    if rank == 0:
        every = [f for mine in gathered for f in mine]
        print(json.dumps({"ranks": comm.Get_size(), "checked": checked, "failures": every}))


if __name__ == "__main__":
    main()
