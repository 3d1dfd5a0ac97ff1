"""`ringtrain doctor`: is this stack able to run ringtrain? Versions, then checks with remedies."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys

ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def _loaded_mpi_libraries() -> set[str]:
    """Every libmpi the process has mapped: two different ones mean two MPIs in one process."""
    with open("/proc/self/maps") as maps:
        return {
            line.split()[-1]
            for line in maps
            if "/libmpi.so" in line or "/libmpi_" in line.split("/")[-1][:8]
        }


def _local_checks(problems: list[str]) -> None:
    import mpi4py

    mpi4py.rc.thread_level = "multiple"
    import keras
    import tensorflow as tf
    from mpi4py import MPI

    print(f"python      {platform.python_version()}")
    print(f"tensorflow  {tf.__version__}")
    print(f"keras       {keras.__version__}")
    print(f"mpi4py      {mpi4py.__version__}")
    print(f"MPI library {MPI.Get_library_version().splitlines()[0].strip()}")
    try:
        import horovod
        import horovod.tensorflow as hvd
    except Exception as exc:  # any import failure is the finding itself
        problems.append(
            f"Horovod's TensorFlow ops do not load ({exc.__class__.__name__}: "
            f"{str(exc).splitlines()[0]}): rerun scripts/setup.sh to rebuild Horovod"
        )
        return
    print(
        f"horovod     {horovod.__version__}: frameworks TensorFlow; controllers "
        f"MPI={'yes' if hvd.mpi_built() else 'no'} Gloo={'yes' if hvd.gloo_built() else 'no'}; "
        f"NCCL={'yes' if hvd.nccl_built() else 'no'}"
    )
    if not hvd.mpi_built():
        problems.append(
            "Horovod was built without MPI: rebuild with HOROVOD_WITH_MPI=1 "
            "(rm -rf ~/.cache/ringtrain/wheels and rerun scripts/setup.sh)"
        )
    libraries = _loaded_mpi_libraries()
    print(f"libmpi      {', '.join(sorted(libraries)) or 'none mapped'}")
    if len(libraries) > 1:
        problems.append(
            f"Horovod and mpi4py load different MPI libraries ({', '.join(sorted(libraries))}): "
            "rebuild both against the MPI on PATH"
        )
    level = MPI.Query_thread()
    if level != MPI.THREAD_MULTIPLE:
        problems.append(
            f"MPI gives thread level {level}, not MULTIPLE: the pipeline's watchdog "
            "needs an MPI built with thread support"
        )


def _two_rank_check(problems: list[str]) -> None:
    mpirun = shutil.which("mpirun")
    cmd = [
        mpirun,
        "-np",
        "2",
        "--oversubscribe",
        sys.executable,
        "-m",
        "ringtrain.doctor",
        "--allreduce-rank",
    ]
    env = {**os.environ, **ROOT_OK, "TF_CPP_MIN_LOG_LEVEL": "3"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        problems.append(
            "a 2-rank allreduce did not finish in 120 s: check that MPI can start "
            "2 processes here (mpirun -np 2 hostname)"
        )
        return
    verdicts = [line for line in done.stdout.splitlines() if line.startswith("allreduce")]
    for line in verdicts:
        print(line)
    if done.returncode != 0 or len(verdicts) != 1 or any("wrong" in v for v in verdicts):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        problems.append(
            f"a 2-rank allreduce through mpirun failed (exit {done.returncode}: "
            f"{last}): run `mpirun -np 2 hostname` to check MPI itself"
        )


def allreduce_rank() -> None:
    """Run inside mpirun: sum (rank + 1) with Horovod and with mpi4py; both must give 3."""
    import mpi4py

    mpi4py.rc.thread_level = "multiple"
    import horovod.tensorflow as hvd
    import numpy as np
    from mpi4py import MPI

    hvd.init(comm=MPI.COMM_WORLD)
    rank = MPI.COMM_WORLD.Get_rank()
    expected = float(sum(range(1, MPI.COMM_WORLD.Get_size() + 1)))
    horovod_sum = float(hvd.allreduce(np.float32(rank + 1), op=hvd.Sum))
    buf = np.array([rank + 1.0])
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf)
    ok = np.array([horovod_sum == expected and buf[0] == expected], dtype=np.int32)
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, ok, op=MPI.MIN)  # rank 0 speaks for every rank
    if rank == 0:
        print(
            f"allreduce over {MPI.COMM_WORLD.Get_size()} ranks: horovod {horovod_sum:g}, "
            f"mpi4py {buf[0]:g}, expected {expected:g}: {'ok' if ok[0] else 'wrong'}",
            flush=True,
        )


def main(args: argparse.Namespace | None = None) -> int:
    problems: list[str] = []
    if shutil.which("mpirun") is None:  # even a single MPI process needs Open MPI's runtime
        problems.append(
            "mpirun is not on PATH: install openmpi-bin (Debian/Ubuntu) or load your "
            "site's MPI module; the other checks need it"
        )
    else:
        _local_checks(problems)
        _two_rank_check(problems)
    if problems:
        for problem in problems:
            print(f"problem: {problem}", file=sys.stderr)
        return 1
    print("ok: ringtrain can run here")
    return 0


if __name__ == "__main__":
    if "--allreduce-rank" in sys.argv:
        allreduce_rank()
    else:
        sys.exit(main())
