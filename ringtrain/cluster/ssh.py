"""ssh into the nodes as on a real cluster, with the cluster's own keys.

The user's ~/.ssh is not touched: every node's sshd reads the cluster's authorized_keys and
host key, and a drop-in in /etc/ssh/ssh_config.d (read by every ssh client, so by mpirun and
horovodrun too) names the cluster's client key and known_hosts for node1..nodeN only.
A node's sessions get the PATH `up` ran with, as a shared .bashrc activating the venv would.
"""

from __future__ import annotations

from pathlib import Path

from ringtrain.cluster.layout import STATE_DIR, Layout, Node
from ringtrain.cluster.system import run

SSH_DIR = STATE_DIR / "ssh"
CLIENT_KEY = SSH_DIR / "id_ed25519"
HOST_KEY = SSH_DIR / "host_ed25519"
KNOWN_HOSTS = SSH_DIR / "known_hosts"
AUTHORIZED_KEYS = SSH_DIR / "authorized_keys"
CLIENT_DROP_IN = Path("/etc/ssh/ssh_config.d/ringtrain-cluster.conf")
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without it
SSHD = "/usr/sbin/sshd"  # sshd must be started by its absolute path
CONNECT_TIMEOUT = 5


def sshd_config_path(node: Node) -> Path:
    return STATE_DIR / node.name / "sshd_config"


def sshd_pid_path(node: Node) -> Path:
    return STATE_DIR / node.name / "sshd.pid"


def write_keys_and_configs(layout: Layout, node_path: str) -> None:
    """Keys, known_hosts, one sshd_config per node, and the client drop-in."""
    SSH_DIR.mkdir(parents=True, exist_ok=True)
    for key in (CLIENT_KEY, HOST_KEY):
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ringtrain-cluster", "-f", key])
    AUTHORIZED_KEYS.write_text(CLIENT_KEY.with_suffix(".pub").read_text())
    host_key = " ".join(HOST_KEY.with_suffix(".pub").read_text().split()[:2])
    KNOWN_HOSTS.write_text(
        "".join(f"{node.name},{node.address} {host_key}\n" for node in layout.nodes)
    )
    for node in layout.nodes:
        sshd_config_path(node).parent.mkdir(parents=True, exist_ok=True)
        sshd_config_path(node).write_text(_sshd_config(node, node_path))
    names = " ".join(f"{node.name} {node.address}" for node in layout.nodes)
    CLIENT_DROP_IN.parent.mkdir(parents=True, exist_ok=True)
    CLIENT_DROP_IN.write_text(
        "# Written by `ringtrain cluster up`, removed by `ringtrain cluster down`.\n"
        f"Host {names}\n"
        f"    IdentityFile {CLIENT_KEY}\n"
        f"    UserKnownHostsFile {KNOWN_HOSTS}\n"
        "    StrictHostKeyChecking yes\n"
        "    BatchMode yes\n"
        f"    ConnectTimeout {CONNECT_TIMEOUT}\n"
        "    LogLevel ERROR\n"
    )


def _sshd_config(node: Node, node_path: str) -> str:
    return f"""\
# sshd of {node.name}, written by `ringtrain cluster up`.
ListenAddress {node.address}
Port 22
HostKey {HOST_KEY}
PidFile {sshd_pid_path(node)}
AuthorizedKeysFile {AUTHORIZED_KEYS}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
PrintLastLog no
MaxStartups 100
MaxSessions 100
SetEnv "PATH={node_path}"
"""


def remove_client_drop_in() -> bool:
    if CLIENT_DROP_IN.exists():
        CLIENT_DROP_IN.unlink()
        return True
    return False
