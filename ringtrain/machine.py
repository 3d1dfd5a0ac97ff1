"""Facts about this machine and its software stack, read without importing TensorFlow or
starting MPI: what a benchmark's numbers and a calibration depend on, and what the hosts of
one job must agree on."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path


def package_version(*distributions: str) -> str | None:
    """The version of the first of these distributions that is installed (None if none is)."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")


def mpi_version() -> str | None:
    """`mpirun --version`'s first line (None without a working mpirun)."""
    try:
        return subprocess.run(
            ["mpirun", "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return None


def machine_facts() -> dict:
    """The cores, CPU, OS and the versions of the stack the numbers were measured on."""
    return {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": package_version("tensorflow-cpu", "tensorflow"),
        "keras": package_version("keras"),
        "numpy": package_version("numpy"),
        "mpi4py": package_version("mpi4py"),
        "horovod": package_version("horovod"),
        "mpi": mpi_version(),
    }
