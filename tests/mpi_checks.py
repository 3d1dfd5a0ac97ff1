"""Runs inside every rank of one mpirun and checks every strategy that fits the world size, over
many configurations, against the independent reference (tests/reference.py, computed on rank 0).
Rank 0 prints one JSON line per check: the worst per-tensor update difference and the largest
per-step loss difference. Each run writes its initial weights (--initial-weights-out) to a
folder of rank 0's, and the reference starts from them.

    mpirun -np N python tests/mpi_checks.py [RESUME_DIR]

With RESUME_DIR it also stops and resumes runs there and reports whether resuming reproduced
the uninterrupted run exactly.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
from dataclasses import asdict, replace

import numpy as np
from reference import ReferenceRun, compare_with, train_reference, weights_digest
from reference import load_digits as reference_digits

from ringtrain import loop, runtime
from ringtrain.api import _fitted, engine_for
from ringtrain.config import TrainConfig, pp_size_of
from ringtrain.data import load_digits
from ringtrain.guard import Watchdog
from ringtrain.models import builtin
from ringtrain.pipeline.grid import Grid
from ringtrain.validation import validate
from ringtrain.weights import by_path

DATA = load_digits()
# The CLI's defaults (Adam, --lr 0.003) on a global batch that odd M and 2-5 ranks all divide.
BASE = TrainConfig(batch_size=60, steps=4, seed=3)
SGD_LR = 0.05  # --lr 0.003 barely moves SGD's weights: rounding of the weights would dominate
MODELS, OPTIMIZERS = ("mlp", "cnn", "transformer"), ("sgd", "adam")
REPORTED = (
    "strategy",
    "model",
    "optimizer",
    "lr",
    "batch_size",
    "schedule",
    "microbatches",
    "virtual_stages",
    "recompute",
    "pp_size",
    "accumulate",
    "fp16_allreduce",
    "bucket_mb",
    "clip_norm",
    "loop",
    "sync_sends",
    "mpi_progress",
    "partition",
    "shard_optimizer",
)


def case(strategy: str, model: str, optimizer: str, **changes) -> TrainConfig:
    cfg = replace(BASE, strategy=strategy, model=model, optimizer=optimizer, **changes)
    return replace(cfg, lr=SGD_LR) if optimizer == "sgd" and "lr" not in changes else cfg


def every_model_and_optimizer(strategy: str, **changes) -> list[TrainConfig]:
    return [case(strategy, m, o, **changes) for m in MODELS for o in OPTIMIZERS]


def zero_bubble(world_size: int) -> list[TrainConfig]:
    """ZB-H1 at M = 1, 3 and 8 (batch 64: 60 has no factor 8) on mlp and transformer, SGD and
    Adam over the world sizes, and one run twice: with and without --recompute. Two runs
    keep a progress thread calling MPI during compute (as across hosts)."""
    zb = functools.partial(case, "pipeline", schedule="zb-h1")
    runs = {
        2: [
            zb("mlp", "sgd", microbatches=1),
            zb("transformer", "adam", microbatches=3, mpi_progress="thread"),
            zb("mlp", "adam", microbatches=8, batch_size=64),
            zb("mlp", "adam", microbatches=8, batch_size=64, recompute=True),
        ],
        3: [
            zb("transformer", "sgd", microbatches=1),
            zb("mlp", "adam", microbatches=3),
            zb("transformer", "adam", microbatches=8, batch_size=64, recompute=True),
        ],
        4: [
            zb("mlp", "adam", microbatches=1),
            zb("transformer", "sgd", microbatches=3, recompute=True),
            zb("mlp", "sgd", microbatches=8, batch_size=64, mpi_progress="thread"),
        ],
    }
    return runs[world_size]


def interleaved(world_size: int) -> list[TrainConfig]:
    """P = 2 ranks of V = 2 stages at M = 2, 4, 6, on mlp and transformer, SGD and Adam, and
    one run with and without --recompute."""
    if world_size != 2:
        return []
    il = functools.partial(case, "pipeline", schedule="interleaved", virtual_stages=2)
    return [
        il("mlp", "sgd", microbatches=2),
        il("transformer", "adam", microbatches=4),
        il("transformer", "sgd", microbatches=6, sync_sends=True),
        il("mlp", "adam", microbatches=6),
        il("mlp", "adam", microbatches=6, recompute=True),
    ]


def grid(world_size: int) -> list[TrainConfig]:
    """The configurations this world size can run; across 1-4 ranks every strategy meets every
    model and optimizer, every schedule, odd M, P = 2, 3, 4 and the hybrid grids 2x2, 4x1, 1x4."""
    if world_size == 1:
        return every_model_and_optimizer("single")
    return pipeline_schedules(world_size) + zero_bubble(world_size) + interleaved(world_size)


def pipeline_schedules(world_size: int) -> list[TrainConfig]:
    """Every strategy with GPipe and 1F1B, at this world size."""
    pipe = functools.partial(case, "pipeline")
    hybrid = functools.partial(case, "hybrid")
    return {
        2: [
            *every_model_and_optimizer("data"),
            case("data", "mlp", "adam", accumulate=3),
            case("data", "cnn", "sgd", accumulate=2),
            case("data", "mlp", "sgd", fp16_allreduce=True),
            case("data", "transformer", "adam", fp16_allreduce=True),
            case("data", "mlp", "sgd", clip_norm=0.1),
            case("data", "cnn", "adam", bucket_mb=0.001),  # a bucket per tensor or two
            case("data", "transformer", "sgd", bucket_mb=0.01, accumulate=2),
            case("data", "mlp", "adam", loop="fit"),
            case("data", "cnn", "sgd", loop="fit"),
            case("data", "mlp", "sgd", batch_size=480, steps=3),  # crosses an epoch boundary
            case("model", "mlp", "sgd"),
            case("model", "cnn", "sgd"),
            case("model", "transformer", "adam"),
            pipe("mlp", "adam", schedule="gpipe", microbatches=3),
            pipe("cnn", "adam", schedule="1f1b", microbatches=5),
            pipe("transformer", "sgd", schedule="1f1b", microbatches=3, sync_sends=True),
            pipe("mlp", "sgd", schedule="1f1b", microbatches=3, clip_norm=0.1),
            pipe("mlp", "sgd", schedule="gpipe", microbatches=5, partition="params"),
            pipe("cnn", "sgd", schedule="1f1b-ahead", microbatches=4),
        ],
        3: [
            case("data", "mlp", "adam", bucket_mb=0.02),
            case("data", "cnn", "sgd"),
            case("model", "cnn", "adam"),
            pipe("transformer", "adam", schedule="gpipe", microbatches=3),
            pipe("mlp", "sgd", schedule="1f1b", microbatches=5),
            pipe("cnn", "sgd", schedule="1f1b", microbatches=3, partition="time"),
            pipe("transformer", "adam", schedule="1f1b-ahead", microbatches=5),
        ],
        4: [
            case("data", "transformer", "sgd"),
            case("data", "mlp", "adam"),
            case("model", "mlp", "adam"),
            case("model", "transformer", "sgd"),
            pipe("transformer", "adam", schedule="1f1b", microbatches=5),
            pipe("cnn", "sgd", schedule="gpipe", microbatches=3),
            pipe("mlp", "adam", schedule="1f1b", microbatches=3),
            hybrid("mlp", "sgd", pp_size=2, schedule="gpipe", microbatches=3),
            hybrid("transformer", "adam", pp_size=2, schedule="1f1b", microbatches=3),
            hybrid("cnn", "adam", pp_size=2, schedule="1f1b", microbatches=5),
            hybrid("transformer", "sgd", pp_size=2, schedule="gpipe", microbatches=5),
            hybrid("mlp", "adam", pp_size=4, schedule="1f1b", microbatches=3),
            hybrid("cnn", "sgd", pp_size=4, schedule="gpipe", microbatches=5),
            hybrid("mlp", "adam", pp_size=1),
            hybrid("cnn", "sgd", pp_size=1),
            hybrid(
                "transformer",
                "adam",
                pp_size=2,
                schedule="interleaved",
                virtual_stages=2,
                microbatches=4,
                batch_size=48,
            ),
            hybrid("mlp", "sgd", pp_size=2, schedule="zb-h1", microbatches=3),
        ],
    }[world_size]


def resume_grid(world_size: int) -> list[TrainConfig]:
    """Stop-and-resume runs: every model, and every engine (data, pipeline, hybrid). Pipelines
    resume under the default partition and must keep the checkpoint's (see resume_check)."""
    return {
        1: [],
        2: [
            case("data", "mlp", "sgd"),
            case("data", "transformer", "adam"),
            case("pipeline", "cnn", "adam", microbatches=3, partition="uniform"),
            case(
                "pipeline", "mlp", "adam", schedule="interleaved", virtual_stages=2, microbatches=2
            ),
        ],
        3: [
            case(
                "pipeline",
                "transformer",
                "sgd",
                schedule="zb-h1",
                microbatches=3,
                partition="params",
            )
        ],
        4: [case("hybrid", "transformer", "adam", pp_size=2, microbatches=3, partition="uniform")],
    }[world_size]


REFERENCES: dict[tuple, ReferenceRun] = {}


def reference(cfg: TrainConfig) -> ReferenceRun:
    """Trained from the run's initial weights, once per distinct run and starting point: many
    configurations share a reference. Keyed by the weights' digest, not their file, as each
    run writes its own file."""
    start = cfg.initial_weights_out
    run = (cfg.model, cfg.optimizer, cfg.lr, cfg.batch_size, cfg.steps, cfg.seed, cfg.clip_norm)
    key = (weights_digest(start), *run)
    if key not in REFERENCES:
        REFERENCES[key] = train_reference(reference_digits(), start, *run)
    return REFERENCES[key]


def watched(run, cfg: TrainConfig):
    """Run with a watchdog, as ringtrain.api.train does, and stop it afterwards."""
    from mpi4py import MPI

    dog = Watchdog(cfg.comm_timeout, MPI.COMM_WORLD.Get_rank())
    try:
        return run(dog)
    finally:
        dog.stop()


def run_strategy(cfg: TrainConfig, world: runtime.World, sets: dict) -> tuple[dict, dict | None]:
    """What `ringtrain train` runs for cfg's built-in model."""
    validate(cfg, world.size)
    return trained(builtin(cfg, DATA.input_shape, DATA.n_classes), DATA, cfg, world, sets)


def trained(model, data, cfg: TrainConfig, world: runtime.World, sets: dict):
    """(metrics, rank 0's weights) of training the compiled `model` as ringtrain.train would,
    with the stage process sets the grid needs."""
    if cfg.strategy == "hybrid" and cfg.pp_size > 1:
        dp_groups = Grid(world.size, cfg.pp_size).dp_groups()
        world = replace(world, process_sets=[sets[tuple(g)] for g in dp_groups])
    if cfg.loop == "fit":  # the model itself is trained: rank 0 reads its weights

        def fitted(dog: Watchdog) -> tuple[dict, dict | None]:
            metrics, _ = _fitted(model, data, cfg)(world, dog)
            return metrics, by_path(model.weights) if world.rank == 0 else None

        return watched(fitted, cfg)
    make = engine_for(model, data, cfg, world.size)

    def train(dog: Watchdog) -> tuple[dict, dict | None]:
        engine, dp_size = make(world)
        return loop.run(engine, data, cfg, world, dp_size, dog), engine.gather_weights()

    return watched(train, cfg)


def resume_check(cfg: TrainConfig, world: runtime.World, sets: dict, folder: str) -> dict:
    """S steps uninterrupted; then S/2 steps, checkpoint, stop; then resume in fresh engines,
    with the default partition: a pipeline must split as its checkpoint did."""
    full, full_weights = run_strategy(cfg, world, sets)
    ckpt = replace(cfg, checkpoint_dir=folder)
    stopped, at_stop = run_strategy(replace(ckpt, stop_after=cfg.steps // 2), world, sets)
    restored = f"{folder}-initial.npz"  # --initial-weights-out on --resume: the restored weights
    resumed, weights = run_strategy(
        replace(ckpt, resume=True, partition=None, initial_weights_out=restored), world, sets
    )
    if world.rank != 0:
        return {}
    with np.load(restored, allow_pickle=False) as start:
        resumed_from_the_stop = set(start.files) == at_stop.keys() and all(
            np.array_equal(start[k], at_stop[k]) for k in at_stop
        )
    return {
        "resumed_from_the_stop": resumed_from_the_stop,
        "stopped_finished": stopped["finished"],
        "stopped_steps": stopped["steps"],
        "steps": [full["steps"], resumed["steps"]],
        "weights_max_abs_diff": max(
            float(np.max(np.abs(weights[k] - full_weights[k]))) for k in full_weights
        ),
        "same_weight_names": weights.keys() == full_weights.keys(),
        "partitions": [full.get("partition"), resumed.get("partition")],
        "losses_max_abs_diff": float(
            np.max(np.abs(np.array(resumed["losses"]) - np.array(full["losses"])))
        ),
    }


def check_against_reference(
    configs: list[TrainConfig], world: runtime.World, sets: dict, starts: str
) -> None:
    """Each configuration's run, from the initial weights it writes to the folder `starts`,
    against the reference trained from those weights; rank 0 prints the comparison."""
    for i, cfg in enumerate(configs):
        cfg = replace(cfg, initial_weights_out=f"{starts}/initial-{i}.npz")
        metrics, weights = run_strategy(cfg, world, sets)
        if world.rank == 0:
            report = {
                "config": {k: v for k, v in cfg.as_dict().items() if k in REPORTED},
                "world_size": world.size,
                "pp_size": pp_size_of(cfg, world.size),
                **compare_with(reference(cfg), weights, metrics["losses"], cfg.fp16_allreduce),
                "replica_checksums": metrics.get("replica_checksums"),
                "peak_inflight": metrics.get("peak_inflight"),
            }
            print(json.dumps(report), flush=True)


# ---- a user's own compiled Keras model, against Keras's own fit ------------------------------
# Each zoo model of tests/user_models.py under every strategy that fits the world size, from
# the weights `keras.utils.set_random_seed(KERAS_SEED); build()` gives, against
# reference.keras_fit_updates. BatchNormalization normalises per microbatch (and per replica),
# so its reference is fit on batches of B/(D*M) accumulated over D*M; under data parallelism and
# hybrid each replica keeps its own moving statistics, so only its trainable weights compare.
KERAS_BATCH, KERAS_STEPS, KERAS_SEED = 32, 3, 5
KERAS_ZOO = {  # model -> (data, examples: fewer than S*B make a partial, uneven last batch)
    "residual_cnn": ("digits", KERAS_BATCH * KERAS_STEPS - 10),
    "bert_classifier": ("bert_data", KERAS_BATCH * KERAS_STEPS),
    "regression_mlp": ("regression_data", KERAS_BATCH * KERAS_STEPS),
    "frozen_finetune": ("digits", KERAS_BATCH * KERAS_STEPS),
    "bn_cnn": ("digits", KERAS_BATCH * KERAS_STEPS),
    "residual_cnn_nesterov": ("digits", KERAS_BATCH * KERAS_STEPS - 10),
    "two_heads": ("digits_and_parity", KERAS_BATCH * KERAS_STEPS - 10),
}
EXTRA = ("residual_cnn_nesterov", "two_heads")  # not under every strategy
GRID_MODELS = [m for m in KERAS_ZOO if m not in EXTRA]


def keras_grid(world_size: int) -> list[TrainConfig]:
    base = TrainConfig(batch_size=KERAS_BATCH, steps=KERAS_STEPS, seed=KERAS_SEED, shuffle=False)
    runs = {
        1: [dict(strategy="single")],
        2: [
            dict(strategy="data"),
            dict(strategy="pipeline", schedule="1f1b", microbatches=4),
            dict(strategy="pipeline", schedule="zb-h1", microbatches=4),
        ],
        4: [dict(strategy="hybrid", pp_size=2, schedule="1f1b", microbatches=4)],
    }.get(world_size, [])
    grid = [replace(base, model=m, **r) for r in runs for m in GRID_MODELS]
    if world_size == 2:  # the CNN with SGD + Nesterov momentum too; BERT in four stages;
        grid += [replace(base, model="residual_cnn_nesterov", **r) for r in runs[:2]]
        grid += [replace(base, model="two_heads", **r) for r in runs[:2]]  # loss_weights
        four = dict(schedule="interleaved", virtual_stages=2, microbatches=4)
        grid.append(replace(base, model="bert_classifier", strategy="pipeline", **four))
        # --accumulate (uneven slices of a partial batch; BERT's sparse embedding rows summed
        # across slices; BatchNormalization per slice) and --bucket-mb under data parallelism
        sliced = dict(strategy="data", accumulate=2)
        grid.append(replace(base, model="residual_cnn", bucket_mb=0.01, **sliced))
        grid += [replace(base, model=m, **sliced) for m in ("bert_classifier", "bn_cnn")]
    return grid


def zoo_model(name: str):
    """(what builds the model, x, y): a zoo model of tests/user_models.py (or a variant of one
    here) and the first examples of its data."""
    import user_models
    from reference import first_examples

    data_name, n = KERAS_ZOO[name]
    x, y = getattr(user_models, data_name)()
    build = SHARD_VARIANTS.get(name) or getattr(user_models, name)
    return build, first_examples(x, n), first_examples(y, n)


def keras_shares(cfg: TrainConfig, world_size: int) -> int:
    """The forward passes a global batch is cut into: replicas times microbatches (or slices)."""
    pp = pp_size_of(cfg, world_size)
    return (world_size // pp) * (cfg.microbatches if pp > 1 else cfg.accumulate)


def reference_key(cfg: TrainConfig, world_size: int) -> tuple[str, int]:
    """(model, microbatches) of cfg's reference: only BatchNormalization sees the shares."""
    return cfg.model, keras_shares(cfg, world_size) if cfg.model == "bn_cnn" else 1


def fit_keras_references(configs: list[TrainConfig], world: runtime.World) -> None:
    """Keras's fit of every reference `configs` need, dealt out across the ranks so that they
    fit at once: rank 0 keeps each in KERAS_REFERENCES as (initial weights, final weights,
    trainable paths)."""
    from reference import keras_fit_updates

    from ringtrain.bench.common import deal_out

    wanted: dict[tuple[str, int], TrainConfig] = {}  # in one order on every rank
    for cfg in configs:
        wanted.setdefault(reference_key(cfg, world.size), cfg)
    trainable: dict[tuple[str, int], list[str]] = {}

    def fit(key: tuple[str, int], cfg: TrainConfig) -> dict:
        build, x, y = zoo_model(key[0])
        found = keras_fit_updates(
            build, x, y, cfg.batch_size, cfg.steps, seed=cfg.seed, microbatches=key[1]
        )
        trainable[key] = [v.path for v in found.model.trainable_weights]
        return {f"initial:{k}": v for k, v in found.initial.items()} | {
            f"final:{k}": v for k, v in found.final.items()
        }

    fitted = deal_out(world.comm, [functools.partial(fit, key, cfg) for key, cfg in wanted.items()])
    paths: dict = {}
    for part in world.comm.gather(trainable, root=0) or []:  # names only, no tensors
        paths |= part
    for key, tensors in zip(wanted, fitted, strict=False):  # [] off rank 0
        initial, final = (
            {k.removeprefix(p): v for k, v in tensors.items() if k.startswith(p)}
            for p in ("initial:", "final:")
        )
        KERAS_REFERENCES[key] = (initial, final, set(paths[key]))


def keras_check(cfg: TrainConfig, world: runtime.World, sets: dict, check: str = "keras") -> dict:
    """One zoo model's run under cfg against Keras's fit (fit_keras_references); rank 0's
    report (`check` names it, with how far any replica's weights are from rank 0's)."""
    import keras
    from reference import compare_updates

    from ringtrain.data import Examples, UserData

    build, x, y = zoo_model(cfg.model)
    keras.utils.set_random_seed(cfg.seed)
    model = build()
    metrics, weights = trained(model, UserData(Examples(x, y)), cfg, world, sets)
    # hybrid replicas hold different stages; theirs agree if the updates do (each feeds the
    # average the next step's gradients are held to)
    whole = pp_size_of(cfg, world.size) == 1
    apart = replicas_differ(model, world.comm) if check != "keras" and whole else None
    if world.rank != 0:
        return {}
    initial, final, trainable = KERAS_REFERENCES[reference_key(cfg, world.size)]
    names = set(initial)
    replicas_normalise = pp_size_of(cfg, world.size) < world.size
    if cfg.model == "bn_cnn" and keras_shares(cfg, world.size) > 1 and replicas_normalise:
        names = trainable  # replicas' own statistics
    pick = lambda found: {k: found[k] for k in sorted(names)}  # noqa: E731
    update = compare_updates(pick(initial), pick(weights), pick(final))
    return {
        "check": check,
        "replicas_max_abs_diff": apart,
        "config": {k: v for k, v in cfg.as_dict().items() if k in REPORTED},
        "world_size": world.size,
        "steps": metrics["steps"],
        "compared": len(names),
        "update": asdict(update),
    }


KERAS_REFERENCES: dict[tuple[str, int], tuple[dict, dict, set]] = {}


KERAS_ZOO |= dict.fromkeys(("bn_cnn_synchronized", "subclassed"), KERAS_ZOO["bn_cnn"])  # refused


def keras_refusals(world_size: int) -> list[TrainConfig]:
    """On 2 ranks, what a model cannot train as: a subclassed one in pipeline stages,
    synchronized BatchNormalization under data parallelism, --loop fit on global batches that
    do not divide among the ranks."""
    if world_size != 2:
        return []
    base = TrainConfig(batch_size=KERAS_BATCH, steps=KERAS_STEPS, seed=KERAS_SEED, shuffle=False)
    return [
        replace(base, model="subclassed", strategy="pipeline", microbatches=4),
        replace(base, model="bn_cnn_synchronized", strategy="data"),
        replace(base, model="residual_cnn", strategy="data", loop="fit", batch_size=63),
    ]


def keras_refusal(cfg: TrainConfig, world: runtime.World) -> dict:
    """ringtrain.train's refusal of cfg, as `ringtrain train` meets it: rank 0's report holds
    each rank's message, exit code, whether all ranks stop there together and whether this
    rank leaves saying it to rank 0 (None: that rank trained instead)."""
    import keras
    import user_models

    from ringtrain import api
    from ringtrain.data import Examples, UserData
    from ringtrain.errors import UserError

    build, x, y = zoo_model(cfg.model)
    keras.utils.set_random_seed(cfg.seed)
    as_named = replace(cfg, model=f"{user_models.__file__}:{cfg.model}")  # --model PATH.py:NAME
    try:
        api.train(build(), UserData(Examples(x, y)), as_named)
        said = None
    except UserError as refused:
        said = {
            "message": str(refused),
            "exit_code": refused.exit_code,
            "together": refused.together,
            "quiet": refused.said_elsewhere,
        }
    return {
        "check": "keras-refusal",
        "config": {k: v for k, v in cfg.as_dict().items() if k in REPORTED},
        "ranks": world.comm.gather(said, root=0),
    }


def main() -> None:
    from ringtrain.launch.env import who_am_i

    size = who_am_i().world_size
    configs = grid(size)
    needed = {
        tuple(s)
        for c in configs + resume_grid(size) + keras_grid(size)
        if c.strategy == "hybrid" and c.pp_size > 1
        for s in Grid(size, c.pp_size).dp_groups()
    }
    world = runtime.start(with_horovod=True, process_sets=[list(s) for s in sorted(needed)])
    sets = dict(zip(sorted(needed), world.process_sets, strict=True))
    with tempfile.TemporaryDirectory(prefix="initial-weights-") as mine:
        check_against_reference(configs, world, sets, world.comm.bcast(mine))  # rank 0's folder
    fit_keras_references(keras_grid(size), world)
    for cfg in keras_grid(size):
        report = keras_check(cfg, world, sets)
        if world.rank == 0:
            print(json.dumps(report), flush=True)
    for cfg in keras_refusals(size):
        report = keras_refusal(cfg, world)
        if world.rank == 0:
            print(json.dumps(report), flush=True)
    if len(sys.argv) > 1:
        for i, cfg in enumerate(resume_grid(size)):
            check = resume_check(cfg, world, sets, f"{sys.argv[1]}/{i}")
            if world.rank == 0:
                config = {k: v for k, v in cfg.as_dict().items() if k in REPORTED}
                print(json.dumps({"check": "resume", "config": config, **check}), flush=True)


# ---- --shard-optimizer (ZeRO stage 1), its own launch -------------------------------------
#     mpirun -np N python tests/mpi_checks.py --shard RESUME_DIR
# On N > 1 ranks each run's weights are held to Keras's fit (the zoo) or to the independent
# reference (the built-ins), and every replica's to rank 0's, bit for bit; on 2 ranks a sharded
# run then stops and resumes in RESUME_DIR.
SHARD = "--shard"


def _recompiled(optimizer: str, **options):
    """The residual CNN compiled again with another optimizer: a per-variable option."""
    import keras
    import user_models

    model = user_models.residual_cnn()
    kind = {"adam": keras.optimizers.Adam, "rmsprop": keras.optimizers.RMSprop}[optimizer]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=kind(1e-3, **options), loss=loss)
    return model


SHARD_VARIANTS = {  # clipnorm: each variable's own norm, which a slice may cut across
    "residual_cnn_clipnorm": functools.partial(_recompiled, "adam", clipnorm=0.01),
    "residual_cnn_clipvalue": functools.partial(_recompiled, "rmsprop", clipvalue=0.001),
}
KERAS_ZOO |= dict.fromkeys(SHARD_VARIANTS, KERAS_ZOO["residual_cnn"])


def shard_grid(world_size: int) -> list[TrainConfig]:
    """The zoo under --shard-optimizer: Adam (a partial, uneven last batch), SGD + Nesterov
    momentum, SGD + momentum under a frozen extractor, AdamW with a cosine schedule and
    global_clipnorm, Adam with clipnorm, RMSprop with clipvalue (these on 2 ranks in chunks of
    0.01 MiB: many reduce-scatters, allgathers and slot variables a step) and two outputs under
    --accumulate 2; on 4 ranks Adam and SGD + Nesterov momentum, data parallel and hybrid 2x2
    (each stage's slots shared by its two replicas)."""
    base = TrainConfig(batch_size=KERAS_BATCH, steps=KERAS_STEPS, seed=KERAS_SEED, shuffle=False)
    sharded = replace(base, strategy="data", shard_optimizer=True)
    zoo = ("residual_cnn", "residual_cnn_nesterov", "frozen_finetune", "regression_mlp")
    if world_size > 2:
        grid = dict(strategy="hybrid", pp_size=2, schedule="1f1b", microbatches=4, bucket_mb=0.01)
        return [replace(sharded, model=m, **r) for r in ({}, grid) for m in zoo[:2]]
    grid = [replace(sharded, model=m, bucket_mb=0.01) for m in (*zoo, *SHARD_VARIANTS)]
    return [*grid, replace(sharded, model="two_heads", accumulate=2)]


def shard_builtins(world_size: int) -> list[TrainConfig]:
    """The built-in MLP against the independent reference under SGD and --fp16-allreduce."""
    if world_size != 2:
        return []
    return [case("data", "mlp", "sgd", fp16_allreduce=True, shard_optimizer=True)]


def replicas_differ(model, comm) -> float:
    """The largest difference between any replica's weights and rank 0's (0.0: identical)."""
    from mpi4py import MPI

    mine = np.concatenate([np.ravel(v.numpy()).astype(np.float64) for v in model.weights])
    root = mine.copy()
    comm.Bcast(root, root=0)
    worst = np.array([float(np.max(np.abs(mine - root)))])
    comm.Allreduce(MPI.IN_PLACE, worst, op=MPI.MAX)
    return float(worst[0])


def shard_main() -> None:
    from ringtrain.launch.env import who_am_i

    size = who_am_i().world_size
    needed = sorted(
        {
            tuple(s)
            for c in shard_grid(size)
            if c.strategy == "hybrid"
            for s in Grid(size, c.pp_size).dp_groups()
        }
    )
    world = runtime.start(with_horovod=True, process_sets=[list(s) for s in needed])
    sets = dict(zip(needed, world.process_sets or [], strict=True))
    with tempfile.TemporaryDirectory(prefix="initial-weights-") as mine:
        check_against_reference(shard_builtins(size), world, {}, world.comm.bcast(mine))
    fit_keras_references(shard_grid(size), world)
    for cfg in shard_grid(size):
        report = keras_check(cfg, world, sets, check="keras-shard")
        if world.rank == 0:
            print(json.dumps(report), flush=True)
    if size != 2:
        return
    cfg = case("data", "mlp", "adam", shard_optimizer=True, bucket_mb=0.01)
    check = resume_check(cfg, world, {}, f"{sys.argv[2]}/sharded")
    if world.rank == 0:
        config = {k: v for k, v in cfg.as_dict().items() if k in REPORTED}
        print(json.dumps({"check": "resume", "config": config, **check}), flush=True)


if __name__ == "__main__":
    shard_main() if sys.argv[1:2] == [SHARD] else main()
