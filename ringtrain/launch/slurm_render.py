"""Write a Slurm batch script from the templates in slurm/, with every value checked first.

The templates are plain scripts that run as they are (`sbatch slurm/pipeline.sbatch`), so they
hold no placeholders: rendering rewrites the value of a few known lines (#SBATCH --nodes=...,
PP_SIZE=${PP_SIZE:-...}, the `set --` line of default train arguments) and copies the rest.
Every value written is either checked against a strict pattern or shell-quoted, so no input
can become code in the script.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from ringtrain.launch.network import ENV_VAR, configured_network

REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_DIR = REPO_ROOT / "slurm"
STRATEGIES = ("data", "pipeline", "hybrid", "sweep")  # sweep: trials in groups of ranks

_JOB_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
# MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, told apart by the day and the colon count.
_TIME = re.compile(r"(?:(?P<days>[0-9]{1,4})-)?(?P<clock>[0-9]{1,6}(?::[0-9]{1,2}){0,2})")
_TIME_UNITS = {
    (False, 1): ("minutes",),
    (False, 2): ("minutes", "seconds"),
    (False, 3): ("hours", "minutes", "seconds"),
    (True, 1): ("days", "hours"),
    (True, 2): ("days", "hours", "minutes"),
    (True, 3): ("days", "hours", "minutes", "seconds"),
}
_SECONDS_PER = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}
_BELOW = {"hours": 24, "minutes": 60, "seconds": 60}  # for every field but the leading one
MAX_TIME_SECONDS = 365 * 86400


def template_path(strategy: str, nodes: int) -> Path:
    """The template for a strategy; data parallelism over several nodes has its own."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if strategy == "data":
        return TEMPLATE_DIR / ("data-multinode.sbatch" if nodes > 1 else "data-1node.sbatch")
    return TEMPLATE_DIR / f"{strategy}.sbatch"


def node_range(text: str) -> tuple[int, int]:
    """`N` or `MIN-MAX` (sbatch's --nodes): a range lets Slurm start a requeued job on the
    nodes that are left."""
    low, _, high = text.partition("-")
    if not (low.isdigit() and (high or low).isdigit()) or not 1 <= int(low) <= int(high or low):
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or MIN-MAX, with 1 <= MIN <= MAX")
    return int(low), int(high or low)


def render(
    strategy: str,
    nodes: int | tuple[int, int],
    ntasks_per_node: int,
    time: str,
    pp_size: int | None = None,
    job_name: str | None = None,
    train_args: Sequence[str] = (),
    network: str | None = None,
) -> str:
    """The batch script for these settings; a bad value raises ValueError with one line.
    `network` (RINGTRAIN_NETWORK at render time) becomes the script's default for it.
    `nodes` may be a (MIN, MAX) range; every count in it must give a valid layout."""
    low, high = (nodes, nodes) if isinstance(nodes, int) else nodes
    template = template_path(strategy, high)
    for count in range(low, high + 1):
        _check_layout(strategy, count, ntasks_per_node, pp_size)
    time_limit_seconds(time)
    if job_name is not None and not _JOB_NAME.fullmatch(job_name):
        raise ValueError(f"job name {job_name!r} must be 1-64 letters, digits, '.', '_' or '-'")
    values = {
        "#SBATCH --nodes=": str(low) if low == high else f"{low}-{high}",
        "#SBATCH --ntasks-per-node=": str(ntasks_per_node),
        "#SBATCH --time=": time,
        "RINGTRAIN_HOME=${RINGTRAIN_HOME:-": shlex.quote(str(REPO_ROOT)) + "}",
        "(($#)) || set --": "".join(" " + shlex.quote(arg) for arg in train_args),
    }
    if job_name is not None:
        values["#SBATCH --job-name="] = job_name
    if strategy == "hybrid":
        values["PP_SIZE=${PP_SIZE:-"] = f"{pp_size}}}"
    script = template.read_text()
    if low != high:
        script = _per_node_tasks_by_srun(script, ntasks_per_node, template.name)
        del values["#SBATCH --ntasks-per-node="]
    for prefix, value in values.items():
        script = _replace_value(script, prefix, value, template.name)
    if network is not None:
        cidr = configured_network({ENV_VAR: network})
        line = f"export {ENV_VAR}=${{{ENV_VAR}:-{cidr}}}"
        script = _before_common(script, line, template.name)
    return script


def _per_node_tasks_by_srun(script: str, ntasks_per_node: int, template_name: str) -> str:
    """With --ntasks-per-node, Slurm 22.05 sizes a --nodes=MIN-MAX job to MIN nodes even when
    more are idle. So a range asks for CPUs per node instead (the tasks' CPUs, --mincpus),
    which Slurm fills up to MAX nodes, and the step places the tasks: common.sh gives srun
    RINGTRAIN_TASKS_PER_NODE per allocated node."""
    cpus = re.search(r"^#SBATCH --cpus-per-task=([0-9]+)$", script, re.MULTILINE)
    per_task = int(cpus[1]) if cpus else 1
    mincpus = f"#SBATCH --mincpus={ntasks_per_node * per_task}"
    script = _replace_value(script, "#SBATCH --ntasks-per-node=", mincpus, template_name, "")
    return _before_common(script, f"RINGTRAIN_TASKS_PER_NODE={ntasks_per_node}", template_name)


def _replace_value(
    script: str, prefix: str, value: str, template_name: str, keep: str | None = None
) -> str:
    """Rewrite the one line starting with prefix to `keep` (the prefix itself by default)
    followed by value; a function replacement keeps the backslashes of quoted arguments
    literal."""
    pattern = re.compile("^" + re.escape(prefix) + ".*$", re.MULTILINE)
    line = (prefix if keep is None else keep) + value
    script, count = pattern.subn(lambda _: line, script)
    if count != 1:
        raise ValueError(
            f"template {template_name} has {count} lines starting {prefix!r}, expected one"
        )
    return script


def _before_common(script: str, line: str, template_name: str) -> str:
    """Put `line` just before the line that sources common.sh, which reads it; every value in
    such a line is checked or a number, so it cannot be code."""
    source = re.compile(r'^source "\$RINGTRAIN_HOME/slurm/common\.sh".*$', re.MULTILINE)
    script, count = source.subn(lambda found: f"{line}\n{found.group(0)}", script)
    if count != 1:
        raise ValueError(f"template {template_name} sources slurm/common.sh {count} times")
    return script


def _check_layout(strategy: str, nodes: int, ntasks_per_node: int, pp_size: int | None) -> None:
    if nodes < 1:
        raise ValueError(f"--nodes {nodes}: need at least one node")
    if ntasks_per_node < 1:
        raise ValueError(f"--ntasks-per-node {ntasks_per_node}: need at least one task per node")
    tasks = nodes * ntasks_per_node
    if strategy == "data" and pp_size is not None:
        raise ValueError("--pp-size is for pipeline and hybrid; data parallelism has no stages")
    if strategy == "sweep" and pp_size is not None:
        raise ValueError("--pp-size is for pipeline and hybrid; a sweep's trials take it after --")
    if strategy == "pipeline" and pp_size not in (None, tasks):
        raise ValueError(
            f"--pp-size {pp_size}: pipeline makes every one of the {tasks} tasks a "
            "stage; use hybrid for several shorter pipelines"
        )
    if strategy == "hybrid":
        if pp_size is None:
            raise ValueError("hybrid needs --pp-size, the stages per pipeline replica")
        if pp_size < 1 or tasks % pp_size:
            raise ValueError(
                f"--pp-size {pp_size} does not divide the {tasks} tasks "
                f"({nodes} node(s) x {ntasks_per_node})"
            )


def time_limit_seconds(text: str) -> int:
    """A Slurm --time value in seconds; a value Slurm would read differently than meant, or not
    at all, raises ValueError."""
    match = _TIME.fullmatch(text)
    if not match:
        raise ValueError(f"time {text!r}: use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
    fields = [int(f) for f in match["clock"].split(":")]
    has_days = match["days"] is not None
    units = _TIME_UNITS[(has_days, len(fields))]
    values = ([int(match["days"])] if has_days else []) + fields
    parts = list(zip(units, values, strict=True))
    for unit, value in parts[1:]:
        if value >= _BELOW[unit]:
            raise ValueError(f"time {text!r}: {unit} must be below {_BELOW[unit]}")
    seconds = sum(_SECONDS_PER[unit] * value for unit, value in parts)
    if not 0 < seconds <= MAX_TIME_SECONDS:
        raise ValueError(f"time {text!r}: must be more than zero and at most 365 days")
    return seconds
