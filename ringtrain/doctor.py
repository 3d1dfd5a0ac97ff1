"""`ringtrain doctor`: is this stack able to run ringtrain? Versions, then checks with remedies.

With `--hosts a,b` or `--hostfile FILE` it checks those hosts instead, the way a launcher
started here will use them: reachable by ssh (BatchMode and a short ConnectTimeout, so a dead
host costs seconds, not a hang); `ringtrain` found on the PATH an ssh session gets there, with
the same Python, TensorFlow, Keras, Horovod, mpi4py and MPI library as this host; and a 2-rank
allreduce through Horovod and mpi4py across the first two hosts. RINGTRAIN_NETWORK applies to
every mpirun it starts. Every fault is one `problem:` line naming its host; the exit code is
then 1.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ringtrain.errors import UserError
from ringtrain.launch.hostfile import parse_hostfile
from ringtrain.launch.mpirun import mpi_env
from ringtrain.launch.network import launcher_environment, mca_parameters, unresolved_hosts
from ringtrain.machine import package_version

SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
REMOTE_TIMEOUT = 120  # seconds for a host to import TensorFlow and Horovod and answer
VERSIONS_FLAG = "--report-versions"
ALLREDUCE_FLAG = "--allreduce-rank"


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("--hosts", metavar="A,B,...", help="check these hosts (by ssh)")
    hosts.add_argument("--hostfile", metavar="FILE", help="check the hosts of this file")
    # What doctor runs on the other hosts and in its ranks; not for users.
    parser.add_argument(VERSIONS_FLAG, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(ALLREDUCE_FLAG, action="store_true", help=argparse.SUPPRESS)


def _loaded_mpi_libraries() -> set[str]:
    """Every libmpi the process has mapped: two different ones mean two MPIs in one process."""
    with open("/proc/self/maps") as maps:
        return {
            line.split()[-1]
            for line in maps
            if "/libmpi.so" in line or "/libmpi_" in line.split("/")[-1][:8]
        }


def versions() -> dict[str, str]:
    """The versions a rank's stack is made of; hosts of one job must agree on all of them.
    Read from the installed packages' metadata and the MPI library itself, without importing
    TensorFlow, so a remote host answers in about a second."""
    import mpi4py
    from mpi4py import MPI  # Get_library_version needs no MPI_Init

    return {
        "python": platform.python_version(),
        "tensorflow": _installed("tensorflow", "tensorflow-cpu"),
        "keras": _installed("keras"),
        "horovod": _installed("horovod"),
        "mpi4py": mpi4py.__version__,
        "MPI library": MPI.Get_library_version().splitlines()[0].strip(" \x00"),
    }


def _installed(*distributions: str) -> str:
    return package_version(*distributions) or "not installed"


def _local_checks(problems: list[str]) -> None:
    import mpi4py

    mpi4py.rc.thread_level = "multiple"
    local = versions()
    for name in ("python", "tensorflow", "keras", "mpi4py", "MPI library"):
        print(f"{name:11} {local[name]}")
    try:
        import horovod.tensorflow as hvd
    except Exception as exc:  # any import failure is the finding itself
        problems.append(
            f"Horovod's TensorFlow ops do not load ({exc.__class__.__name__}: "
            f"{str(exc).splitlines()[0]}): rerun scripts/setup.sh to rebuild Horovod"
        )
        return
    print(
        f"horovod     {local['horovod']}: frameworks TensorFlow; controllers "
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
    from mpi4py import MPI

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
    env = mpi_env()
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


def hosts_to_check(args: argparse.Namespace | None) -> list[str]:
    """The hosts of --hosts or --hostfile, in order; a bad list or file is a UserError."""
    if args is None or (args.hosts is None and args.hostfile is None):
        return []
    if args.hosts is not None:
        hosts = [h.strip() for h in args.hosts.split(",")]
        if not all(hosts):
            raise UserError(f"--hosts {args.hosts!r}: give names separated by commas")
        return list(dict.fromkeys(hosts))
    try:
        text = Path(args.hostfile).read_text()
    except OSError as exc:
        raise UserError(f"--hostfile {args.hostfile}: {exc.strerror}") from None
    pairs, bad = parse_hostfile(text, "mpirun")
    if bad:
        raise UserError(f"--hostfile {args.hostfile}: {bad[0]}")
    return [host for host, _ in pairs]


def _ssh(host: str, command: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ssh", *SSH_OPTIONS, host, command],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def check_host(host: str, local: dict[str, str]) -> list[str]:
    """Problems of one host, each naming it: resolution, ssh, PATH, versions."""
    unresolved = unresolved_hosts([host])
    if unresolved:
        return unresolved
    if shutil.which("ssh") is None:
        return [f"host {host}: no ssh client on this host (install openssh-client)"]
    try:
        reach = _ssh(host, "true", timeout=30)
    except subprocess.TimeoutExpired:
        return [f"host {host}: ssh did not answer in 30 s"]
    if reach.returncode != 0:
        why = (reach.stderr.strip().splitlines() or [f"exit {reach.returncode}"])[-1]
        return [
            f"host {host}: not reachable by ssh without a password ({why}); launchers start "
            "ranks over ssh"
        ]
    try:
        done = _ssh(
            host, f'echo "PATH=$PATH"; exec ringtrain doctor {VERSIONS_FLAG}', REMOTE_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return [f"host {host}: `ringtrain doctor` did not answer over ssh in {REMOTE_TIMEOUT} s"]
    lines = done.stdout.splitlines()
    path = next((line[5:] for line in lines if line.startswith("PATH=")), "?")
    if done.returncode == 127:
        return [
            f"host {host}: `ringtrain` is not on the PATH an ssh session gets there "
            f"(PATH={path}): activate the venv in the shell startup file, or install it there"
        ]
    try:
        remote = json.loads(next(line for line in lines if line.startswith("{")))
    except (StopIteration, ValueError):
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return [f"host {host}: `ringtrain doctor` failed over ssh ({last})"]
    return [
        f"host {host} has {name} {remote.get(name, 'missing')}, this host {mine}: the ranks "
        "of one job need the same stack (install the same venv there)"
        for name, mine in local.items()
        if remote.get(name) != mine
    ]


def _allreduce_across(hosts: list[str], problems: list[str]) -> None:
    """mpirun over ssh to the first two hosts, started as a user would: `ringtrain` by name."""
    cmd = ["mpirun", "-np", "2", "-H", f"{hosts[0]}:1,{hosts[1]}:1", "--bind-to", "none"]
    network = launcher_environment()
    if "OMPI_MCA_oob_tcp_if_include" in network:  # an mpirun flag beats an inherited variable
        cidr = network["OMPI_MCA_oob_tcp_if_include"]
        for key, value in mca_parameters(cidr).items():
            cmd += ["--mca", key, value]
    cmd += ["ringtrain", "doctor", ALLREDUCE_FLAG]
    env = mpi_env()
    where = f"across {hosts[0]} and {hosts[1]}"
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    except subprocess.TimeoutExpired:
        problems.append(f"a 2-rank allreduce {where} did not finish in 180 s")
        return
    verdicts = [line for line in done.stdout.splitlines() if line.startswith("allreduce")]
    for line in verdicts:
        print(f"{line} ({where})")
    if done.returncode != 0 or len(verdicts) != 1 or "wrong" in verdicts[0]:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        problems.append(
            f"a 2-rank allreduce {where} failed (exit {done.returncode}: {last}); check "
            f"`mpirun -np 2 -H {hosts[0]}:1,{hosts[1]}:1 hostname` and RINGTRAIN_NETWORK"
        )


def _check_hosts(hosts: list[str], local: dict[str, str], problems: list[str]) -> None:
    with ThreadPoolExecutor(max_workers=min(8, len(hosts))) as pool:
        per_host = list(pool.map(lambda h: check_host(h, local), hosts))
    for host, found in zip(hosts, per_host, strict=True):
        print(f"host {host}: {'ok' if not found else 'PROBLEM'}")
        problems.extend(found)
    if len(hosts) >= 2 and not per_host[0] and not per_host[1]:
        _allreduce_across(hosts, problems)


def main(args: argparse.Namespace | None = None) -> int:
    if args is not None and args.allreduce_rank:
        allreduce_rank()
        return 0
    if args is not None and args.report_versions:
        import mpi4py

        mpi4py.rc.initialize = False  # versions only: no MPI start-up on the remote host
        print(json.dumps(versions()), flush=True)
        return 0
    hosts = hosts_to_check(args)
    launcher_environment()  # a RINGTRAIN_NETWORK that fits no interface: one line, now
    problems: list[str] = []
    if shutil.which("mpirun") is None:  # even a single MPI process needs Open MPI's runtime
        problems.append(
            "mpirun is not on PATH: install openmpi-bin (Debian/Ubuntu) or load your "
            "site's MPI module; the other checks need it"
        )
    elif hosts:  # the hosts of a job launched from here; plain `doctor` checks this one
        local = versions()
        print(", ".join(f"{name} {version}" for name, version in local.items()))
        _check_hosts(hosts, local, problems)
    else:
        _local_checks(problems)
        _two_rank_check(problems)
    if problems:
        for problem in problems:
            print(f"problem: {problem}", file=sys.stderr)
        return 1
    print(f"ok: ringtrain can run on {', '.join(hosts)}" if hosts else "ok: ringtrain can run here")
    return 0


if __name__ == "__main__":
    if ALLREDUCE_FLAG in sys.argv:
        allreduce_rank()
    else:
        sys.exit(main())
