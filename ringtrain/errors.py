"""One kind of error for everything the user got wrong, so the CLI can print one line and exit."""

from __future__ import annotations

import sys

EXIT_USAGE = 2  # bad flags, files or rank counts
EXIT_FAILURE = 1  # a run that started and then failed
EXIT_CHECKPOINTED = 75  # stopped on a signal after writing a checkpoint; not finished (EX_TEMPFAIL)


class UserError(Exception):
    """A problem the user can fix; its message is the whole story, so no traceback is shown."""


def report(prog: str, message: str, rank: int | None = None) -> None:
    """One line on stderr; other ranks than 0 say who they are, so mixed logs stay readable."""
    prefix = f"[rank {rank}] " if rank else ""
    print(f"{prefix}{prog}: error: {message}", file=sys.stderr, flush=True)
