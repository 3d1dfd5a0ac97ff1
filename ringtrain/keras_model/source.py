"""A user's own function, named on the command line as PATH.py:FUNCTION or module:FUNCTION.

`--model` names one that returns a compiled keras.Model, `--data` one that returns numpy
arrays or tf.data.Datasets. A mistake in the name, the file or what the function returns is a
bad input, said in one line; an exception inside the user's own code is theirs, and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ringtrain.config import TrainConfig, check_paths, is_model_function
from ringtrain.errors import UserError, raised
from ringtrain.proc import resident_bytes


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


def called(flag: str, target: str, function: Callable, **kwargs):
    """The user's function's result; what it raises is said in one line as their fault."""
    try:
        return function(**kwargs)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"{flag} {target} failed: {raised(exc)}") from None


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


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """--model-arg and --data, the flags that go with --model FUNCTION (train and plan)."""
    p.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an argument for --model FUNCTION: VALUE as a Python literal, else as text",
    )
    p.add_argument(
        "--data",
        metavar="PATH.py:FUNCTION",
        help="your own data for --model FUNCTION: FUNCTION returns (x, y) or "
        "((x, y), (x_val, y_val)) as numpy arrays, or a tf.data.Dataset of unbatched "
        "(features, label) elements, or two (train, validation) (instead of --dataset)",
    )


def check_source_flags(
    model: str, model_args: Sequence[str], data: str | None, dataset: str
) -> None:
    """--model-arg and --data go with --model FUNCTION; --data replaces --dataset."""
    if not is_model_function(model):
        for flag, value in (("--model-arg", model_args), ("--data", data)):
            if value:
                raise UserError(f"{flag} needs --model PATH.py:FUNCTION, your own model")
    else:
        check_target("--model", model)
    if data:
        check_target("--data", data)
    if data and dataset != TrainConfig.dataset:
        raise UserError("give either --data or --dataset, not both")
    parse_arguments(model_args)


def source_flags(model: str, model_args: Sequence[str], data: str | None, dataset: str) -> list:
    """The flags that name a user's model and its data again, for a command line to print."""
    flags = ["--model", model]
    for pair in model_args:
        flags += ["--model-arg", pair]
    return flags + (["--data", data] if data else ["--dataset", dataset])


def add_file_arguments(p: argparse.ArgumentParser) -> None:
    """--data-files and --validation-files: a --model FUNCTION's examples in shards."""
    p.add_argument(
        "--data-files",
        metavar="GLOB",
        help="training examples in files (instead of --dataset; quote the GLOB): TFRecord "
        "shards, each record parsed by --data PATH.py:FUNCTION, or .npy shards, pairs "
        "x-NNNNN.npy and y-NNNNN.npy read through memory maps",
    )
    p.add_argument(
        "--validation-files",
        metavar="GLOB",
        help="held-out examples in files of the same kind as --data-files",
    )
    p.add_argument(
        "--validation-data",
        metavar="PATH.py:FUNCTION",
        help="held-out examples for --model FUNCTION: FUNCTION returns (x_val, y_val) as "
        "numpy arrays or a tf.data.Dataset of unbatched (features, label) elements",
    )


def check_file_flags(args: argparse.Namespace, dataset: str) -> None:
    """--data-files replaces --data and --dataset; --validation-files goes with it."""
    if args.validation_files and not args.data_files:
        raise UserError("--validation-files goes with --data-files")
    if args.validation_data:
        if not is_model_function(args.model):
            raise UserError("--validation-data needs --model PATH.py:FUNCTION, your own model")
        if args.validation_files:
            raise UserError("give either --validation-data or --validation-files, not both")
        check_target("--validation-data", args.validation_data)
    if not args.data_files:
        if args.shard_policy == "file":
            raise UserError("--shard-policy file needs --data-files: it deals files to readers")
        return
    if not is_model_function(args.model):
        raise UserError("--data-files needs --model PATH.py:FUNCTION, your own model")
    if args.data and args.data_files.endswith(".npy"):
        raise UserError(
            "--data goes with TFRecord --data-files (it parses a record); .npy shards need none"
        )
    if dataset != TrainConfig.dataset:
        raise UserError("give either --data-files or --dataset, not both")


def _files(pattern: str | None, flag: str, parse: str | None):
    """(examples, records per file, their reader or None) of the .npy or TFRecord shards
    `pattern` matches."""
    from ringtrain.data import Examples
    from ringtrain.records import ParsedRecords, RecordFiles
    from ringtrain.shards import ShardedExamples, matching_files, npy_pairs

    if pattern is None:
        return None, None, None
    paths = matching_files(pattern, flag)
    if all(path.endswith(".npy") for path in paths):
        if parse is not None:
            raise UserError(f"{flag} {pattern} names .npy shards, which need no --data parser")
        shards = ShardedExamples(*npy_pairs(paths, flag))
        return Examples(*shards.columns()), shards.file_rows, shards
    if parse is None:
        raise UserError(
            f"{flag} {pattern}: TFRecord files need --data PATH.py:FUNCTION, the function "
            "that parses one record into (features, label)"
        )
    records = ParsedRecords(RecordFiles(paths, flag), load_function("--data", parse), flag)
    return records.examples(), records.files.rows, records


def load_user_data(
    target: str | None,
    cfg: TrainConfig,
    data_files: str | None = None,
    validation_files: str | None = None,
    validation_data: str | None = None,
):
    """The training data, and the held-out examples --validation-data FUNCTION returns."""
    data = _training_data(target, cfg, data_files, validation_files)
    if validation_data is None:
        return data
    if data.validation is not None:
        raise UserError(
            f"held-out examples given twice: by --validation-data and by --data {target}"
        )
    returned = called(
        "--validation-data", validation_data, load_function("--validation-data", validation_data)
    )
    from ringtrain import streamed
    from ringtrain.data import Examples

    flag = f"--validation-data {validation_data}"
    if streamed.is_dataset(returned):
        data.validation = streamed.in_memory(returned, flag)
    elif isinstance(returned, tuple) and len(returned) == 2:
        data.validation = Examples(*returned)
    else:
        raise UserError(f"{flag} must return (x_val, y_val) or a tf.data.Dataset")
    return data


def _training_data(
    target: str | None, cfg: TrainConfig, data_files: str | None, validation_files: str | None
):
    """--data FUNCTION's arrays, --data-files' shards, or a --dataset's arrays with its
    held-out part for validation."""
    from ringtrain.data import Examples, UserData, load_dataset

    check_paths(cfg)
    if data_files:
        train, rows, reader = _files(data_files, "--data-files", target)
        held_out = _files(validation_files, "--validation-files", target)[0]
        return UserData(train, held_out, rows, cfg.shuffle_buffer, reader=reader)
    if target is None:
        found = load_dataset(cfg.dataset, cfg.seed, cfg.synthetic_size, cfg.synthetic_shape)
        return UserData(Examples(found.x, found.y), Examples(found.x_test, found.y_test))
    returned = called("--data", target, load_function("--data", target))
    flag = f"--data {target}"
    from ringtrain import streamed

    if streamed.is_dataset(returned):
        return UserData(streamed.streamed(returned, cfg.batch_size, flag), in_order=True)
    if (
        isinstance(returned, tuple)
        and len(returned) == 2
        and all(streamed.is_dataset(part) for part in returned)
    ):
        train = streamed.streamed(returned[0], cfg.batch_size, flag)
        return UserData(train, streamed.in_memory(returned[1], flag), in_order=True)
    if (
        isinstance(returned, tuple)
        and len(returned) == 2
        and all(isinstance(part, tuple) and len(part) == 2 for part in returned)
    ):
        return UserData(Examples(*returned[0]), Examples(*returned[1]))
    if isinstance(returned, tuple) and len(returned) == 2:
        return UserData(Examples(*returned))
    raise UserError(
        f"{flag} returned {type(returned).__name__}; expected (x, y), ((x, y), (x_val, y_val)), "
        "a tf.data.Dataset of (features, label) elements, or two of them (train, validation)"
    )


RESIDENT_BEFORE_MODEL = [0]  # this rank's VmHWM when the CLI began building its model


def built(build, weightless: bool):
    """`build()`, or with its variables left pending (keras_model.deferred)."""
    RESIDENT_BEFORE_MODEL[0] = resident_bytes("VmHWM")
    if not weightless:
        return build()
    from ringtrain.keras_model.deferred import build_weightless

    return build_weightless(build)


def build_user_model(target: str, model_args: Sequence[str], seed: int, weightless: bool = False):
    """The compiled model --model FUNCTION returns, built after seeding, so
    `keras.utils.set_random_seed(seed); build()` anywhere gives the run's initial weights.
    `weightless` (a pipeline rank): its variables are left pending, each rank materializes its
    own stages' (keras_model.deferred)."""
    from ringtrain.keras_model.compiled import check_compiled
    from ringtrain.tensorflow_loader import tf  # noqa: F401  (before Keras)

    # isort: split
    import keras

    build = load_function("--model", target)
    arguments = parse_arguments(model_args)
    keras.utils.set_random_seed(seed)
    model = built(lambda: called("--model", target, build, **arguments), weightless)
    check_compiled(model, f"--model {target}")
    return model
