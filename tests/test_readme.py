"""The README's quick command blocks run as printed.

A fenced block preceded by the marker line below runs in under a minute on one host; this test
runs exactly those blocks, line by line, so the README cannot drift from what ringtrain does.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest
from conftest import ENV, ROOT

MARKER = "<!-- ci: runs in under a minute -->"
# Files the commands name relative to the repository root.
REPO_FOLDERS = ("hostfiles", "examples", "slurm")


def marked_commands(readme: str) -> list[str]:
    """Every command line of every marked block, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(re.escape(MARKER) + r"\n```[a-z]*\n(.*?)```", readme, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


COMMANDS = marked_commands((ROOT / "README.md").read_text())


def test_the_readme_marks_quick_blocks():
    assert len(COMMANDS) >= 5, COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_a_quick_readme_command_runs_as_printed(command, tmp_path):
    for folder in REPO_FOLDERS:
        os.symlink(ROOT / folder, tmp_path / folder)
    env = {**ENV, "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
