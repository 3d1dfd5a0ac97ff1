"""Where a study lives, by URL, and the study itself: opened, or created with its space.

- `sqlite:///PATH`: Optuna's RDB storage in one file, for one host;
- `journal:PATH`: Optuna's journal file, for several nodes on a shared path (Optuna's docs
  warn against SQLite over a network filesystem);
- any other SQLAlchemy URL (`postgresql://...`): a database server the user runs.

Asking for a trial happens under a lock beside the file (`PATH.ask-lock`, flock), so that groups
and concurrent sweeps never start more trials than `--trials` between them. A server URL has
no such file: there two sweeps at once may overshoot the total by a trial per group.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from ringtrain.errors import UserError

SPACE_ATTR = "ringtrain.space"
OBJECTIVE_ATTR = "ringtrain.objective"
TRAIN_ARGV_ATTR = "ringtrain.train_argv"
CONNECT_TIMEOUT_S = 10


@dataclass(frozen=True)
class StorageURL:
    url: str
    kind: str  # sqlite, journal or server
    path: str | None  # the file, for sqlite and journal

    @property
    def lock_path(self) -> str | None:
        return f"{self.path}.ask-lock" if self.path else None  # Optuna's journal has .lock


def parse_storage(url: str) -> StorageURL:
    if url.startswith("journal:"):
        path = url[len("journal:") :]
        kind = "journal"
    elif url.startswith("sqlite:///"):
        path, kind = url[len("sqlite:///") :], "sqlite"
    elif "://" in url and not url.startswith("sqlite:"):
        return StorageURL(url, "server", None)
    else:
        raise UserError(
            f"--storage {url!r}: expected sqlite:///PATH, journal:PATH or a database URL such "
            "as postgresql://USER@HOST/DB"
        )
    if not path:
        raise UserError(f"--storage {url!r}: the path is missing")
    return StorageURL(url, kind, os.path.abspath(path) if kind == "journal" else path)


def check_writable(storage: StorageURL) -> None:
    """A file storage's folder must exist and take writes, before any rank trains."""
    if storage.path is None:
        return
    folder = os.path.dirname(os.path.abspath(storage.path)) or "."
    if not os.path.isdir(folder):
        raise UserError(f"--storage {storage.url}: folder {folder} does not exist")
    target = storage.path if os.path.exists(storage.path) else folder
    try:  # by writing: access() says yes to root even where the filesystem says no
        if target == folder:
            tempfile.TemporaryFile(dir=folder).close()
        else:
            open(target, "ab").close()
    except OSError as exc:
        problem = f"{target} is not writable ({exc.strerror})"
        raise UserError(f"--storage {storage.url}: {problem}") from None


@contextlib.contextmanager
def asking(storage: StorageURL) -> Iterator[None]:
    """Held while a group counts the study's trials and asks for the next one, and while a new
    SQLite file gets its tables."""
    if storage.lock_path is None:
        yield
        return
    with open(storage.lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def open_storage(storage: StorageURL):
    """Optuna's storage object; a server that does not answer is named in one line. A new
    SQLite file gets its tables under the file lock: two processes making them at once (a
    sweep starting while `sweep status` reads it) would both insert the schema's version."""
    import optuna

    check_writable(storage)
    try:
        if storage.kind == "journal":
            from optuna.storages.journal import JournalFileBackend, JournalStorage

            return JournalStorage(JournalFileBackend(storage.path))
        kwargs = {}
        if storage.kind == "server":
            kwargs = {"engine_kwargs": {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}}
        with asking(storage):
            return optuna.storages.RDBStorage(storage.url, **kwargs)
    except UserError:
        raise
    except Exception as exc:  # sqlalchemy's and the drivers' errors, in one line
        raise UserError(f"--storage {_hidden(storage.url)}: {_first_line(exc)}") from None


def _hidden(url: str) -> str:
    """The URL without its password."""
    head, at, tail = url.rpartition("@")
    if not at or ":" not in head.split("//", 1)[-1]:
        return url
    scheme, _, user = head.partition("//")
    return f"{scheme}//{user.split(':', 1)[0]}:***@{tail}"


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return (text.splitlines() or [type(exc).__name__])[0]


def open_study(
    storage: StorageURL,
    name: str,
    direction: str,
    space_record: str,
    objective: str,
    train_argv: list[str],
    pruner=None,
):
    """The study `name`, created if new; one that exists must have this direction, space and
    objective (else its trials would not compare), so a sweep started again continues it."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    backend = open_storage(storage)
    with asking(storage):
        try:
            study = optuna.create_study(
                storage=backend,
                study_name=name,
                direction=direction,
                pruner=pruner,
                load_if_exists=True,
            )
        except Exception as exc:
            raise UserError(f"--storage {_hidden(storage.url)}: {_first_line(exc)}") from None
        had = study.direction.name.lower()
        if had != direction:
            raise UserError(
                f"study {name!r} exists with --direction {had}; this sweep asks {direction}"
            )
        attrs = study.user_attrs
        for key, mine, what in (
            (SPACE_ATTR, space_record, "a different search space"),
            (OBJECTIVE_ATTR, objective, f"--objective {attrs.get(OBJECTIVE_ATTR)}"),
        ):
            if key in attrs and attrs[key] != mine:
                raise UserError(f"study {name!r} exists with {what}; use a new --study name")
        for key, value in (
            (SPACE_ATTR, space_record),
            (OBJECTIVE_ATTR, objective),
            (TRAIN_ARGV_ATTR, train_argv),
        ):
            if key not in attrs:
                study.set_user_attr(key, value)
    return study


def load_study(storage: StorageURL, name: str):
    """An existing study, to read; a name the storage does not hold is named with those it does."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    backend = open_storage(storage)
    try:
        return optuna.load_study(study_name=name, storage=backend)
    except KeyError:
        names = [s.study_name for s in optuna.get_all_study_summaries(backend)]
        held = ", ".join(names) if names else "none"
        raise UserError(f"no study {name!r} in {_hidden(storage.url)} (it holds: {held})") from None
