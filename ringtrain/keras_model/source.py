"""A user's own function, named on the command line as PATH.py:FUNCTION or module:FUNCTION.

`--model` names one that returns a compiled keras.Model, `--data` one that returns numpy
arrays. A mistake in the name, the file or what the function returns is a bad input, said in
one line; an exception inside the user's own code is theirs, and keeps its traceback.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ringtrain.errors import UserError


def check_target(flag: str, target: str) -> tuple[str, str]:
    """(where, function name), checked without importing anything: a bad name or a missing
    file is said before TensorFlow loads."""
    where, _, name = target.rpartition(":")
    if not where or not name.isidentifier():
        raise UserError(f"{flag} {target!r}: expected PATH.py:FUNCTION or package.module:FUNCTION")
    if where.endswith(".py") and not os.path.isfile(where):
        raise UserError(f"{flag}: file {where} does not exist")
    return where, name


def load_function(flag: str, target: str) -> Callable:
    """The function `target` names: a file's (PATH.py:FUNCTION) or an importable module's."""
    where, name = check_target(flag, target)
    module = _module_from_file(where) if where.endswith(".py") else _module(flag, where)
    function = getattr(module, name, None)
    if function is None:
        raise UserError(f"{flag} {target!r}: {where} defines no {name}")
    if not callable(function):
        raise UserError(f"{flag} {target!r}: {name} in {where} is not a function")
    return function


def _module_from_file(path: str):
    name = f"ringtrain_user_{os.path.splitext(os.path.basename(path))[0]}"
    if name in sys.modules:  # the same file named by --model and --data: loaded once
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _module(flag: str, dotted: str):
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as exc:
        if exc.name and dotted.startswith(exc.name):
            raise UserError(f"{flag}: no module named {dotted} on the Python path") from None
        raise


def parse_arguments(pairs: Sequence[str]) -> dict[str, Any]:
    """--model-arg KEY=VALUE: VALUE as a Python literal (3, 0.1, True, [64, 64]), else text."""
    arguments = {}
    for pair in pairs:
        key, equals, text = pair.partition("=")
        if not equals or not key.isidentifier():
            raise UserError(f"--model-arg {pair!r}: expected KEY=VALUE, e.g. --model-arg units=64")
        try:
            arguments[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            arguments[key] = text
    return arguments
