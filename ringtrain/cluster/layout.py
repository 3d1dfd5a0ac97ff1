"""What a cluster of N nodes looks like: names, addresses, cores and link rates (pure, no root).

Every name a cluster creates starts with PREFIX, so `down` can find what a crashed `up` left
behind even without its state file.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ringtrain.errors import UserError

PREFIX = "rtc-"  # network namespaces, veths and the bridge
BRIDGE = f"{PREFIX}br"
HOSTS_MARKER = "# ringtrain-cluster"  # ends every line `up` adds to /etc/hosts
STATE_DIR = Path("/run/ringtrain-cluster")  # short: UNIX socket paths below it stay < 108 bytes
NETNS_DIR = Path("/var/run/netns")
DEFAULT_SUBNET = "10.77.0.0/24"
MAX_NODES = 64
FIRST_NODE_HOST = 11  # node K is the subnet's address number 10 + K; the launching host is 1
MAX_LINK_BITS = 10 * 10**9  # TCP over veth is CPU-bound at a few Gbit/s here
_RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?)(bit|kbit|mbit|gbit)")
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
MIN_NODE_MEMORY = 64 * 2**20  # a node's sshd and slurmd live inside its cap too


@dataclass(frozen=True)
class Node:
    """One emulated compute node."""

    name: str  # its hostname, node1..nodeN
    address: str  # on the cluster subnet
    cores: tuple[int, ...]  # everything started on the node is pinned here
    memory_group: Path | None = None  # the memory cgroup everything on it is born in, if capped

    @property
    def netns(self) -> str:
        return f"{PREFIX}{self.name}"

    @property
    def veth(self) -> str:
        """The host end of the node's veth pair (the node's end is eth0)."""
        return f"{PREFIX}{self.name}"

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns

    @property
    def uts_path(self) -> Path:
        """A bind mount holding the node's UTS namespace, so its hostname outlives processes."""
        return STATE_DIR / "ns" / f"{self.name}.uts"


@dataclass(frozen=True)
class Layout:
    """The whole cluster: its subnet, the host's address on the bridge, the nodes, the link."""

    subnet: ipaddress.IPv4Network
    host_address: str
    nodes: tuple[Node, ...]
    link_bits: int | None  # None: uncapped
    link: str | None  # as the user wrote it, for tc
    mem_per_node: int | None = None  # bytes; None: uncapped

    @property
    def cidr(self) -> str:
        return str(self.subnet)

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        known = ", ".join(n.name for n in self.nodes)
        raise UserError(f"no node {name!r} in this cluster (nodes: {known})")


def plan(
    nodes: int,
    subnet: str = DEFAULT_SUBNET,
    link: str | None = None,
    cpus_per_node: int = 1,
    cores: list[int] | None = None,
    mem_per_node: int | None = None,
    memory_groups: Path | None = None,
) -> Layout:
    """Check the request and lay the cluster out; every bad value is a one-line UserError.
    With a memory cap, node K's cgroup is `memory_groups`/nodeK."""
    if not 1 <= nodes <= MAX_NODES:
        raise UserError(f"--nodes {nodes}: give 1 to {MAX_NODES}")
    network = parse_subnet(subnet)
    hosts = list(network.hosts())
    if len(hosts) < FIRST_NODE_HOST + nodes - 1:
        raise UserError(f"--subnet {subnet} is too small for {nodes} nodes")
    available = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if not 1 <= cpus_per_node <= len(available):
        raise UserError(
            f"--cpus-per-node {cpus_per_node}: this machine gives 1 to {len(available)} cores"
        )
    link_bits = parse_rate(link) if link is not None else None
    if mem_per_node is not None and mem_per_node < MIN_NODE_MEMORY:
        raise UserError(
            f"--mem-per-node of {mem_per_node / 2**20:g} MiB is too small: give at least "
            f"{MIN_NODE_MEMORY // 2**20}M (the node's sshd and slurmd run inside the cap)"
        )
    capped = mem_per_node is not None and memory_groups is not None
    laid_out = tuple(
        Node(
            name=f"node{k + 1}",
            address=str(hosts[FIRST_NODE_HOST - 1 + k]),
            cores=tuple(
                available[(k * cpus_per_node + j) % len(available)] for j in range(cpus_per_node)
            ),
            memory_group=memory_groups / f"node{k + 1}" if capped else None,
        )
        for k in range(nodes)
    )
    return Layout(network, str(hosts[0]), laid_out, link_bits, link, mem_per_node)


def parse_subnet(text: str) -> ipaddress.IPv4Network:
    """An IPv4 network in CIDR form, e.g. 10.77.0.0/24."""
    try:
        network = ipaddress.IPv4Network(text, strict=True)
    except ValueError as exc:
        raise UserError(
            f"subnet {text!r} is not an IPv4 network like 10.77.0.0/24: {exc}"
        ) from None
    if network.prefixlen > 28:
        raise UserError(f"subnet {text!r} is too small: use a /28 or larger")
    return network


def parse_rate(text: str) -> int:
    """A tc rate such as 1gbit or 500mbit, in bits per second."""
    match = _RATE.fullmatch(text.strip().lower())
    if not match:
        raise UserError(f"--link {text!r}: give a rate like 1gbit, 500mbit or 100kbit")
    bits = int(float(match[1]) * _RATE_UNITS[match[2]])
    if not 8000 <= bits <= MAX_LINK_BITS:
        raise UserError(f"--link {text!r}: give 8kbit to 10gbit (TCP over veth is CPU-bound)")
    return bits


def core_list(cores: tuple[int, ...]) -> str:
    """`taskset -c` syntax."""
    return ",".join(str(c) for c in cores)
