"""The training configuration: every flag of `ringtrain train` declared once, as a field.

A field's `Flag` holds its help, its choices, the bound its value must meet and, for an output,
how its path is checked. `ringtrain train`'s options and `--help` (cli.py), the checks of single
values and the checks of output paths are all made from these declarations, so a default, a
choice or a bound is written in one place. The checks are pure: the same values give the same
verdict on every rank. Rules that tie flags together live in validation.py.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, field, fields
from types import NoneType, UnionType
from typing import Any, get_args, get_origin, get_type_hints

from ringtrain.deadline import DEFAULT_MIN_LINK_RATE
from ringtrain.errors import UserError

STRATEGIES = ("single", "data", "model", "pipeline", "hybrid")
MODELS = ("mlp", "cnn", "transformer")
OPTIMIZERS = ("sgd", "adam")
LOOPS = ("custom", "fit")
SHARD_POLICIES = ("data", "file", "auto", "off")
SCHEDULE_KINDS = ("gpipe", "1f1b", "1f1b-ahead", "interleaved", "zb-h1")
PARTITIONS = ("uniform", "params", "time")
PROGRESS = ("auto", "bar", "lines", "none")
MPI_PROGRESS = ("auto", "thread", "off")
MAX_SEED = 2**32 - 1  # what every seeded generator on the way accepts
MODEL_FUNCTION = ":"  # --model PATH.py:FUNCTION (or package.module:FUNCTION)
SCHEDULE_FILE = ".json"  # --schedule FILE.json: a schedule as `ringtrain schedule --json` prints it
SHAPE_EXAMPLE = "32,32,3"
# The command line's own defaults, where the Python API's would not suit a run from a shell:
CLI_EPOCHS = 15  # when neither --epochs nor --steps is given (the API's: one epoch)
PIPELINE_MICROBATCHES = 4  # --microbatches of a pipeline without a schedule file (the API's: 1)

Bound = Callable[[Any], str | None]  # what is wrong with a value, or None


def at_least(low: int) -> Bound:
    return lambda value: None if value >= low else f"must be at least {low}, got {value}"


def positive(value: float) -> str | None:
    return None if value > 0 else f"must be positive, got {value}"


def not_negative(value: float) -> str | None:
    return None if value >= 0 else f"must not be negative, got {value}"


def _seed_range(value: int) -> str | None:
    if 0 <= value <= MAX_SEED:
        return None
    return f"must be a whole number from 0 to {MAX_SEED}, got {value}"


def shape_text(shape: tuple[int, ...]) -> str:
    return ",".join(str(d) for d in shape)


def _dimensions(shape: tuple[int, ...]) -> str | None:
    if shape and min(shape) >= 1:
        return None
    return f"{shape_text(shape)} needs dimensions of at least 1"


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([KMGT]?)(i?B)?$", re.IGNORECASE)


def byte_size(what: str) -> Callable[[str], int]:
    """An argparse type for an amount of memory: BYTES, or a number with K, M, G or T (powers
    of 1024, so 300M is 300 MiB). `what` names it in the refusal of zero, e.g. "a rank's
    memory"; `train` and `plan --memory-per-rank` and `cluster up --mem-per-node` read sizes
    alike."""

    def parse(text: str) -> int:
        found = _SIZE.match(text.strip())
        if not found:
            raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 2G or 512M)")
        value = int(float(found.group(1)) * 1024 ** " KMGT".index(found.group(2).upper() or " "))
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{what} must be above zero, got {text!r}")
        return value

    return parse


def check_writable(flag: str, path: str | None) -> None:
    if path is None:
        return
    if os.path.isdir(path):
        raise UserError(f"{flag} {path} is a folder; name a file in it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {path}: folder {folder} does not exist")
    try:  # a real probe: os.access says yes to root even where writes fail
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError:
        raise UserError(f"{flag} {path}: folder {folder} is not writable") from None


def check_folder(flag: str, path: str | None) -> None:
    """A folder that exists and takes new files, or that can be made in an existing,
    writable parent."""
    if path is None:
        return
    folder = os.path.abspath(path)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"{flag} {path} is a file, not a folder")
    check_writable(flag, os.path.join(folder, "x") if os.path.isdir(folder) else folder)


def check_png(flag: str, path: str | None) -> None:
    """Charts are PNG files; say so before any work rather than fail when saving."""
    if path is None:
        return
    if os.path.splitext(path)[1].lower() != ".png":
        raise UserError(f"{flag} {path}: the chart is written as PNG, so name it *.png")
    check_writable(flag, path)


def check_keras_file(flag: str, path: str | None) -> None:
    """Keras saves its own format only to *.keras; say so before any work."""
    if path is None:
        return
    if not path.endswith(".keras"):
        raise UserError(f"{flag} {path}: Keras saves a model as PATH.keras, so name it *.keras")
    check_writable(flag, path)


@dataclass(frozen=True)
class Flag:
    """How a field is given on the command line and which values it takes.

    `help` may name `{choices}`, which lists them. Choices and bounds are checked by
    `check_values` rather than by argparse, so every bad value gets the same kind of line.
    """

    help: str | None = None
    choices: tuple[str, ...] = ()
    or_file: str = ""  # besides the choices, a file with this suffix (--schedule FILE.json)
    bound: Bound | None = None
    path: Callable[[str, str | None], None] | None = None  # how an output path is checked
    group: str | None = None  # flags of one group exclude each other on the command line
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # the command line's text to a value (a size)

    def describe(self) -> str | None:
        return self.help and self.help.format(choices=", ".join(self.choices))


def flag(help: str | None = None, **how: Any) -> dict[str, Flag]:
    """A TrainConfig field's metadata: its flag."""
    return {"flag": Flag(help, **how)}


@dataclass
class TrainConfig:
    """Everything that decides what a run computes; identical on every rank."""

    strategy: str = field(default="data", metadata=flag("one of {choices}", choices=STRATEGIES))
    model: str = field(
        default="mlp",
        metadata=flag(
            "one of {choices}, or your own: PATH.py:FUNCTION or package.module:FUNCTION, a "
            "function returning a compiled keras.Model",
            choices=MODELS,
            or_file=MODEL_FUNCTION,
        ),
    )
    dataset: str = field(default="digits", metadata=flag("digits, synthetic or npz:PATH"))
    batch_size: int = field(default=64, metadata=flag("the global batch", bound=at_least(1)))
    epochs: int | None = field(
        default=None,
        metadata=flag(
            f"default {CLI_EPOCHS} when --steps is absent", bound=at_least(1), group="length"
        ),
    )
    steps: int | None = field(
        default=None, metadata=flag("optimizer updates to run", bound=at_least(1), group="length")
    )
    optimizer: str = field(default="adam", metadata=flag("one of {choices}", choices=OPTIMIZERS))
    lr: float = field(default=0.003, metadata=flag(bound=positive))
    seed: int = field(default=0, metadata=flag(bound=_seed_range))
    shuffle: bool = field(
        default=True,
        metadata=flag(
            "a new order of the examples each epoch, drawn from the seed and the epoch "
            "(--no-shuffle: in order, as Keras's fit with shuffle=False)"
        ),
    )
    shuffle_buffer: int = field(
        default=10000,
        metadata=flag(
            "with --data-files, --shuffle draws the files' order, then permutes the rows "
            "within windows of this many",
            bound=at_least(1),
        ),
    )
    shard_policy: str = field(
        default="data",
        metadata=flag(
            "how the data-parallel replicas share the examples, named as TF's "
            "AutoShardPolicy: data (each takes its share of every global batch: the same "
            "batches under every strategy and rank count), file (each reads its own "
            "--data-files), auto (file when there are at least as many files as replicas), "
            "off (each rank's --data Dataset is its own share, as after dataset.shard(size, "
            "rank); --strategy data)",
            choices=SHARD_POLICIES,
        ),
    )
    loop: str = field(default="custom", metadata=flag("one of {choices}", choices=LOOPS))
    accumulate: int = field(
        default=1,
        metadata=flag(
            "split each rank's slice into K sequential parts (same update)", bound=at_least(1)
        ),
    )
    fp16_allreduce: bool = field(default=False, metadata=flag("Horovod fp16 compression"))
    bucket_mb: float | None = field(
        default=None,
        metadata=flag(
            "allreduce gradients in buckets of this many MiB as the backward makes them "
            "(default: one fused allreduce after the backward); with --shard-optimizer, the "
            "reduce-scatter's and allgather's chunks (default 4)",
            bound=positive,
        ),
    )
    shard_optimizer: bool = field(
        default=False,
        metadata=flag(
            "each data-parallel replica keeps the optimizer's slots (Adam's moments, momentum) "
            "for 1/N of the weights: gradients reduce-scattered, updated weights all-gathered "
            "(ZeRO stage 1; --strategy data --loop custom)"
        ),
    )
    scale_lr: bool = field(default=False, metadata=flag("multiply --lr by the replica count"))
    warmup_epochs: float = field(
        default=0.0,
        metadata=flag(
            "linear LR warm-up over W epochs, as Horovod's: from the target LR (--lr, or the "
            "scaled LR with --scale-lr) divided by the replica count, up to that target",
            bound=not_negative,
        ),
    )
    clip_norm: float | None = field(
        default=None, metadata=flag("clip by the global gradient norm", bound=positive)
    )
    schedule: str = field(
        default="1f1b",
        metadata=flag(
            "one of {choices}, or FILE.json as `ringtrain schedule --json` prints it",
            choices=SCHEDULE_KINDS,
            or_file=SCHEDULE_FILE,
        ),
    )
    virtual_stages: int = field(
        default=1,
        metadata=flag(
            "stages per pipeline rank (--schedule interleaved); the model splits into P*V",
            bound=at_least(1),
        ),
    )
    recompute: bool = field(
        default=False,
        metadata=flag(
            "pipelines: keep only each microbatch's input and redo its forward inside the "
            "backward, for less memory at the cost of a forward more (default: keep its "
            "activations)"
        ),
    )
    memory_per_rank: int | None = field(
        default=None,
        metadata=flag(
            "bytes a rank may hold, e.g. 2G (K, M, G, T: powers of 1024; default: its share of "
            "its node's memory cgroup or Slurm limit); train refuses a run predicted to need "
            "more before it starts",
            bound=at_least(1),
            parse=byte_size("a rank's memory"),
            metavar="SIZE",
        ),
    )
    ignore_memory_check: bool = field(
        default=False,
        metadata=flag("run even where the predicted memory per rank is over the limit"),
    )
    microbatches: int = field(
        default=1,
        metadata=flag(
            f"microbatches per replica batch (pipeline default {PIPELINE_MICROBATCHES}, or a "
            "schedule file's)",
            bound=at_least(1),
        ),
    )
    partition: str | None = field(
        default=None,
        metadata=flag(
            "one of {choices} (default: time where the model has more elements than stages, else "
            "uniform; a resumed run keeps its checkpoint's)",
            choices=PARTITIONS,
        ),
    )
    split_at: str | None = field(
        default=None,
        metadata=flag(
            "LAYER,...: each of the P-1 named layers of the model's graph begins a new stage "
            "(instead of --partition; a built-in's layers are layer00, layer01, ...)",
            metavar="LAYER,...",
        ),
    )
    pp_size: int | None = field(default=None, metadata=flag("stages per pipeline (hybrid)"))
    comm_timeout: float = field(
        default=120.0,
        metadata=flag("seconds a stage may stay silent before the job is aborted", bound=positive),
    )
    startup_timeout: float = field(
        default=600.0,
        metadata=flag(
            "seconds start-up and the first step (graph tracing) may take; only a peer whose "
            "connection is torn down ends the job sooner, after --comm-timeout",
            bound=positive,
        ),
    )
    min_link_rate: float = field(
        default=DEFAULT_MIN_LINK_RATE,
        metadata=flag(
            "MB/s: a wait for B bytes lasts up to --comm-timeout + B at this rate", bound=positive
        ),
    )
    sync_sends: bool = field(
        default=False,
        metadata=flag("synchronous sends (Ssend): proves the schedule needs no MPI buffering"),
    )
    mpi_progress: str = field(
        default="auto",
        metadata=flag(
            "one of {choices}: a thread that keeps a stage's transfers moving while it computes "
            "(auto: when the pipeline spans hosts)",
            choices=MPI_PROGRESS,
        ),
    )
    checkpoint_dir: str | None = field(
        default=None,
        metadata=flag("write checkpoints here (atomic, with a manifest)", path=check_folder),
    )
    checkpoint_every: int = field(
        default=0,
        metadata=flag(
            "steps between checkpoints (default: only at a stop and at the end)", bound=not_negative
        ),
    )
    keep: int = field(default=3, metadata=flag("complete checkpoints kept", bound=at_least(1)))
    resume: bool = field(
        default=False,
        metadata=flag("continue from the newest complete checkpoint (none: start afresh)"),
    )
    stop_after: int | None = field(
        default=None,
        metadata=flag(
            "checkpoint and stop after step N (exit 75), --steps unchanged", bound=at_least(1)
        ),
    )
    synthetic_size: int = field(default=2048, metadata=flag(bound=at_least(1)))
    synthetic_shape: tuple[int, ...] = field(
        default=(8, 8, 1), metadata=flag(f"e.g. {SHAPE_EXAMPLE}", bound=_dimensions)
    )
    metrics_out: str | None = field(
        default=None, metadata=flag("rank 0 writes metrics JSON here", path=check_writable)
    )
    weights_out: str | None = field(
        default=None,
        metadata=flag("rank 0 writes every trainable weight (.npz) here", path=check_writable),
    )
    initial_weights_out: str | None = field(
        default=None,
        metadata=flag(
            "rank 0 writes the trainable weights every rank starts from (.npz, as "
            "--weights-out; on --resume, the restored ones) here, to reproduce or audit the run "
            "from its starting point",
            path=check_writable,
        ),
    )
    save: str | None = field(
        default=None,
        metadata=flag(
            "rank 0 saves the trained model here in Keras's format (PATH.keras)",
            path=check_keras_file,
        ),
    )
    trace: str | None = field(
        default=None, metadata=flag("Chrome-trace JSON of the pipeline run", path=check_writable)
    )
    gantt: str | None = field(
        default=None, metadata=flag("Gantt chart PNG of the measured pipeline run", path=check_png)
    )
    progress: str = field(
        default="auto",
        metadata=flag(
            "one of {choices}: per-epoch progress on rank 0 (auto: a live bar on a terminal, lines "
            "under a launcher or into a file)",
            choices=PROGRESS,
        ),
    )
    tensorboard: str | None = field(
        default=None,
        metadata=flag(
            "rank 0 writes TensorBoard scalars here (view: tensorboard --logdir DIR)",
            path=check_folder,
            metavar="DIR",
        ),
    )

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Option:
    """One field as the command line sees it."""

    name: str  # the field's
    option: str  # --the-flag
    kind: type  # bool, int, float, str or tuple: what the command line's text becomes
    default: Any
    flag: Flag


def options() -> Iterator[Option]:
    """TrainConfig's fields in order, each with its flag."""
    hints = get_type_hints(TrainConfig)
    for f in fields(TrainConfig):
        hint = hints[f.name]
        if isinstance(hint, UnionType):  # X | None: a flag that may be absent
            (hint,) = (h for h in get_args(hint) if h is not NoneType)
        kind = get_origin(hint) or hint
        yield Option(f.name, "--" + f.name.replace("_", "-"), kind, f.default, f.metadata["flag"])


def _whole_number(text: str) -> int:
    """Any integer: ranges are checked with the other values, so every rank says the same line."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_whole_number(text: str) -> int:
    """An argparse type: a count of something (ranks, examples, shards)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"want a whole number >= 1, got {text!r}")
    return int(text)


TEXT_TO = {int: _whole_number, float: float}  # str stays text; a shape is read by config


def add_train_arguments(p: argparse.ArgumentParser, names: Collection[str] | None = None) -> None:
    """An option per TrainConfig field (or per field in `names`, for a command such as `plan`
    that takes a few of train's flags), from its declaration. argparse only turns text into
    numbers: choices and bounds are checked with the configuration, so every bad value gets
    the same kind of one-line message, said once for the whole job."""
    groups = {}
    for o in options():
        if names is not None and o.name not in names:
            continue
        if o.flag.group and o.flag.group not in groups:
            groups[o.flag.group] = p.add_mutually_exclusive_group()
        into = groups[o.flag.group] if o.flag.group else p
        if o.kind is bool:  # on by default: --x and --no-x, as Keras's own shuffle=True
            action = argparse.BooleanOptionalAction if o.default else "store_true"
            into.add_argument(o.option, action=action, default=o.default, help=o.flag.describe())
            continue
        into.add_argument(
            o.option,
            type=o.flag.parse or TEXT_TO.get(o.kind),
            default=_default_on_command_line(o),
            help=o.flag.describe(),
            metavar=o.flag.metavar,
        )


def _default_on_command_line(o: Option):
    """A shape as text; no --microbatches, which follows the strategy (see _microbatches)."""
    if o.name == "microbatches":
        return None
    return shape_text(o.default) if o.kind is tuple else o.default


def shape_from_text(option: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError:
        raise UserError(f"{option} {text!r} is not like {SHAPE_EXAMPLE}") from None


def is_schedule_file(schedule: str) -> bool:
    """`--schedule` names a file of the format `ringtrain schedule --json` prints."""
    return schedule.endswith(SCHEDULE_FILE)


def check_values(cfg: TrainConfig) -> None:
    """Each value alone: a choice it must be, a finite number (an infinite --lr trains to NaN),
    a bound it must meet. Absent values (None) pass."""
    given = [(o, value) for o in options() if (value := getattr(cfg, o.name)) is not None]
    for o, value in given:
        allowed, or_file = o.flag.choices, o.flag.or_file
        if allowed and value not in allowed and not (or_file and _file_form(or_file, value)):
            shown = "PATH.py:FUNCTION" if or_file == MODEL_FUNCTION else f"FILE{or_file}"
            listed = (*allowed, shown) if or_file else allowed
            raise UserError(f"unknown {o.option[2:]} {value!r}; choose one of {', '.join(listed)}")
    for o, value in given:
        if o.kind is float and not math.isfinite(value):
            raise UserError(f"{o.option} must be a finite number, got {value}")
    for o, value in given:
        if o.flag.bound and (wrong := o.flag.bound(value)):
            raise UserError(f"{o.option} {wrong}")


def _file_form(form: str, value: str) -> bool:
    """`--schedule FILE.json` ends with its suffix; `--model PATH.py:FUNCTION` holds a colon."""
    return form in value if form == MODEL_FUNCTION else value.endswith(form)


def is_model_function(model: str) -> bool:
    """`--model` names a user's function rather than a built-in model."""
    return _file_form(MODEL_FUNCTION, model)


def check_paths(cfg: TrainConfig) -> None:
    """The output files and folders can be written. Unlike the flags, this asks each node's
    filesystem, so the CLI has the ranks agree on the answer."""
    for o in options():
        if o.flag.path:
            o.flag.path(o.option, getattr(cfg, o.name))


def uses_horovod(cfg: TrainConfig) -> bool:
    """Whether the run averages gradients with Horovod (so starts it)."""
    return cfg.strategy in ("data", "hybrid")


def runs_stages(cfg: TrainConfig) -> bool:
    """Whether the run cuts the model into pipeline stages (on one rank too: all of them)."""
    return cfg.strategy in ("model", "pipeline") or (cfg.strategy == "hybrid" and cfg.pp_size != 1)


def gathers_whole_model(cfg: TrainConfig, outputs_ask: bool, built_whole: bool) -> bool:
    """Whether rank 0 copies the whole model's weights out at the end. Single and data train
    the model itself, so only --weights-out needs the copy; a pipeline's stages come to rank 0
    where an output or callback needs the model whole (`outputs_ask`), and always into a
    model the caller built whole (it ends up trained)."""
    if runs_stages(cfg):
        return built_whole or outputs_ask
    return bool(cfg.weights_out)


def pp_size_of(cfg: TrainConfig, world_size: int) -> int:
    """The ranks of one pipeline (P) under this strategy: 1 where there is no pipeline."""
    if cfg.strategy in ("model", "pipeline"):
        return world_size
    if cfg.strategy == "hybrid":
        return cfg.pp_size or 1
    return 1


def partition_method(cfg: TrainConfig, elements: int, n_stages: int) -> str:
    """`--partition`, or by default `time` where there is a choice and `uniform` where not."""
    if cfg.partition is not None:
        return cfg.partition
    return "time" if elements > n_stages else "uniform"
