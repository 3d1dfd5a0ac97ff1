"""The `mpirun` commands ringtrain starts itself (calibration, benchmarks, doctor's checks):
its flags, and the environment its ranks get, the one `mpirun ringtrain train` would see."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ringtrain.launch.network import launcher_environment

ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def mpi_env(threads: int | None = None) -> dict[str, str]:
    """Open MPI as root, TensorFlow quiet, RINGTRAIN_NETWORK (if set) as Open MPI's and
    Horovod's interface choice, and every rank's pools `threads` wide (None: the caller's
    RINGTRAIN_THREADS if any, else ringtrain's own rule, as `mpirun ringtrain train` gets)."""
    chosen = {} if threads is None else {"RINGTRAIN_THREADS": str(threads)}
    return {**os.environ, **ROOT_OK, **QUIET, **launcher_environment(), **chosen}


def mpirun_command(
    ranks: int,
    module: str,
    *args: str,
    binding: str | None = None,
    placement: Sequence[str] = (),
    forward_threads: bool = True,
) -> list[str]:
    """`mpirun` running a Python module in every rank (oversubscription allowed: the benches
    run more ranks than cores on purpose, and say so). binding, if given, is `--bind-to`'s
    value; without it Open MPI binds as it likes (to a core each for up to 2 ranks).
    placement: host flags (`host_flags`). forward_threads passes RINGTRAIN_THREADS to every
    rank, remote ones too; leave it off where the variable may be unset (-x warns then)."""
    return [
        "mpirun",
        "--oversubscribe",
        *(binding_flags(binding) if binding else []),
        *placement,
        "-np",
        str(ranks),
        *(["-x", "RINGTRAIN_THREADS"] if forward_threads else []),
        sys.executable,
        "-m",
        module,
        *args,
    ]


def host_flags(hosts: str | None, count: int = 2) -> list[str]:
    """mpirun flags placing a rank on each of `count` hosts (`--hosts a,b`), unbound: a
    rehearsal node's cores are its own."""
    if not hosts:
        return []
    names = hosts.split(",")
    if len(names) != count or not all(names):
        example = ",".join("abcdefgh"[:count])
        raise argparse.ArgumentTypeError(
            f"--hosts wants {count} hosts like {example}, got {hosts!r}"
        )
    return ["--bind-to", "none", "-H", ",".join(f"{h}:1" for h in names)]


def binding_flags(binding: str) -> list[str]:
    """The mpirun flags for a `--bind-to` value, also recorded in the benches' JSON."""
    return ["--bind-to", binding]
