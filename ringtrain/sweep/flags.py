"""A trial's `ringtrain train` flags: the shared ones, its parameters, its outputs. No
TensorFlow here: the shared flags are checked with them before it loads."""

from __future__ import annotations

import os

# Per-trial outputs: the sweep sets them in each trial's folder, so the shared flags may not.
OWNED_FLAGS = (
    "checkpoint-dir",
    "resume",
    "weights-out",
    "metrics-out",
    "initial-weights-out",
    "save",
    "trace",
    "gantt",
    "stop-after",
)

# Shared flags that only make sense beside the per-trial checkpoint folder the sweep adds.
WITH_CHECKPOINTS = ("checkpoint-every", "keep")


def without(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """`argv` without the flags `names` (each with its value, `--x V` or `--x=V`)."""
    kept, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        flag, equals, _ = token.partition("=")
        if flag.startswith("--") and flag[2:] in names:
            skip = not equals
            continue
        kept.append(token)
    return kept


def trial_flags(shared: list[str], params: list[list[str]], folder: str, resume: bool) -> list[str]:
    """The trial's `train` flags: the shared ones, then its parameters (argparse keeps the last
    of a repeated flag), then its outputs in its folder. `--tensorboard DIR` becomes one run per
    trial, DIR/trial-NNNNN; a retry resumes from the trial's checkpoint, if it has one."""
    argv = ["--progress", "none"]  # the trials' lines would interleave; the user may override
    board = False
    for token in shared:
        if board:
            token, board = os.path.join(token, os.path.basename(folder)), False
        elif token.startswith("--tensorboard="):
            token = f"{token}{os.sep}{os.path.basename(folder)}"
        board = board or token == "--tensorboard"
        argv.append(token)
    for flags in params:
        argv += flags
    argv += ["--weights-out", os.path.join(folder, "weights.npz")]
    argv += ["--metrics-out", os.path.join(folder, "metrics.json")]
    argv += ["--checkpoint-dir", os.path.join(folder, "checkpoints")]
    return argv + (["--resume"] if resume else [])


def tensorboard_folder(argv: list[str]) -> str | None:
    """Where the trial's --tensorboard run goes, if it has one."""
    for i, token in enumerate(argv):
        if token == "--tensorboard" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--tensorboard="):
            return token.split("=", 1)[1]
    return None
