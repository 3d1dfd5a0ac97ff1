"""Rank-aware output: rank 0 speaks for the job, any other rank's line carries its rank.

Every line leaves in one write. Launchers that tag output (`mpirun --tag-output`, which
`horovodrun` uses) tag each chunk they read, so a line written in two pieces (print() writes
the text and its newline separately when Python runs unbuffered, as PYTHONUNBUFFERED=1 asks)
comes out glued to the next line's tag.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import TextIO

_rank = 0
_bar_open = False  # a live bar's line waits on stdout for its end


def set_rank(rank: int) -> None:
    global _rank
    _rank = rank


def _say(stream: TextIO, line: str) -> None:
    global _bar_open
    if _bar_open:  # end the bar's line first, so nothing is written onto it
        sys.stdout.write("\n")
        sys.stdout.flush()
        _bar_open = False
    stream.write(line + "\n")
    stream.flush()


def info(message: str) -> None:
    """Progress and results: printed by rank 0 only."""
    if _rank == 0:
        _say(sys.stdout, message)


def each_rank(message: str) -> None:
    """A line from whichever rank has it (a sweep's group): rank 0's as info, others' tagged."""
    (info if _rank == 0 else any_rank)(message)


def any_rank(message: str) -> None:
    """A line any rank may need to say (a warning); prefixed with its rank."""
    prefix = f"[rank {_rank}] " if _rank else ""
    _say(sys.stderr, f"{prefix}{message}")


def progress_style(mode: str, launcher: str, environ: Mapping[str, str] | None = None) -> str:
    """What `--progress auto` means here: a live bar only for a person at a terminal of their
    own; lines under any launcher (it interleaves and tags rank output), in a Slurm batch
    script, or when stdout is a file or a pipe."""
    if mode != "auto":
        return mode
    env = os.environ if environ is None else environ
    launched = launcher != "single" or "SLURM_JOB_ID" in env
    return "lines" if launched or not sys.stdout.isatty() else "bar"


class EpochProgress:
    """One epoch as rank 0 shows it: a live Keras progress bar (`bar`), one line at the end
    (`lines`), or nothing (`none`); other ranks show nothing."""

    def __init__(self, style: str, label: str, steps: int):
        self.style = style if _rank == 0 else "none"
        self.label, self.steps, self.done = label, steps, 0
        self.started = time.perf_counter()
        self.bar = None
        if self.style == "bar":
            from keras.utils import Progbar

            info(label)
            self.bar = Progbar(steps, stateful_metrics=["loss"])

    def update(self, loss: float) -> None:
        """One step done; the bar's last step waits for the epoch's results in end()."""
        global _bar_open
        self.done += 1
        if self.bar is not None and self.done < self.steps:
            self.bar.update(self.done, [("loss", loss)])
            _bar_open = True

    def end(self, results: dict[str, float]) -> None:
        """The epoch's results, e.g. {"loss": 0.31, "held-out accuracy": 0.9}."""
        global _bar_open
        if self.bar is not None:
            self.bar.update(self.done, list(results.items()), finalize=True)
            _bar_open = False
        elif self.style == "lines":
            shown = "  ".join(f"{name} {value:.4f}" for name, value in results.items())
            seconds = time.perf_counter() - self.started
            info(f"{self.label}: {shown} ({seconds:.1f} s)")
