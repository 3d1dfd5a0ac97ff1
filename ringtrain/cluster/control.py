"""Bring a rehearsal cluster up, report on it, run a command on a node, take it down.

`up` records what it is about to create in a state file before creating it, and every name it
creates starts with layout.PREFIX, so `down` removes everything even after a failed `up` or a
killed test: namespaces, veths, the bridge, every process in a node, the daemons, the keys, the
ssh drop-in and the /etc/hosts lines.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from ringtrain.cluster import memory, ssh
from ringtrain.cluster.layout import (
    BRIDGE,
    HOSTS_MARKER,
    NETNS_DIR,
    PREFIX,
    STATE_DIR,
    Layout,
    Node,
    core_list,
    plan,
)
from ringtrain.cluster.slurm import SlurmCluster, SlurmError, SlurmNode
from ringtrain.cluster.system import (
    ClusterError,
    add_host_lines,
    alive,
    end_processes,
    host_lines,
    netns_pids,
    pid_from_file,
    remove_host_lines,
    require_root,
    require_tools,
    run,
    tool_path,
)
from ringtrain.errors import UserError
from ringtrain.launch.hostfile import to_horovod, to_mpirun
from ringtrain.launch.network import mca_parameters, mpirun_flags

STATE_FILE = STATE_DIR / "state.json"
SLURM_ROOT = STATE_DIR / "slurm"
MPIRUN_HOSTFILE = STATE_DIR / "hostfile.mpirun"
HOROVOD_HOSTFILE = STATE_DIR / "hostfile.horovod"
ENV_FILE = STATE_DIR / "env.sh"
UP_LOCK = STATE_DIR.with_name("ringtrain-cluster.lock")  # held by `up` while it creates
TBF_BURST = "256kb"  # a token bucket deep enough for Gbit rates at the kernel's timer tick
TBF_LATENCY = "10ms"
NETWORK_TOOLS = ("ip", "tc", "nsenter", "unshare", "taskset", "ssh", "ssh-keygen")
SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")


@dataclass(frozen=True)
class Spec:
    """What the user asked `up` for; with the cores it ran on, it rebuilds the layout."""

    nodes: int
    subnet: str
    link: str | None
    cpus_per_node: int
    slurm: bool
    cores: list[int]
    node_path: str
    created_privsep_dir: bool
    mem_per_node: int | None = None  # bytes
    memory_groups: str | None = None  # the folder of the nodes' memory cgroups

    def layout(self) -> Layout:
        groups = Path(self.memory_groups) if self.memory_groups else None
        return plan(
            self.nodes,
            self.subnet,
            self.link,
            self.cpus_per_node,
            self.cores,
            self.mem_per_node,
            groups,
        )


def enter_node(node: Node) -> list[str]:
    """The command prefix that runs a program on `node`: its memory cgroup if it is capped,
    its network and UTS namespaces, its cores. `nsenter --net` keeps this host's mounts
    (`ip netns exec` remounts /sys, which hides /sys/fs/cgroup from slurmd)."""
    return [
        *(memory.join(node.memory_group) if node.memory_group else []),
        "nsenter",
        f"--net={node.netns_path}",
        f"--uts={node.uts_path}",
        "taskset",
        "-c",
        core_list(node.cores),
    ]


# --- up -----------------------------------------------------------------------------------


def up(
    nodes: int,
    subnet: str,
    link: str | None,
    cpus_per_node: int,
    slurm: bool,
    mem_per_node: int | None = None,
) -> Spec:
    """Create the cluster; on any failure remove what was created and raise."""
    require_root("up")
    groups = memory.groups_folder() if mem_per_node is not None else None
    layout = plan(nodes, subnet, link, cpus_per_node, None, mem_per_node, groups)
    require_tools(NETWORK_TOOLS, "install iproute2, util-linux and openssh-client")
    if not Path(ssh.SSHD).exists():
        raise UserError(f"no {ssh.SSHD}: install openssh-server")
    if slurm:
        require_tools(SLURM_TOOLS, "install slurmctld slurmd slurm-client munge")
    with _up_lock():
        refuse_if_up()
        _refuse_overlapping_routes(layout.subnet)
        venv_bin = str(Path(sys.executable).parent)
        path = os.environ.get("PATH", "")
        node_path = path if venv_bin in path.split(os.pathsep) else f"{venv_bin}:{path}"
        spec = Spec(
            nodes,
            subnet,
            link,
            cpus_per_node,
            slurm,
            sorted(os.sched_getaffinity(0)),
            node_path,
            created_privsep_dir=not ssh.PRIVSEP_DIR.exists(),
            mem_per_node=mem_per_node,
            memory_groups=str(groups) if groups else None,
        )
        STATE_DIR.mkdir(parents=True)
        STATE_FILE.write_text(json.dumps(asdict(spec), indent=1))
        try:
            _create_network(layout)
            if mem_per_node is not None:
                memory.create([n.memory_group for n in layout.nodes], mem_per_node)
            add_host_lines([f"{n.address} {n.name}" for n in layout.nodes], HOSTS_MARKER)
            ssh.write_keys_and_configs(layout, node_path)
            ssh.PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
            for node in layout.nodes:
                start_sshd(node)
            for node in layout.nodes:
                wait_for_ssh(node)
            cluster = _start_slurm(layout) if slurm else None
            _write_hostfiles_and_env(layout, cluster)
        except (ClusterError, SlurmError, OSError) as exc:
            down()
            raise ClusterError(f"up failed, and everything it created was removed: {exc}") from None
        except BaseException:
            down()
            raise
        return spec


@contextmanager
def _up_lock() -> Iterator[None]:
    """One `up` at a time, so a cluster still being created is never taken for abandoned."""
    with open(UP_LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError("another `ringtrain cluster up` is running") from None
        yield


def refuse_if_up() -> None:
    """One cluster at a time: its names are fixed (node1.., the rtc- devices). A cluster none
    of whose processes runs was abandoned (its session was killed with everything it
    started): it is removed, with a notice, rather than blocking every later `up`."""
    namespaces = _netns_names()
    leftovers = namespaces + _link_names()
    if not (leftovers or STATE_DIR.exists() or host_lines(HOSTS_MARKER)):
        return
    if not _cluster_processes(namespaces):
        removed = down()
        print(
            "ringtrain cluster: removed an abandoned cluster, none of whose processes ran: "
            + "; ".join(removed),
            file=sys.stderr,
            flush=True,
        )
        return
    if STATE_FILE.exists():
        spec = read_spec()
        raise UserError(
            f"a cluster is already up ({spec.nodes} nodes on {spec.subnet}): use it, or run "
            "`ringtrain cluster down` first"
        )
    raise UserError(
        f"leftovers of an earlier cluster ({', '.join(leftovers) or STATE_DIR}): "
        "run `ringtrain cluster down` first"
    )


def _refuse_overlapping_routes(subnet: ipaddress.IPv4Network) -> None:
    for line in run(["ip", "-o", "-4", "route", "show"]).stdout.splitlines():
        target = line.split()[0]
        if target == "default":
            continue
        try:
            route = ipaddress.IPv4Network(target, strict=False)
        except ValueError:
            continue
        if route.overlaps(subnet):
            raise UserError(
                f"--subnet {subnet} overlaps this machine's route {line.strip()!r}: "
                "choose another with --subnet"
            )


def _create_network(layout: Layout) -> None:
    prefix_len = layout.subnet.prefixlen
    run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    run(["ip", "addr", "add", f"{layout.host_address}/{prefix_len}", "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])
    (STATE_DIR / "ns").mkdir(exist_ok=True)
    for node in layout.nodes:
        run(["ip", "netns", "add", node.netns])
        run(["ip", "link", "add", node.veth, "type", "veth", "peer", "eth0", "netns", node.netns])
        run(["ip", "link", "set", node.veth, "master", BRIDGE])
        run(["ip", "link", "set", node.veth, "up"])
        run(["ip", "-n", node.netns, "addr", "add", f"{node.address}/{prefix_len}", "dev", "eth0"])
        run(["ip", "-n", node.netns, "link", "set", "eth0", "up"])
        run(["ip", "-n", node.netns, "link", "set", "lo", "up"])
        if layout.link is not None:  # both directions: the host's end and the node's end
            tbf = ["root", "tbf", "rate", layout.link, "burst", TBF_BURST, "latency", TBF_LATENCY]
            run(["tc", "qdisc", "add", "dev", node.veth, *tbf])
            run(["tc", "-n", node.netns, "qdisc", "add", "dev", "eth0", *tbf])
        node.uts_path.touch()
        run(["unshare", f"--uts={node.uts_path}", "hostname", node.name])


def start_sshd(node: Node) -> None:
    run([*enter_node(node), ssh.SSHD, "-f", str(ssh.sshd_config_path(node))])


def wait_for_ssh(node: Node, timeout: float = 20) -> None:
    """Until `ssh NODE hostname` answers with the node's name, as mpirun will ask it. An
    attempt that hangs is cut off and tried again until the deadline: a node back on its link
    may answer late while what it ran meanwhile still holds its cores."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            done = run(["ssh", node.name, "hostname"], check=False, timeout=15)
        except ClusterError as hung:
            last = [str(hung)]
            continue
        if done.returncode == 0 and done.stdout.strip() == node.name:
            return
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:]
        time.sleep(0.2)
    raise ClusterError(f"ssh {node.name} did not answer in {timeout} s: {last}")


def slurm_nodes(layout: Layout) -> list[SlurmNode]:
    """Each node's slurmd, declaring the node's memory cap (in MiB) if it has one."""
    mib = layout.mem_per_node // memory.MIB if layout.mem_per_node else None
    return [
        SlurmNode(n.name, n.address, len(n.cores), tuple(enter_node(n)), mib) for n in layout.nodes
    ]


def slurm_cluster(layout: Layout) -> SlurmCluster:
    """The Slurm harness for this layout: a controller on this host at its bridge address."""
    env = {**os.environ, "PATH": tool_path()}
    return SlurmCluster(
        env,
        SLURM_ROOT,
        slurm_nodes(layout),
        controller=(socket.gethostname(), layout.host_address),
    )


def _start_slurm(layout: Layout) -> SlurmCluster:
    cluster = slurm_cluster(layout)
    cluster.start()
    return cluster


def _write_hostfiles_and_env(layout: Layout, cluster: SlurmCluster | None) -> None:
    slots = [(n.name, len(n.cores)) for n in layout.nodes]
    MPIRUN_HOSTFILE.write_text(to_mpirun(slots))
    HOROVOD_HOSTFILE.write_text(to_mpirun(slots))  # horovodrun --hostfile: bare `host slots=N`
    exports = {"RINGTRAIN_NETWORK": layout.cidr}
    if cluster is not None:
        exports["SLURM_CONF"] = str(cluster.conf)
    ENV_FILE.write_text("".join(f"export {k}={v}\n" for k, v in exports.items()))


def summary(spec: Spec) -> str:
    """What `up` prints: the nodes, the hostfiles, the exports and the launcher flags."""
    layout = spec.layout()
    slots = [(x.name, len(x.cores)) for x in layout.nodes]
    n = sum(count for _, count in slots)
    flags = " ".join(mpirun_flags(layout.cidr))
    # horovodrun sets btl_tcp_if_include itself, to the nodes' interface (every node's eth0).
    control_channel = " ".join(
        f"--mca {key} {value}"
        for key, value in mca_parameters(layout.cidr).items()
        if key != "btl_tcp_if_include"
    )
    lines = [
        f"cluster up: {len(slots)} nodes on {layout.cidr}, this host is {layout.host_address} on "
        f"{BRIDGE}; link {spec.link or 'uncapped'}; memory {_cap(spec)}; "
        f"Slurm {'yes' if spec.slurm else 'no'}",
        *(f"  {x.name:8} {x.address:15} cores {core_list(x.cores)}" for x in layout.nodes),
        f"hostfiles: {MPIRUN_HOSTFILE} (mpirun), {HOROVOD_HOSTFILE} (horovodrun)",
        f"ssh: `ssh node1` works from this host (keys in {ssh.SSH_DIR}, "
        f"settings in {ssh.CLIENT_DROP_IN}); node sessions get PATH={spec.node_path}",
        "environment (also in " + str(ENV_FILE) + "):",
        f"  export RINGTRAIN_NETWORK={layout.cidr}",
    ]
    if spec.slurm:
        lines.append(f"  export SLURM_CONF={SLURM_ROOT / 'etc' / 'slurm.conf'}")
    lines += [
        "launch:",
        f"  mpirun -np {n} --hostfile {MPIRUN_HOSTFILE} {flags} ringtrain train ...",
        f"  horovodrun -np {n} -H {to_horovod(slots)} --network-interface eth0 "
        f'--mpi-args="{control_channel}" ringtrain train ...',
    ]
    if spec.slurm:
        lines.append(
            f"  sbatch --nodes={len(slots)} --ntasks-per-node={slots[0][1]} "
            "slurm/data-multinode.sbatch"
        )
    lines.append(
        "run on a node: ringtrain cluster exec node1 -- CMD; remove: ringtrain cluster down"
    )
    return "\n".join(lines)


def _cap(spec: Spec) -> str:
    if spec.mem_per_node is None:
        return "uncapped"
    return f"capped at {spec.mem_per_node // memory.MIB} MiB per node ({spec.memory_groups})"


# --- status and exec ------------------------------------------------------------------------


def read_spec() -> Spec:
    try:
        return Spec(**json.loads(STATE_FILE.read_text()))
    except FileNotFoundError:
        raise UserError(
            "no cluster is up: start one with `ringtrain cluster up --nodes N`"
        ) from None
    except (ValueError, TypeError) as exc:
        raise UserError(
            f"{STATE_FILE} is unreadable ({exc}): run `ringtrain cluster down`"
        ) from None


def status() -> tuple[str, bool]:
    """A report, and whether every node and daemon is there."""
    spec = read_spec()
    layout = spec.layout()
    healthy = True
    lines = [
        f"cluster: {spec.nodes} nodes on {layout.cidr}, link {spec.link or 'uncapped'}, "
        f"memory {_cap(spec)}"
    ]
    states = slurm_cluster(layout).node_states() if spec.slurm else {}
    for node in layout.nodes:
        cap = node.memory_group and spec.mem_per_node
        sshd = pid_from_file(ssh.sshd_pid_path(node), "sshd")
        present = node.netns_path.exists()
        slurm_state = states.get(node.name, "missing") if spec.slurm else ""
        healthy &= present and sshd is not None and slurm_state in ("", "idle", "alloc", "mix")
        healthy &= not cap or node.memory_group.is_dir()
        lines.append(
            f"  {node.name:8} {node.address:15} cores {core_list(node.cores):6} "
            f"namespace {'yes' if present else 'MISSING'}, "
            f"sshd {'running' if sshd else 'NOT RUNNING'}"
            + (f", slurmd {slurm_state}" if spec.slurm else "")
            + (f", {memory.describe(node.memory_group, spec.mem_per_node)}" if cap else "")
        )
    if spec.slurm:
        lines.append(f"  export SLURM_CONF={SLURM_ROOT / 'etc' / 'slurm.conf'}")
    return "\n".join(lines), healthy


def exec_on_node(name: str, command: list[str]) -> None:
    """Replace this process by `command` running on node `name` (exit code passes through)."""
    require_root("exec")
    if not command:
        raise UserError(
            "give the command after --, e.g. `ringtrain cluster exec node1 -- hostname`"
        )
    node = read_spec().layout().node(name)
    if not node.netns_path.exists():
        raise UserError(f"{name}'s namespace is gone: run `ringtrain cluster down`, then up")
    os.environ["PATH"] = tool_path()
    prefix = enter_node(node)  # a capped node's: a shell that joins its cgroup first
    os.execvp(prefix[0], [*prefix, *command])


# --- down -----------------------------------------------------------------------------------


def down() -> list[str]:
    """Remove everything a cluster created, with or without its state file; what went."""
    require_root("down")
    removed: list[str] = []
    spec = None
    if STATE_FILE.exists():
        try:
            spec = Spec(**json.loads(STATE_FILE.read_text()))
        except (ValueError, TypeError):
            spec = None
    if SLURM_ROOT.exists():
        nodes = slurm_nodes(spec.layout()) if spec else []
        SlurmCluster(os.environ, SLURM_ROOT, nodes).stop()
        removed.append("Slurm daemons and jobs")
    namespaces = _netns_names()
    pids = _cluster_processes(namespaces)
    if pids:
        end_processes(pids)
        removed.append(f"{len(set(pids))} processes")
    for uts in sorted((STATE_DIR / "ns").glob("*.uts")):
        run(["umount", str(uts)], check=False)
    for ns in namespaces:
        run(["ip", "netns", "delete", ns])
    links = _link_names()
    for link in links:  # deleting a namespace took its veth peer; the bridge is left
        run(["ip", "link", "delete", link], check=False)
    if namespaces or links:
        removed.append(f"namespaces {', '.join(namespaces) or '-'}; links {', '.join(links)}")
    lines = remove_host_lines(HOSTS_MARKER)
    if lines:
        removed.append(f"{lines} /etc/hosts lines")
    if ssh.remove_client_drop_in():
        removed.append(str(ssh.CLIENT_DROP_IN))
    created_privsep = spec is not None and spec.created_privsep_dir
    if created_privsep and ssh.PRIVSEP_DIR.exists() and not any(ssh.PRIVSEP_DIR.iterdir()):
        ssh.PRIVSEP_DIR.rmdir()
    folder = _memory_groups(spec)
    groups = memory.remove(folder) if folder else []
    if groups:
        removed.append(f"memory cgroups {', '.join(groups)}")
    if STATE_DIR.exists():
        shutil.rmtree(STATE_DIR)
        removed.append(f"{STATE_DIR} (keys, configurations, hostfiles, logs)")
    return removed


def _memory_groups(spec: Spec | None) -> Path | None:
    """The folder of the nodes' memory cgroups: as recorded, or where this process's `up`
    would have made it (the state file may be lost)."""
    if spec is not None and spec.memory_groups:
        return Path(spec.memory_groups)
    try:
        return memory.groups_folder()
    except UserError:  # no memory controller: no groups either
        return None


def _netns_names() -> list[str]:
    if not NETNS_DIR.exists():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(PREFIX))


def _link_names() -> list[str]:
    names = []
    for line in run(["ip", "-o", "link", "show"]).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(PREFIX):
            names.append(name)
    return names


def _cluster_processes(namespaces: list[str]) -> list[int]:
    """Every live process of a cluster: those in its nodes' namespaces, and its daemons on
    this host."""
    return [pid for ns in namespaces for pid in netns_pids(ns)] + _daemons_under_state_dir()


def _daemons_under_state_dir() -> list[int]:
    """Processes in this host's namespace started from the cluster's files (munged, a
    slurmctld whose PID file is gone): their command line names the state folder."""
    found = []
    marker = str(STATE_DIR).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker in (proc / "cmdline").read_bytes() and alive(int(proc.name)):
                found.append(int(proc.name))
        except OSError:
            continue
    return found
