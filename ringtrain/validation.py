"""The checks of a whole training configuration: its flags together, and the pipeline they make.

Each value alone is checked from its declaration (config.check_values); the rules here tie
flags to each other, to the world size and to the schedule, which the pure schedule core builds
in milliseconds. All of it depends only on the flags and the world size, so every rank reaches
the same verdict before the first collective and no rank is left waiting for another.
"""

from __future__ import annotations

from collections.abc import Collection

from ringtrain.config import (
    TrainConfig,
    check_paths,
    check_values,
    is_model_function,
    pp_size_of,
    runs_stages,
)
from ringtrain.errors import UserError
from ringtrain.pipeline.schedule import pipeline_schedule
from ringtrain.pipeline.tags import MPI_TAG_LIMIT, message_tag


def validate(cfg: TrainConfig, world_size: int, given: Collection[str] = ()) -> None:
    """Raise UserError for the first problem in the flags or the output paths."""
    validate_flags(cfg, world_size, given)
    check_paths(cfg)


COMPILED_ELSEWHERE = {  # flags that compile a built-in; a user's model says these in compile()
    "optimizer": "the compiled optimizer",
    "lr": "the compiled learning rate",
    "clip_norm": "the compiled optimizer's clipnorm, clipvalue or global_clipnorm",
}


def validate_flags(cfg: TrainConfig, world_size: int, given: Collection[str] = ()) -> None:
    """Pure: the same flags give the same answer on every rank, before any collective.
    `given` names the flags set on the command line (the Python API passes what its caller
    set): a user's compiled model refuses those that would compile it again."""
    check_values(cfg)
    if cfg.epochs is not None and cfg.steps is not None:
        raise UserError("give either --epochs or --steps, not both")
    if cfg.split_at and not runs_stages(cfg):
        raise UserError(f"--split-at cuts pipeline stages, not --strategy {cfg.strategy}")
    _validate_strategy_shape(cfg, world_size)
    pp_size = pp_size_of(cfg, world_size)
    _validate_pipeline(cfg, pp_size)
    _validate_fit_loop(cfg)
    _validate_bucketing(cfg)
    _validate_sharding(cfg)
    if cfg.accumulate > 1 and cfg.strategy not in ("single", "data"):
        raise UserError(
            "--accumulate slices a data-parallel share (--strategy single or data); "
            "a pipeline has --microbatches"
        )
    shares = world_size // pp_size * (cfg.microbatches if runs_stages(cfg) else cfg.accumulate)
    if cfg.batch_size < shares:
        raise UserError(
            f"global batch {cfg.batch_size} is smaller than the {shares} shares it is cut into"
        )
    _validate_checkpointing(cfg)
    if cfg.shard_policy == "off" and cfg.strategy != "data":
        raise UserError("--shard-policy off goes with --strategy data: a rank, a replica")
    if not is_model_function(cfg.model):
        return
    for name, instead in COMPILED_ELSEWHERE.items():
        if name in given:
            flag = "--" + name.replace("_", "-")
            raise UserError(
                f"{flag} does not apply to a compiled model; set {instead} in compile() instead"
            )


def _validate_fit_loop(cfg: TrainConfig) -> None:
    """model.fit (--loop fit) keeps its own loop: data parallelism, one update per batch, and
    none of the custom loop's checkpoints or TensorBoard scalars."""
    if cfg.loop != "fit":
        return
    if cfg.strategy not in ("single", "data"):
        raise UserError(f"--loop fit drives data parallelism only, not --strategy {cfg.strategy}")
    if cfg.accumulate > 1:
        raise UserError("--accumulate needs --loop custom (model.fit steps once per batch)")
    for flag, given in (
        ("--tensorboard", cfg.tensorboard),
        ("--checkpoint-dir", cfg.checkpoint_dir),
    ):
        if given:
            raise UserError(f"{flag} needs --loop custom (model.fit keeps its own loop)")


def _validate_bucketing(cfg: TrainConfig) -> None:
    """Buckets split the allreduce of ringtrain's own data-parallel step, a compiled model's
    too, and the chunks of a sharded optimizer's collectives (hybrid's too); model.fit (--loop
    fit) and a pipeline's own averaging have no such step."""
    sharded_hybrid = cfg.shard_optimizer and cfg.strategy == "hybrid"
    plain = cfg.strategy == "data" or sharded_hybrid
    if cfg.bucket_mb is not None and (not plain or cfg.loop != "custom"):
        raise UserError(
            "--bucket-mb buckets the allreduce of --strategy data --loop custom (and the "
            "chunks of --shard-optimizer in hybrid)"
        )


def _validate_sharding(cfg: TrainConfig) -> None:
    """--shard-optimizer divides ringtrain's own step's optimizer among the replicas (of the
    whole model, or of each stage in hybrid): model.fit's optimizer holds every slot."""
    if not cfg.shard_optimizer:
        return
    if cfg.loop != "custom":
        raise UserError(
            "--shard-optimizer needs --loop custom (model.fit's optimizer holds every slot)"
        )


def _validate_strategy_shape(cfg: TrainConfig, world_size: int) -> None:
    """The strategy fits the ranks launched."""
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


def _validate_pipeline(cfg: TrainConfig, pp_size: int) -> None:
    """The schedule fits the pipeline: its kind, virtual stages, microbatches, a file's ranks
    and the MPI tags its messages need. Whether the model has that many stages to cut is the
    graph's question, asked once it is built."""
    if not runs_stages(cfg):
        plain = cfg.strategy == "hybrid"  # --pp-size 1: data parallelism, no stages
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
    if cfg.schedule == "interleaved" and cfg.microbatches % pp_size:
        raise UserError(
            f"--schedule interleaved needs --microbatches ({cfg.microbatches}) to be a "
            f"multiple of the {pp_size} pipeline ranks"
        )
    schedule = pipeline_schedule(cfg, pp_size)
    if schedule.pp_size != pp_size:
        raise UserError(
            f"--schedule {cfg.schedule} is for {schedule.pp_size} pipeline ranks, "
            f"but this run has {pp_size}"
        )
    if schedule.microbatches != cfg.microbatches:
        raise UserError(
            f"--schedule {cfg.schedule} has {schedule.microbatches} microbatches, "
            f"but --microbatches is {cfg.microbatches}"
        )
    if message_tag(schedule.n_stages, cfg.microbatches, schedule.n_stages) > MPI_TAG_LIMIT:
        raise UserError(
            f"{schedule.n_stages} stages x {cfg.microbatches} microbatches need MPI tags above "
            f"{MPI_TAG_LIMIT}; use fewer microbatches"
        )


def _validate_checkpointing(cfg: TrainConfig) -> None:
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
