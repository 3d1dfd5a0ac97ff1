"""TensorFlow's start-up notices, held back at the file-descriptor level.

TensorFlow 2.19 and later log through absl before absl is initialised, and those lines ignore
TF_CPP_MIN_LOG_LEVEL: on CPUs where TensorFlow turns oneDNN on by itself (AVX512-VNNI, AMX),
every process prints "All log messages before absl::InitializeLog()" and a oneDNN notice,
twice, as `import tensorflow` runs. They come from C++ straight to file descriptor 2, so
Python's logging cannot catch them. While TensorFlow imports, fd 2 goes to a temporary file;
afterwards every line goes back to stderr except the absl-format lines below the level that
TF_CPP_MIN_LOG_LEVEL asks for (0 keeps everything, and then nothing is held back at all).

`install()` makes every later `import tensorflow` in the process do this, however it is
reached (Horovod, Keras, a benchmark worker). ringtrain installs it on import; the set-up also
runs it at interpreter start in ringtrain's venv (a .pth line), so horovodrun's own build
check, which imports TensorFlow in a process ringtrain never runs in, stays quiet too.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import re
import sys
import tempfile
from collections.abc import Iterator

# absl's prefix: severity, date and time (0000 00:00:<epoch seconds> before InitializeLog),
# thread, file:line].
_ABSL_LINE = re.compile(rb"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\] ")
_ABSL_PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called"
_SEVERITY = {b"I": 0, b"W": 1, b"E": 2, b"F": 3}


def min_log_level() -> int:
    """The level TF_CPP_MIN_LOG_LEVEL asks for (0 when unset or unreadable, as TensorFlow)."""
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


def kept(text: bytes, level: int) -> bytes:
    """The lines of `text` that a process at `level` should still show."""
    shown = []
    for line in text.splitlines(keepends=True):
        if line.startswith(_ABSL_PREAMBLE) and level >= 1:
            continue
        found = _ABSL_LINE.match(line)
        if found and _SEVERITY[found.group(1)] < level:
            continue
        shown.append(line)
    return b"".join(shown)


@contextlib.contextmanager
def held_stderr() -> Iterator[None]:
    """Fd 2 into a temporary file for the block, then back with the notices filtered out."""
    level = min_log_level()
    if level <= 0:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            rest = kept(held.read(), level)
            if rest:
                os.write(2, rest)


class _QuietTensorFlowFinder(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` as the path finder would, and runs its import inside held_stderr."""

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            with held_stderr():
                run(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Quiet every later `import tensorflow` in this process (once; a no-op once loaded)."""
    if "tensorflow" in sys.modules:
        return
    if not any(isinstance(f, _QuietTensorFlowFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietTensorFlowFinder())
