"""Open MPI's out-of-band keepalive, on by default wherever ringtrain's environment launches.

mpirun (and horovodrun, which runs it) follows its remote daemons over TCP. Open MPI's own
keepalive first probes a silent connection after 300 s and gives up after 9 misses 20 s apart,
so a node that loses power or drops off the network holds the whole job for about 8 minutes,
and with no traffic to time out, often for good. ringtrain's set-up writes a parameter file
into the venv with a short keepalive and names it, in `bin/activate`, through
`OMPI_MCA_mca_param_files`, between the user's own file (which still wins) and the system's.
A system-wide file is never touched. A job across nodes whose launcher lacks it says so in
one line at start-up, with the fix.

`python -m ringtrain.launch.keepalive PARAM_FILE` writes the file and prints the list of
parameter files to export (scripts/setup.sh runs it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

# First probe after 5 s idle, then every 2 s; 3 misses end the job: a silent node ends it
# about 11 s after its last word.
KEEPALIVE = {
    "oob_tcp_keepalive_time": "5",
    "oob_tcp_keepalive_intvl": "2",
    "oob_tcp_keepalive_probes": "3",
}
# Between the launcher's SIGTERM and its SIGKILL (1 s by default): time for a rank on a loaded
# node, whose heartbeat thread may wait for a core, to name the silent peer before it is killed
# (heartbeat.py). A run that lost a node once ended without that line, 20 s after the fault.
TERM_GRACE = {"odls_base_sigkill_timeout": "5"}
# A launcher that waits longer than this on a silent node gets the start-up warning.
LONGEST_SILENCE_S = 60


def silence_bound(values: Mapping[str, str]) -> float:
    """Seconds a launcher waits on a silent daemon before it ends the job (inf: never)."""
    idle = int(values["oob_tcp_keepalive_time"])
    if idle <= 0:
        return float("inf")
    return idle + int(values["oob_tcp_keepalive_intvl"]) * int(values["oob_tcp_keepalive_probes"])


def parse_ompi_info(parsable: str) -> dict[str, str]:
    """The keepalive values in force, from `ompi_info --parsable --param oob tcp --level 9`."""
    values = {}
    for line in parsable.splitlines():
        parts = line.split(":")
        if len(parts) >= 7 and parts[4] in KEEPALIVE and parts[5] == "value":
            values[parts[4]] = parts[6]
    return values


def _ompi_info(environ: Mapping[str, str], *params: str) -> str:
    """`ompi_info --parsable --param ... --level 9` as Open MPI reads `environ` ("" if absent)."""
    command = ["ompi_info", "--parsable", "--param", *params, "--level", "9"]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=30, env=dict(environ)
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout


def launcher_values(environ: Mapping[str, str]) -> dict[str, str] | None:
    """What Open MPI reads for the keepalive in `environ` (its variables and parameter files),
    or None where ompi_info is missing or silent."""
    values = parse_ompi_info(_ompi_info(environ, "oob", "tcp"))
    return values if len(values) == len(KEEPALIVE) else None


def launched_across_nodes(environ: Mapping[str, str]) -> bool:
    """An mpirun-started job (its daemons carry the HNP's address) that spans several nodes.
    srun-started ranks have no mpirun to hang: Slurm watches its own nodes."""
    if "OMPI_MCA_orte_hnp_uri" not in environ:
        return False
    try:
        return int(environ.get("OMPI_MCA_orte_num_nodes", "1")) > 1
    except ValueError:
        return False


def keepalive_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """One line for rank 0 when a multi-node launcher would wait long on a silent node."""
    env = os.environ if environ is None else environ
    if not launched_across_nodes(env):
        return None
    values = launcher_values(env)
    waits = silence_bound(values) if values else 0.0
    if waits <= LONGEST_SILENCE_S:
        return None
    wait_text = "forever" if waits == float("inf") else f"{waits:.0f} s"
    flags = " ".join(f"--mca {key} {value}" for key, value in KEEPALIVE.items())
    return (
        f"warning: this launcher waits {wait_text} on a silent node before ending the job; "
        f"launch from ringtrain's activated venv (source .venv/bin/activate) or add {flags}"
    )


def param_file_text() -> str:
    """The venv's Open MPI parameter file."""
    lines = ["# ringtrain: end a job whose node went silent within seconds (see keepalive.py)"]
    lines += [f"{key} = {value}" for key, value in {**KEEPALIVE, **TERM_GRACE}.items()]
    return "\n".join(lines) + "\n"


def param_file_list(defaults: str, ours: str) -> str:
    """Open MPI's default list of parameter files with `ours` before the system's (the last):
    the first file that sets a value wins, so the user's own file still overrides it."""
    files = [f for f in defaults.split(",") if f and f != ours]
    return ",".join(files[:-1] + [ours] + files[-1:]) if files else ours


def default_param_files() -> str:
    """Open MPI's own list of parameter files, as its build defines it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA_mca")}
    for line in _ompi_info(env, "mca", "base").splitlines():
        if ":mca_base_param_files:value:" in line:
            return line.split(":value:", 1)[1]
    return ""


def main(argv: list[str] | None = None) -> int:
    """Write the venv's parameter file; print the file list that activate exports."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ringtrain.launch.keepalive PARAM_FILE", file=sys.stderr)
        return 2
    path = Path(args[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(param_file_text())
    files = param_file_list(default_param_files(), str(path))
    print(files.replace(str(Path.home()), "$HOME"))  # the user who activates, not who set up
    return 0


if __name__ == "__main__":
    sys.exit(main())
