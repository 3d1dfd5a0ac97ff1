"""Who am I: this process's rank, world size and place on its node, as the launcher set them.

Asked before MPI starts (thread pools are sized first), so the answer comes from the launcher's
environment unless mpi4py already runs MPI. Which launcher set which variable:
- Open MPI's mpirun: OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE (and PMIX_RANK);
- PMIx (srun --mpi=pmix): PMIX_RANK only, there is no PMIX_SIZE; srun adds the SLURM_* below;
- PMI (MPICH or Intel MPI's Hydra, srun --mpi=pmi2): PMI_RANK/PMI_SIZE, Hydra adds
  MPI_LOCALRANKID/MPI_LOCALNRANKS;
- a Slurm step: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and SLURM_STEP_TASKS_PER_NODE at
  SLURM_NODEID for the local size. The batch script has SLURM_PROCID=0 and the job's
  SLURM_NTASKS too, but no SLURM_STEP_ID: it is one process, not rank 0 of a step.
The order matters: mpirun inside an sbatch job inherits the batch script's SLURM_* variables.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from ringtrain.launch.hostfile import expand_tasks_per_node

Env = Mapping[str, str]


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job; `source` names what said so."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node: str
    source: str

    def __post_init__(self) -> None:
        """A launcher variable left over from another job must fail loudly, not mis-shard data."""
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is outside a world of {self.world_size} "
                f"(read from {self.source})"
            )
        grouped = self.source == "group"  # a node may hold ranks of other groups
        if not 0 <= self.local_rank < self.local_size or (
            self.local_size > self.world_size and not grouped
        ):
            raise ValueError(
                f"local rank {self.local_rank} of {self.local_size} does not fit a "
                f"world of {self.world_size} (read from {self.source})"
            )


_group: list[tuple[int, int]] = []  # (rank, size) in the sweep group that trains now


@contextmanager
def as_group(rank: int, size: int) -> Iterator[None]:
    """Within it, who_am_i answers for a group of ranks (a sweep's) as if it were the job; the
    node layout stays the launch's, which sizes the threads and shares the node's memory."""
    _group.append((rank, size))
    try:
        yield
    finally:
        _group.pop()


def who_am_i(environ: Env | None = None) -> RankInfo:
    """Ask MPI if mpi4py already started it, else read the launcher's variables; never start MPI
    here (importing mpi4py.MPI would)."""
    env = os.environ if environ is None else environ
    rank, size, source = _running_mpi_world() or _launcher_world(env)
    local_rank, local_size = _local_layout(env, rank, size)
    if _group and environ is None:
        rank, size, source = *_group[-1], "group"
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    return RankInfo(rank, size, local_rank, local_size, node, source)


def is_rank0() -> bool:
    """Whether this process should write the logs, checkpoints and files that exist once."""
    return who_am_i().rank == 0


def _running_mpi_world() -> tuple[int, int, str] | None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size(), "mpi4py"


def _launcher_world(env: Env) -> tuple[int, int, str]:
    for source, read in _LAUNCHERS:
        world = read(env)
        if world is not None:
            return (*world, source)
    return 0, 1, "single"


def _open_mpi(env: Env) -> tuple[int, int] | None:
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    return _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")


def _pmix(env: Env) -> tuple[int, int] | None:
    if "PMIX_RANK" not in env:
        return None
    if "SLURM_STEP_ID" not in env:
        raise ValueError(
            "PMIX_RANK is set, but no launcher variable gives the world size: "
            "launch with mpirun or srun, or import mpi4py.MPI first"
        )
    return _int(env, "PMIX_RANK"), _int(env, "SLURM_NTASKS")


def _pmi(env: Env) -> tuple[int, int] | None:
    if "PMI_RANK" not in env:
        return None
    return _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")


def _slurm_step(env: Env) -> tuple[int, int] | None:
    if "SLURM_STEP_ID" not in env:
        return None
    return _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")


_LAUNCHERS: list[tuple[str, Callable[[Env], tuple[int, int] | None]]] = [
    ("open-mpi", _open_mpi),
    ("pmix", _pmix),
    ("pmi", _pmi),
    ("slurm", _slurm_step),
]


def _local_layout(env: Env, rank: int, size: int) -> tuple[int, int]:
    """(local rank, local size) from the first launcher that says; if none does, one node."""
    if "OMPI_COMM_WORLD_LOCAL_RANK" in env:
        return _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    if "MPI_LOCALRANKID" in env:
        return _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS")
    if "SLURM_STEP_ID" in env:
        per_node = expand_tasks_per_node(
            _text(env, "SLURM_STEP_TASKS_PER_NODE"), _int(env, "SLURM_STEP_NUM_NODES")
        )
        node_id = _int(env, "SLURM_NODEID")
        if node_id >= len(per_node):
            raise ValueError(f"SLURM_NODEID={node_id} but the step has {len(per_node)} node(s)")
        return _int(env, "SLURM_LOCALID"), per_node[node_id]
    return rank, size


def _text(env: Env, name: str) -> str:
    if name not in env:
        raise ValueError(f"{name} is not set, but the launcher's other variables are")
    return env[name]


def _int(env: Env, name: str) -> int:
    value = _text(env, name)
    if not value.isascii() or not value.isdigit():
        raise ValueError(f"{name}={value!r} is not a whole number")
    return int(value)
