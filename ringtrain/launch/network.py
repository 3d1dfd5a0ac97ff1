"""RINGTRAIN_NETWORK: the one place a user names the network ranks talk over, as a CIDR.

A CIDR rather than an interface name, because names differ between hosts (the launching host
may reach the nodes through `br0` while every node calls its link `eth0`). What ringtrain
launches itself (doctor, benchmarks, the Slurm templates) turns it into Open MPI's
`btl_tcp_if_include` (rank-to-rank traffic) and `oob_tcp_if_include` (mpirun's control
channel to its remote daemons), plus Horovod's Gloo interface, as OMPI_MCA_* / HOROVOD_*
variables that mpirun, srun and the ranks read. Across nodes it also shortens Open MPI's
keepalive on that control channel, so a job whose node went silent (a cut link, a powered-off
node) ends within seconds instead of waiting on the unreachable daemon for minutes.

`python -m ringtrain.launch.network` prints the variables as shell `export` lines.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import shlex
import socket
import struct
import sys
from collections.abc import Mapping

from ringtrain.errors import EXIT_USAGE, UserError
from ringtrain.launch.keepalive import KEEPALIVE

ENV_VAR = "RINGTRAIN_NETWORK"
_SIOCGIFADDR = 0x8915


def configured_network(environ: Mapping[str, str] | None = None) -> ipaddress.IPv4Network | None:
    """The network RINGTRAIN_NETWORK names, or None when it is unset or empty."""
    text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not text:
        return None
    try:
        return ipaddress.IPv4Network(text, strict=False)
    except ValueError:
        raise UserError(f"{ENV_VAR}={text!r} is not a network like 10.77.0.0/24") from None


def interface_addresses() -> dict[str, str]:
    """Every IPv4-configured interface of this host (network namespace) and its address."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name[:15].encode())
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                continue
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def local_interface(network: ipaddress.IPv4Network) -> str:
    """The interface of this host with an address in `network`; none is a one-line error."""
    addresses = interface_addresses()
    for name, address in addresses.items():
        if ipaddress.IPv4Address(address) in network:
            return name
    have = ", ".join(f"{name} {address}" for name, address in addresses.items()) or "none"
    raise UserError(
        f"{ENV_VAR}={network} matches no interface on {socket.gethostname()} "
        f"(its IPv4 interfaces: {have})"
    )


def unresolved_hosts(hosts: list[str]) -> list[str]:
    """One problem per host name this host cannot resolve (DNS or /etc/hosts): a launcher
    could not reach it either."""
    problems = []
    for host in hosts:
        try:
            socket.getaddrinfo(host, None)
        except OSError:
            problems.append(
                f"host {host} does not resolve: not in DNS or /etc/hosts (typo in the hostfile?)"
            )
    return problems


def mca_parameters(cidr: str) -> dict[str, str]:
    """Open MPI parameters that keep ranks and daemons on `cidr` and end silent jobs."""
    return {"btl_tcp_if_include": cidr, "oob_tcp_if_include": cidr, **KEEPALIVE}


def mpirun_flags(cidr: str) -> list[str]:
    """What a user's own `mpirun` needs across nodes on `cidr`. `--bind-to none` keeps the
    CPU mask every process inherits; Open MPI's default binds each node's first rank to
    core 0, which is the same core on every node that shares a machine."""
    flags = ["--bind-to", "none"]
    for key, value in mca_parameters(cidr).items():
        flags += ["--mca", key, value]
    return flags


def launcher_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that apply RINGTRAIN_NETWORK to mpirun, srun, the ranks and Horovod (none
    when it is unset). Variables the user already set win."""
    env = os.environ if environ is None else environ
    network = configured_network(env)
    if network is None:
        return {}
    chosen = {f"OMPI_MCA_{key}": value for key, value in mca_parameters(str(network)).items()}
    chosen["HOROVOD_GLOO_IFACE"] = local_interface(network)
    return {key: value for key, value in chosen.items() if key not in env}


def main() -> int:
    """Print `export` lines for a shell (slurm/common.sh evaluates them)."""
    try:
        chosen = launcher_environment()
    except UserError as exc:
        print(f"ringtrain network: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for key, value in chosen.items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
