"""Rank-aware output: rank 0 speaks for the job, any other rank's line carries its rank."""

from __future__ import annotations

import sys
import time

from ringtrain.launch.env import who_am_i

_rank = 0


def set_rank(rank: int) -> None:
    global _rank
    _rank = rank


def info(message: str) -> None:
    """Progress and results: printed by rank 0 only."""
    if _rank == 0:
        print(message, flush=True)


def any_rank(message: str) -> None:
    """A line any rank may need to say (a warning); prefixed with its rank."""
    prefix = f"[rank {_rank}] " if _rank else ""
    print(f"{prefix}{message}", file=sys.stderr, flush=True)


class ProgressBar:
    """A per-epoch bar on rank 0; redrawn in place on a terminal, one summary line elsewhere."""

    def __init__(self, label: str, total: int, width: int = 30):
        self.label, self.total, self.width = label, total, width
        self.done, self.start = 0, time.perf_counter()
        # Redrawing needs a real terminal of our own: launchers tag and interleave rank output.
        self.live = _rank == 0 and sys.stdout.isatty() and who_am_i().source == "single"

    def update(self, loss: float) -> None:
        self.done += 1
        if self.live:
            filled = self.width * self.done // self.total
            bar = "#" * filled + "." * (self.width - filled)
            print(
                f"\r{self.label} [{bar}] {self.done}/{self.total} loss {loss:.4f}",
                end="",
                flush=True,
            )

    def close(self, summary: str) -> None:
        if self.live:
            print("\r" + " " * (len(self.label) + self.width + 40) + "\r", end="")
        seconds = time.perf_counter() - self.start
        info(f"{self.label}: {summary} ({seconds:.1f} s)")
