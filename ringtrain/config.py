"""The training configuration and its validation.

Validation is pure and depends only on the flags and the world size, so every rank reaches the
same verdict before the first collective and no rank is left waiting for another.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, dataclass, field

from ringtrain.errors import UserError

STRATEGIES = ("single", "data", "model", "pipeline", "hybrid")
MODELS = ("mlp", "cnn", "transformer")
OPTIMIZERS = ("sgd", "adam")
LOOPS = ("custom", "fit")
SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1")
PARTITIONS = ("uniform", "params", "time")
PROGRESS = ("auto", "bar", "lines", "none")
MPI_PROGRESS = ("auto", "thread", "off")
MAX_SEED = 2**32 - 1  # what every seeded generator on the way accepts
MPI_TAG_LIMIT = 32767  # the largest tag every MPI must accept (MPI_TAG_UB may be larger)


@dataclass
class TrainConfig:
    """Everything that decides what a run computes; identical on every rank."""

    strategy: str = "data"
    model: str = "mlp"
    dataset: str = "digits"
    batch_size: int = 64
    epochs: int | None = None
    steps: int | None = None
    optimizer: str = "adam"
    lr: float = 0.003
    seed: int = 0
    loop: str = "custom"
    accumulate: int = 1
    fp16_allreduce: bool = False
    bucket_mb: float | None = None  # None: one fused allreduce after the whole backward
    scale_lr: bool = False
    warmup_epochs: float = 0.0
    clip_norm: float | None = None
    schedule: str = "1f1b"  # a kind of SCHEDULE_KINDS or the path of a schedule file (*.json)
    microbatches: int = 1
    virtual_stages: int = 1  # stages per pipeline rank (interleaved)
    recompute: bool = False  # redo each forward in its backward instead of keeping its tape
    partition: str | None = None  # None: time where elements outnumber stages, else uniform
    pp_size: int | None = None
    comm_timeout: float = 120.0
    startup_timeout: float = 600.0  # living peers may take this long to trace the first step
    min_link_rate: float = 1.0  # MB/s a transfer may not fall below (comm.allowance)
    sync_sends: bool = False
    mpi_progress: str = "auto"  # auto: a progress thread when a pipeline spans hosts
    metrics_out: str | None = None
    weights_out: str | None = None
    trace: str | None = None
    gantt: str | None = None
    synthetic_size: int = 2048
    synthetic_shape: tuple[int, ...] = field(default=(8, 8, 1))
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps; 0 saves only when stopping and at the end
    keep: int = 3
    resume: bool = False
    stop_after: int | None = None
    progress: str = "auto"  # auto: a live bar on a terminal, lines under a launcher
    tensorboard: str | None = None  # rank 0 writes TensorBoard scalars into this folder

    def as_dict(self) -> dict:
        return asdict(self)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")


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


def pipeline_stages(cfg: TrainConfig, world_size: int) -> int:
    """How many stages one model replica has under this strategy."""
    if cfg.strategy in ("model", "pipeline"):
        return world_size
    if cfg.strategy == "hybrid":
        return cfg.pp_size or 1
    return 1


def is_schedule_file(schedule: str) -> bool:
    """`--schedule` names a file of the format `ringtrain schedule --json` prints."""
    return schedule.endswith(".json")


def pipeline_schedule(cfg: TrainConfig, ranks: int):
    """The schedule every pipeline of this run follows: generated, or the user's file checked.

    Raises UserError; a file is read like a flag's value, every rank reading the same file.
    """
    from ringtrain.pipeline.schedule import build_schedule, load_schedule_file

    if is_schedule_file(cfg.schedule):
        return load_schedule_file(cfg.schedule)
    try:
        return build_schedule(cfg.schedule, ranks, cfg.microbatches, cfg.virtual_stages)
    except ValueError as err:
        raise UserError(f"--schedule {cfg.schedule}: {err}") from None


def partition_method(cfg: TrainConfig, elements: int, stages: int) -> str:
    """`--partition`, or by default `time` where there is a choice and `uniform` where not."""
    if cfg.partition is not None:
        return cfg.partition
    return "time" if elements > stages else "uniform"


def validate(cfg: TrainConfig, world_size: int, n_elements: int | None = None) -> None:
    """Raise UserError for the first problem in the flags or the output paths."""
    validate_flags(cfg, world_size, n_elements)
    check_paths(cfg)


def validate_flags(cfg: TrainConfig, world_size: int, n_elements: int | None = None) -> None:
    """Pure: the same flags give the same answer on every rank, before any collective."""
    _choice("strategy", cfg.strategy, STRATEGIES)
    _choice("model", cfg.model, MODELS)
    _choice("optimizer", cfg.optimizer, OPTIMIZERS)
    _choice("loop", cfg.loop, LOOPS)
    if not is_schedule_file(cfg.schedule):
        _choice("schedule", cfg.schedule, (*SCHEDULE_KINDS, "FILE.json"))
    if cfg.partition is not None:
        _choice("partition", cfg.partition, PARTITIONS)
    _choice("progress", cfg.progress, PROGRESS)
    _choice("mpi-progress", cfg.mpi_progress, MPI_PROGRESS)
    _check_numbers(cfg)
    if cfg.epochs is not None and cfg.steps is not None:
        raise UserError("give either --epochs or --steps, not both")
    if cfg.steps is not None and cfg.steps < 1:
        raise UserError(f"--steps must be at least 1, got {cfg.steps}")
    if cfg.epochs is not None and cfg.epochs < 1:
        raise UserError(f"--epochs must be at least 1, got {cfg.epochs}")
    if not cfg.lr > 0:
        raise UserError(f"--lr must be positive, got {cfg.lr}")
    if cfg.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {cfg.batch_size}")
    if cfg.accumulate < 1:
        raise UserError(f"--accumulate must be at least 1, got {cfg.accumulate}")
    if cfg.microbatches < 1:
        raise UserError(f"--microbatches must be at least 1, got {cfg.microbatches}")
    if cfg.warmup_epochs < 0:
        raise UserError(f"--warmup-epochs must not be negative, got {cfg.warmup_epochs}")
    if cfg.clip_norm is not None and not cfg.clip_norm > 0:
        raise UserError(f"--clip-norm must be positive, got {cfg.clip_norm}")
    if not cfg.comm_timeout > 0:
        raise UserError(f"--comm-timeout must be positive, got {cfg.comm_timeout}")
    if not cfg.startup_timeout > 0:
        raise UserError(f"--startup-timeout must be positive, got {cfg.startup_timeout}")
    if not cfg.min_link_rate > 0:
        raise UserError(f"--min-link-rate must be positive, got {cfg.min_link_rate}")
    if cfg.loop == "fit" and cfg.strategy not in ("single", "data"):
        raise UserError(f"--loop fit drives data parallelism only, not --strategy {cfg.strategy}")
    if cfg.loop == "fit" and cfg.accumulate > 1:
        raise UserError("--accumulate needs --loop custom (model.fit steps once per batch)")
    if cfg.bucket_mb is not None:
        if not cfg.bucket_mb > 0:
            raise UserError(f"--bucket-mb must be positive, got {cfg.bucket_mb}")
        if cfg.strategy != "data" or cfg.loop != "custom":
            raise UserError("--bucket-mb buckets the allreduce of --strategy data --loop custom")
    if cfg.strategy == "single" and world_size > 1:
        raise UserError(f"--strategy single runs on one rank, but {world_size} were launched")
    if cfg.strategy == "hybrid":
        if cfg.pp_size is None or cfg.pp_size < 1:
            raise UserError(
                "--strategy hybrid needs --pp-size P (stages per pipeline) of 1 or more"
            )
        if world_size % cfg.pp_size:
            raise UserError(f"world size {world_size} is not divisible by --pp-size {cfg.pp_size}")
    if cfg.strategy == "model" and cfg.microbatches != 1:
        raise UserError("--strategy model is the naive split with one microbatch; use pipeline")
    stages = pipeline_stages(cfg, world_size)
    replicas = world_size // stages
    _validate_pipeline(cfg, stages, n_elements)
    per_replica, rest = divmod(cfg.batch_size, replicas)
    if rest:
        raise UserError(
            f"global batch {cfg.batch_size} is not divisible by {replicas} data-parallel ranks"
        )
    if per_replica % cfg.microbatches:
        raise UserError(
            f"batch {per_replica} per replica is not divisible by --microbatches {cfg.microbatches}"
        )
    if stages == 1 and per_replica % cfg.accumulate:
        raise UserError(
            f"batch {per_replica} per rank is not divisible by --accumulate {cfg.accumulate}"
        )
    _validate_checkpointing(cfg)
    if cfg.tensorboard and cfg.loop == "fit":
        raise UserError("--tensorboard needs --loop custom (model.fit keeps its own loop)")


def _validate_pipeline(cfg: TrainConfig, ranks: int, n_elements: int | None) -> None:
    """The schedule fits the pipeline: its kind, virtual stages, microbatches, a file's ranks,
    the model's elements and the MPI tags its messages need."""
    if cfg.virtual_stages < 1:
        raise UserError(f"--virtual-stages must be at least 1, got {cfg.virtual_stages}")
    plain = cfg.strategy == "hybrid" and cfg.pp_size == 1  # data parallelism: no stages
    if cfg.strategy not in ("model", "pipeline", "hybrid") or plain:
        strategy = "hybrid --pp-size 1" if plain else cfg.strategy
        for flag, given in (
            ("--recompute", cfg.recompute),
            ("--virtual-stages", cfg.virtual_stages > 1),
        ):
            if given:
                raise UserError(f"{flag} is for pipeline stages, not --strategy {strategy}")
        return
    if cfg.virtual_stages > 1 and cfg.schedule != "interleaved":
        raise UserError(
            f"--virtual-stages {cfg.virtual_stages} needs --schedule interleaved, "
            f"not {cfg.schedule}"
        )
    if cfg.schedule == "interleaved" and cfg.microbatches % ranks:
        raise UserError(
            f"--schedule interleaved needs --microbatches ({cfg.microbatches}) to be a "
            f"multiple of the {ranks} pipeline ranks"
        )
    schedule = pipeline_schedule(cfg, ranks)
    if schedule.ranks != ranks:
        raise UserError(
            f"--schedule {cfg.schedule} is for {schedule.ranks} pipeline ranks, "
            f"but this run has {ranks}"
        )
    if schedule.microbatches != cfg.microbatches:
        raise UserError(
            f"--schedule {cfg.schedule} has {schedule.microbatches} microbatches, "
            f"but --microbatches is {cfg.microbatches}"
        )
    if n_elements is not None and schedule.stages > n_elements:
        raise UserError(
            f"{schedule.stages} pipeline stages but model {cfg.model!r} has only "
            f"{n_elements} layers"
        )
    if message_tag(schedule.stages, cfg.microbatches, schedule.stages) > MPI_TAG_LIMIT:
        raise UserError(
            f"{schedule.stages} stages x {cfg.microbatches} microbatches need MPI tags above "
            f"{MPI_TAG_LIMIT}; use fewer microbatches"
        )


def message_tag(stage: int, microbatches: int, mb: int, kind: int = 0) -> int:
    """The MPI tag of stage `stage`'s message of microbatch `mb`: kind 0 an activation, 1 a
    gradient; `message_tag(stages, M, s)` is stage s's evaluation activations."""
    return 2 * (stage * microbatches + mb) + kind


def check_paths(cfg: TrainConfig) -> None:
    """The output files and folders can be written. Unlike the flags, this asks each node's
    filesystem, so the CLI has the ranks agree on the answer."""
    check_folder("--checkpoint-dir", cfg.checkpoint_dir)
    check_writable("--metrics-out", cfg.metrics_out)
    check_writable("--weights-out", cfg.weights_out)
    check_writable("--trace", cfg.trace)
    check_png("--gantt", cfg.gantt)
    check_folder("--tensorboard", cfg.tensorboard)


def _check_numbers(cfg: TrainConfig) -> None:
    """Every float flag is finite (an infinite --lr trains to NaN), the seed fits 32 bits."""
    floats = {
        "--lr": cfg.lr,
        "--warmup-epochs": cfg.warmup_epochs,
        "--clip-norm": cfg.clip_norm,
        "--comm-timeout": cfg.comm_timeout,
        "--startup-timeout": cfg.startup_timeout,
        "--min-link-rate": cfg.min_link_rate,
    }
    for flag, value in floats.items():
        if value is not None and not math.isfinite(value):
            raise UserError(f"{flag} must be a finite number, got {value}")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise UserError(f"--seed must be a whole number from 0 to {MAX_SEED}, got {cfg.seed}")
    if cfg.synthetic_size < 1:
        raise UserError(f"--synthetic-size must be at least 1, got {cfg.synthetic_size}")
    if not cfg.synthetic_shape or min(cfg.synthetic_shape) < 1:
        shape = ",".join(str(d) for d in cfg.synthetic_shape)
        raise UserError(f"--synthetic-shape {shape} needs dimensions of at least 1")


def _validate_checkpointing(cfg: TrainConfig) -> None:
    if cfg.checkpoint_every < 0:
        raise UserError(f"--checkpoint-every must not be negative, got {cfg.checkpoint_every}")
    if cfg.keep < 1:
        raise UserError(f"--keep must be at least 1, got {cfg.keep}")
    if cfg.stop_after is not None and cfg.stop_after < 1:
        raise UserError(f"--stop-after must be at least 1, got {cfg.stop_after}")
    needs_dir = [
        f
        for f, on in (
            ("--resume", cfg.resume),
            ("--stop-after", cfg.stop_after),
            ("--checkpoint-every", cfg.checkpoint_every),
        )
        if on
    ]
    if needs_dir and not cfg.checkpoint_dir:
        raise UserError(f"{needs_dir[0]} needs --checkpoint-dir DIR")
    if cfg.checkpoint_dir and cfg.loop == "fit":
        raise UserError("--checkpoint-dir needs --loop custom (model.fit keeps its own loop)")
