"""ringtrain's exit codes and its one family of errors, so the CLI can say one line and exit.

Every subcommand raises a `UserError` (or a subclass carrying its own exit code); `cli.main` is
the one place that turns it into a single `ringtrain <command>: error: ...` line and a code.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_PROBLEMS = 1  # a check ran and found problems; a run failed in a way not listed below
EXIT_USAGE = 2  # bad flags, files, checkpoints or rank counts
EXIT_SILENT_PEER = 3  # a peer went silent past its deadline, named with its host (MPI_Abort)
EXIT_WATCHDOG = 4  # no step finished within --comm-timeout (MPI_Abort)
EXIT_NON_FINITE = 5  # the loss or the weights became NaN or infinite
EXIT_INTERNAL = 70  # a bug: an exception ringtrain did not expect (EX_SOFTWARE)
EXIT_CHECKPOINTED = 75  # stopped on a signal after writing a checkpoint; not finished (EX_TEMPFAIL)
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


class UserError(Exception):
    """The family of every error ringtrain reports: its message is the whole story, so no
    traceback is shown; subclasses carry their own exit code.

    `together` says that every rank stops at this same point (flags validated alike, or a
    verdict the ranks agreed on), so none is left waiting; an error without it may be this
    rank's alone, so once MPI runs the CLI ends the whole job. `said_elsewhere` marks a rank
    that stays quiet because another rank reports the problem. `prog` names the subcommand
    when the error is raised before the command line is parsed.
    """

    exit_code = EXIT_USAGE
    together = False
    said_elsewhere = False
    prog: str | None = None

    def on_every_rank(self, rank: int) -> UserError:
        """Mark an error that every rank raised alike: rank 0 speaks for the job."""
        self.together, self.said_elsewhere = True, rank != 0
        return self


@contextmanager
def alike_on_every_rank(rank: int) -> Iterator[None]:
    """For pure checks (flags, rank counts) that every rank runs with the same inputs."""
    try:
        yield
    except UserError as exc:
        exc.on_every_rank(rank)
        raise


class ProblemsFound(UserError):
    """A run or check that went wrong for reasons outside the flags (e.g. a benchmark's rank)."""

    exit_code = EXIT_PROBLEMS


class NonFiniteError(UserError):
    """The loss or the weights became NaN or infinite: training stops before saving them."""

    exit_code = EXIT_NON_FINITE


class InternalError(UserError):
    """An exception ringtrain did not expect, told in one line naming where it was raised."""

    exit_code = EXIT_INTERNAL

    @classmethod
    def from_exception(cls, exc: BaseException) -> UserError:
        """The exception in one line, or the user's input it is really about."""
        known = _known_input_problem(exc)
        if known is not None:
            return known
        return cls(f"internal error: {raised(exc)}; set RINGTRAIN_TRACEBACK=1 to see the traceback")


def raised(exc: BaseException) -> str:
    """`Type: message (at file:line)`, the line where it was raised."""
    where = ""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        where = f" (at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"
    return f"{type(exc).__name__}: {exc}{where}"


LABEL_OUT_OF_RANGE = re.compile(
    r"Received a label value of (-?\d+) which is outside the valid range of \[0, (\d+)\)"
)


def _known_input_problem(exc: BaseException) -> UserError | None:
    """A library's error that names a fault in the user's data, said as that fault."""
    found = LABEL_OUT_OF_RANGE.search(str(exc))
    if found:
        return UserError(
            f"labels out of range: the data holds label {found[1]}, but the model's output has "
            f"{found[2]} classes (labels 0..{int(found[2]) - 1})"
        )
    return None


def report(prog: str, message: str, rank: int | None = None) -> None:
    """One line on stderr; other ranks than 0 say who they are, so mixed logs stay readable."""
    prefix = f"[rank {rank}] " if rank else ""
    line = " ".join(message.split())  # one line, even for a library's multi-line message
    print(f"{prefix}{prog}: error: {line}", file=sys.stderr, flush=True)
