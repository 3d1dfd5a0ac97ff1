"""The short launcher keepalive is the default in ringtrain's venv, and a multi-node launch
without it is named at start-up. (The power-loss run that it ends is in test_node_faults.)"""

from __future__ import annotations

import os
import subprocess

from conftest import ENV, ROOT

from ringtrain.launch.keepalive import (
    KEEPALIVE,
    TERM_GRACE,
    keepalive_warning,
    param_file_list,
    silence_bound,
)

# What mpirun puts in the environment of a rank on a job of two nodes.
TWO_NODE_RANK = {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.77.0.1:1", "OMPI_MCA_orte_num_nodes": "2"}


def activated(command: str) -> str:
    """`command`'s output in a shell that sourced the venv's activate, as a user's would."""
    env = {k: v for k, v in ENV.items() if not k.startswith("OMPI_MCA_")}
    done = subprocess.run(
        ["bash", "-c", f"source {ROOT}/.venv/bin/activate && {command}"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_ompi_info_in_the_activated_venv_shows_the_short_keepalive_from_its_file():
    shown = activated("ompi_info --param oob tcp --level 9")
    shown += activated("ompi_info --param odls base --level 9")
    for key, value in {**KEEPALIVE, **TERM_GRACE}.items():
        line = next(line for line in shown.splitlines() if f'"{key}"' in line)
        assert f'current value: "{value}"' in line, line
        assert "ringtrain-mca-params.conf" in line, line


def test_the_system_parameter_file_stays_in_force_after_ours():
    """Debian's file turns UCX off; a list that dropped it would change every MPI run."""
    files = activated("echo $OMPI_MCA_mca_param_files").strip().split(",")
    assert files[-1].endswith("openmpi-mca-params.conf")
    assert files[-2].endswith("ringtrain-mca-params.conf")
    listed = param_file_list("/u/a.conf,/etc/b.conf", "/v/r.conf")
    assert listed == "/u/a.conf,/v/r.conf,/etc/b.conf"


def test_silence_bound_is_idle_time_plus_every_probe():
    assert silence_bound(KEEPALIVE) == 11
    assert silence_bound({**KEEPALIVE, "oob_tcp_keepalive_time": "0"}) == float("inf")


def test_a_two_node_launch_without_the_keepalive_warns_once_with_the_fix():
    bare = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA_")}
    line = keepalive_warning({**bare, **TWO_NODE_RANK})
    assert line is not None and "\n" not in line
    assert "480 s" in line and "--mca oob_tcp_keepalive_time 5" in line


def test_no_warning_with_the_keepalive_on_one_node_or_under_srun():
    bare = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA_")}
    flags = {f"OMPI_MCA_{key}": value for key, value in KEEPALIVE.items()}
    assert keepalive_warning({**bare, **TWO_NODE_RANK, **flags}) is None
    assert keepalive_warning({**bare, **TWO_NODE_RANK, "OMPI_MCA_orte_num_nodes": "1"}) is None
    assert keepalive_warning({**bare, "SLURM_STEP_ID": "0"}) is None
