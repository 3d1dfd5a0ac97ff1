"""`ringtrain train` from its flags: read, checked before TensorFlow loads, then trained. The
CLI and a sweep's trials both run it."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from typing import Any

from ringtrain.config import (
    CLI_EPOCHS,
    PIPELINE_MICROBATCHES,
    TrainConfig,
    add_train_arguments,
    check_paths,
    is_model_function,
    is_schedule_file,
    options,
    runs_stages,
    shape_from_text,
    uses_horovod,
)
from ringtrain.errors import EXIT_CHECKPOINTED, EXIT_PROBLEMS, UserError, alike_on_every_rank
from ringtrain.keras_model.source import (
    add_file_arguments,
    add_source_arguments,
    build_user_model,
    check_file_flags,
    check_source_flags,
    load_user_data,
)
from ringtrain.memory_kill import supervise_rank
from ringtrain.one_line import checked_who_am_i

USER_MODEL_REFUSES = ("optimizer", "lr", "clip_norm", "loop")


def add_train_command_arguments(p: argparse.ArgumentParser) -> None:
    """train's flags, and the ones that name a user's own model and data."""
    add_train_arguments(p)
    # Absent unless typed, so a compiled model can refuse them even at their default value.
    p.set_defaults(**dict.fromkeys(USER_MODEL_REFUSES))
    add_source_arguments(p)
    add_file_arguments(p)


def typed_flags(args: argparse.Namespace) -> set[str]:
    """The refusable flags given on the command line (the others default on the parser)."""
    return {name for name in USER_MODEL_REFUSES if getattr(args, name) is not None}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {}
    for o in options():
        given = getattr(args, o.name)
        if given is None and o.name in USER_MODEL_REFUSES:
            given = o.default
        values[o.name] = shape_from_text(o.option, given) if o.kind is tuple else given
    if values["epochs"] is None and values["steps"] is None:
        values["epochs"] = CLI_EPOCHS
    if values["microbatches"] is None:
        values["microbatches"] = _microbatches(values["strategy"], values["schedule"])
    return TrainConfig(**values)


def _microbatches(strategy: str, schedule: str) -> int:
    """A schedule file's own count (it fixes M); else the pipeline default; else one."""
    if strategy not in ("pipeline", "hybrid"):
        return TrainConfig.microbatches
    if is_schedule_file(schedule):
        from ringtrain.pipeline.schedule import load_schedule_file

        return load_schedule_file(schedule).microbatches
    return PIPELINE_MICROBATCHES


def run_train(args: argparse.Namespace) -> int:
    supervise_rank(checked_who_am_i().rank, "ringtrain train")  # before MPI and TensorFlow
    cfg, result = train_from_args(args)
    return _finished(cfg, result)


def train_from_args(args: argparse.Namespace, callbacks: Sequence = ()) -> tuple[TrainConfig, Any]:
    """`train`'s parsed flags, trained: (the configuration, api.TrainResult). Every check that
    needs no model runs before TensorFlow loads (5 s of CPU per rank). `callbacks`: Keras
    callbacks, run on rank 0 at epoch ends (a sweep's pruning)."""
    from ringtrain.validation import validate_flags

    me = checked_who_am_i()
    with alike_on_every_rank(me.rank):  # flags first: the same verdict on every rank
        cfg = config_from_args(args)
        validate_flags(cfg, me.world_size, typed_flags(args))
        _check_user_flags(args, cfg)
    if me.source == "single" and shutil.which("mpirun") is None:
        # Without a launcher Open MPI starts a singleton, which still needs its runtime.
        raise UserError(
            "MPI not found: mpirun is not on PATH; install openmpi-bin or load your "
            "site's MPI module"
        )
    # Start-up: ranks reach this agreement as fast as ssh, Python and the libraries load them,
    # seconds apart on a loaded node, so it is bounded like the rest of start-up.
    wait_for = max(cfg.comm_timeout, cfg.startup_timeout)
    if is_model_function(cfg.model):
        return cfg, _train_user_model(args, cfg, me, wait_for, callbacks)
    data = agreed(lambda: _outputs_and_data(cfg), me, wait_for)
    from ringtrain import runtime
    from ringtrain.api import train  # TensorFlow loads here, once the inputs are known good
    from ringtrain.models import builtin

    runtime.init(uses_horovod(cfg))  # before the first TensorFlow op: pools are set once
    with alike_on_every_rank(me.rank):
        model = builtin(cfg, data.input_shape, data.n_classes, _weightless(cfg, me))
    return cfg, train(model, data, cfg, callbacks=callbacks)


def _check_user_flags(args: argparse.Namespace, cfg: TrainConfig) -> None:
    check_source_flags(cfg.model, args.model_arg, args.data, cfg.dataset)
    check_file_flags(args, cfg.dataset)


def _train_user_model(
    args: argparse.Namespace, cfg: TrainConfig, me, wait_for: float, callbacks: Sequence
):
    """Load the user's data on every rank (agreed), then build their model after seeding."""
    from ringtrain import runtime

    if args.data or args.validation_data:  # a user's function may run TensorFlow ops first
        runtime.init(uses_horovod(cfg))
    data = agreed(
        lambda: load_user_data(
            args.data, cfg, args.data_files, args.validation_files, args.validation_data
        ),
        me,
        wait_for,
    )
    from ringtrain.api import train

    runtime.init(uses_horovod(cfg))  # before the user's model runs a TensorFlow op
    with alike_on_every_rank(me.rank):  # the same files on every node: the same verdict
        model = build_user_model(cfg.model, args.model_arg, cfg.seed, _weightless(cfg, me))
    return train(model, data, cfg, typed_flags(args), callbacks)


def _weightless(cfg: TrainConfig, me) -> bool:
    """Whether the model is built without its weights' values: on a pipeline rank (it makes
    its own stages' only), and wherever a memory limit is checked, so that a model whose
    weights alone would not fit is refused before they are made (`api.train` makes them once
    the check has passed)."""
    from ringtrain.memory_limit import rank_limit

    if runs_stages(cfg):
        return True
    limit = rank_limit(cfg.memory_per_rank, me.local_size)
    return limit is not None and not cfg.ignore_memory_check


def _finished(cfg: TrainConfig, result) -> int:
    if result.metrics.get("finished", True):
        return 0
    # Not finished: 75 means "checkpointed, resume me"; without a checkpoint it is a failure.
    return EXIT_CHECKPOINTED if cfg.checkpoint_dir else EXIT_PROBLEMS


def _outputs_and_data(cfg: TrainConfig):
    """The output paths, the dataset and the checkpoint to resume: what only each node's files
    can tell."""
    from ringtrain.checkpoint import check_resumable
    from ringtrain.data import load_dataset, step_plan

    check_paths(cfg)
    data = load_dataset(cfg.dataset, cfg.seed, cfg.synthetic_size, cfg.synthetic_shape)
    step_plan(len(data.x), cfg.batch_size, cfg.epochs, cfg.steps)
    if cfg.resume:
        check_resumable(cfg)
    return data


def agreed(attempt, me, timeout: float):
    """What only files can tell (an output folder, a dataset missing or bad on some node) is
    agreed on by every rank before training, so the job stops whole and says it once."""
    if me.world_size == 1:
        return attempt()
    from ringtrain import runtime
    from ringtrain.comm import Link
    from ringtrain.guard import agree

    comm = runtime.communicator(me.local_size)
    return agree(comm, Link(comm, timeout).wait, attempt)
