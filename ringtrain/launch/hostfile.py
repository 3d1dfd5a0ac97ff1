"""Hostfiles and Slurm node lists: parse, check, convert.

Three notations say the same thing, "these hosts, this many ranks on each":
- Slurm: a compressed node list (`node[01-04,07],login`) plus `SLURM_TASKS_PER_NODE` (`4(x2),2`);
- Open MPI's hostfile, for `mpirun --hostfile`: one `host slots=N [max_slots=M]` per line;
- Horovod: `horovodrun -H host:N,host:N`, or `--hostfile` with bare `host slots=N` lines.

Horovod 0.28 reads a hostfile with `line.split()[0]` and `line.split('=')[1]` on every line, so a
blank line or a comment crashes it, and `max_slots=` or a trailing comment ends up in the slot
count. `check_hostfile(..., for_tool="horovodrun")` flags exactly those lines.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

HostSlots = tuple[str, int]
TOOLS = ("mpirun", "horovodrun")

# A typo such as node[1-999999999] must fail at once, not fill the memory.
MAX_HOSTS = 100_000

_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # what Slurm names nodes and horovodrun accepts
_NODE_ITEM = r"(?:[A-Za-z0-9_.-]|\[[^\[\]]*\])+"
_NODE_LIST = re.compile(rf"{_NODE_ITEM}(?:,{_NODE_ITEM})*")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TASK_COUNT = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
_COUNT = re.compile(r"[0-9]+")
_HOSTFILE_KEYS = ("slots", "max_slots")
_HOROVOD_LINE = re.compile(r"\S+\s+slots=[0-9]+")


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed node list as host names, in order, with zero-padding kept."""
    text = text.strip()
    if not _NODE_LIST.fullmatch(text):
        raise ValueError(f"bad node list {text!r}: expected names like node[01-04,07],login")
    hosts: list[str] = []
    for item in re.findall(_NODE_ITEM, text):
        hosts.extend(_expand_item(item))
        _check_host_count(len(hosts), text)
    return hosts


def _expand_item(item: str) -> list[str]:
    """One comma-free name, where every bracket group multiplies the names (r[1-2]n[1-2])."""
    parts = re.split(r"(\[[^\]]*\])", item)
    choices = [_bracket_values(part, item) if part.startswith("[") else [part] for part in parts]
    _check_host_count(math.prod(len(c) for c in choices), item)
    names = [""]
    for options in choices:
        names = [name + option for name in names for option in options]
    return names


def _bracket_values(group: str, item: str) -> list[str]:
    """`[01-03,7]` as ['01', '02', '03', '7']: the padding of a range is its first number's."""
    ranges = []
    for piece in group[1:-1].split(","):
        match = _RANGE.fullmatch(piece)
        if not match:
            raise ValueError(f"bad range {piece!r} in {item!r}: expected N or N-M")
        low, high = int(match[1]), int(match[2] or match[1])
        if high < low:
            raise ValueError(f"descending range {piece!r} in {item!r}")
        ranges.append((low, high, len(match[1])))
    _check_host_count(sum(high - low + 1 for low, high, _ in ranges), item)
    return [str(n).zfill(width) for low, high, width in ranges for n in range(low, high + 1)]


def _check_host_count(count: int, text: str) -> None:
    if count > MAX_HOSTS:
        raise ValueError(f"{text!r} expands to more than {MAX_HOSTS} hosts")


def expand_tasks_per_node(spec: str, n_nodes: int) -> list[int]:
    """SLURM_TASKS_PER_NODE (`4(x2),2`) as one count per node; it must cover exactly n_nodes."""
    entries = [_task_entry(piece, spec) for piece in spec.strip().split(",")]
    described = sum(repeat for _, repeat in entries)
    if described != n_nodes:
        raise ValueError(f"tasks per node {spec!r} describes {described} node(s), not {n_nodes}")
    return [tasks for tasks, repeat in entries for _ in range(repeat)]


def _task_entry(piece: str, spec: str) -> tuple[int, int]:
    """`4(x2)` as (4 tasks, 2 nodes)."""
    match = _TASK_COUNT.fullmatch(piece)
    if not match:
        raise ValueError(f"bad tasks-per-node entry {piece!r} in {spec!r}: expected N or N(xR)")
    tasks, repeat = int(match[1]), int(match[2] or 1)
    if tasks < 1 or repeat < 1:
        raise ValueError(f"tasks-per-node entry {piece!r} in {spec!r} must be at least 1")
    return tasks, repeat


def parse_hostfile(text: str, for_tool: str = "mpirun") -> tuple[list[HostSlots], list[str]]:
    """The hosts with their slots, and the problems as `line K: ...` (none: the tool reads it as
    meant). Slots must be written down: a missing count would silently mean "all cores"."""
    if for_tool not in TOOLS:
        raise ValueError(f"unknown tool {for_tool!r}: expected one of {', '.join(TOOLS)}")
    hosts: list[HostSlots] = []
    problems: list[str] = []
    first_seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            entry = _parse_line(line, for_tool)
        except ValueError as problem:
            problems.append(f"line {number}: {problem}")
            continue
        if entry is None:
            continue
        host = entry[0]
        if host in first_seen:
            problems.append(
                f"line {number}: duplicate host {host!r} (first on line {first_seen[host]})"
            )
            continue
        first_seen[host] = number
        hosts.append(entry)
    if not hosts and not problems:
        problems.append("line 1: no hosts: expected lines like 'node01 slots=4'")
    return hosts, problems


def check_hostfile(text: str, for_tool: str = "mpirun") -> list[str]:
    """Problems that would make `for_tool` fail or read other hosts or slots than written."""
    return parse_hostfile(text, for_tool)[1]


def _parse_line(line: str, for_tool: str) -> HostSlots | None:
    """(host, slots), or None for a comment or blank line; a problem raises ValueError."""
    if for_tool == "horovodrun":
        _reject_what_horovod_cannot_skip(line)
    entry = _parse_open_mpi_line(line)
    if for_tool == "horovodrun":
        _require_horovod_shape(line)
    return entry


def _reject_what_horovod_cannot_skip(line: str) -> None:
    stripped = line.strip()
    if not stripped:
        raise ValueError("blank line: horovodrun's hostfile reader crashes on it; delete it")
    if stripped.startswith("#"):
        raise ValueError("comment: horovodrun's hostfile reader cannot skip comments; delete it")


def _require_horovod_shape(line: str) -> None:
    if "#" in line:
        raise ValueError("trailing comment: horovodrun would read it as part of the slot count")
    if not _HOROVOD_LINE.fullmatch(line.strip()):
        raise ValueError(
            "horovodrun reads only 'host slots=N' (no max_slots, no spaces around '=')"
        )


def _parse_open_mpi_line(line: str) -> HostSlots | None:
    tokens = re.sub(r"\s*=\s*", "=", line.split("#", 1)[0]).split()
    if not tokens:
        return None
    host, *settings = tokens
    if "=" in host or not _HOST_NAME.fullmatch(host):
        raise ValueError(f"expected a host name first, got {host!r}")
    values = _hostfile_settings(settings)
    if "slots" not in values:
        raise ValueError(f"no slots=N for {host!r}")
    if values.get("max_slots", values["slots"]) < values["slots"]:
        raise ValueError(f"max_slots={values['max_slots']} is below slots={values['slots']}")
    return host, values["slots"]


def _hostfile_settings(tokens: list[str]) -> dict[str, int]:
    values: dict[str, int] = {}
    for token in tokens:
        key, equals, value = token.partition("=")
        if not equals:
            raise ValueError(f"unexpected {token!r}: expected key=value such as slots=4")
        if key not in _HOSTFILE_KEYS:
            raise ValueError(f"unknown key {key!r}: expected slots= or max_slots=")
        if key in values:
            raise ValueError(f"{key}= given twice")
        values[key] = _slot_count(key, value)
    return values


def _slot_count(key: str, value: str) -> int:
    if not _COUNT.fullmatch(value):
        raise ValueError(f"{key}={value!r} is not a whole number")
    if int(value) < 1:
        raise ValueError(f"{key}={value}: a host needs at least one slot")
    return int(value)


def to_mpirun(hosts_and_slots: Iterable[HostSlots]) -> str:
    """An Open MPI hostfile, one `host slots=N` line per host (also what horovodrun reads)."""
    return "".join(f"{host} slots={slots}\n" for host, slots in _checked(hosts_and_slots))


def to_horovod(hosts_and_slots: Iterable[HostSlots]) -> str:
    """The value of `horovodrun -H`: `host:N,host:N`."""
    return ",".join(f"{host}:{slots}" for host, slots in _checked(hosts_and_slots))


def _checked(hosts_and_slots: Iterable[HostSlots]) -> list[HostSlots]:
    """Never write a file that check_hostfile would reject."""
    pairs = list(hosts_and_slots)
    if not pairs:
        raise ValueError("no hosts to write")
    seen: set[str] = set()
    for host, slots in pairs:
        if not _HOST_NAME.fullmatch(host):
            raise ValueError(f"bad host name {host!r}")
        if host in seen:
            raise ValueError(f"duplicate host {host!r}")
        if slots < 1:
            raise ValueError(f"{host!r} has {slots} slots: a host needs at least one")
        seen.add(host)
    return pairs
