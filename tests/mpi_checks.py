"""Runs inside every rank of one mpirun and checks many configurations against single-process
training computed in the same process (on COMM_SELF). Rank 0 prints one JSON line per check.

    mpirun -np N python tests/mpi_checks.py {data,pipeline,hybrid}
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import numpy as np

from ringtrain import loop, runtime
from ringtrain.config import TrainConfig, pipeline_stages, validate
from ringtrain.data import load_digits
from ringtrain.dataparallel.engine import DataParallelEngine
from ringtrain.guard import Watchdog
from ringtrain.models import BUILTIN
from ringtrain.weights import named_weights, relative_difference

DATA = load_digits()


def spec_of(cfg: TrainConfig):
    return BUILTIN[cfg.model](DATA.input_shape, DATA.n_classes)


def single_process(cfg: TrainConfig, world: runtime.World) -> tuple[dict, list[float]]:
    """The reference: the same global batches on one process, no Horovod, no pipeline."""
    alone = runtime.World(0, 1, 0, 1, _self(), None)
    ref = replace(
        cfg, strategy="single", microbatches=1, accumulate=1, fp16_allreduce=False, pp_size=None
    )
    engine = DataParallelEngine(spec_of(ref), DATA, ref, alone)
    metrics = watched(lambda dog: loop.run(engine, DATA, ref, alone, 1, dog), ref)
    return named_weights(engine.elements), metrics["losses"]


def watched(run, cfg: TrainConfig):
    """Run with a watchdog, as ringtrain.api.train does, and stop it afterwards."""
    dog = Watchdog(cfg.comm_timeout, _world_rank())
    try:
        return run(dog)
    finally:
        dog.stop()


def _world_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def _self():
    from mpi4py import MPI

    return MPI.COMM_SELF


def run_strategy(cfg: TrainConfig, world: runtime.World):
    validate(cfg, world.size, len(spec_of(cfg)))
    if cfg.loop == "fit":
        from ringtrain.dataparallel.keras_fit import fit

        return watched(lambda dog: fit(spec_of(cfg), DATA, cfg, world, dog), cfg)
    if cfg.strategy == "data":
        engine = DataParallelEngine(spec_of(cfg), DATA, cfg, world)
        replicas = world.size
    else:
        from ringtrain.pipeline.engine import PipelineEngine

        engine = PipelineEngine(spec_of(cfg), DATA, cfg, world)
        replicas = engine.grid.replicas
    metrics = watched(lambda dog: loop.run(engine, DATA, cfg, world, replicas, dog), cfg)
    return metrics, engine.gather_weights()


def with_lr(cfg: TrainConfig) -> TrainConfig:
    """Usual learning rates: Adam's larger effective step would also magnify rounding noise."""
    return replace(cfg, lr=0.001 if cfg.optimizer == "adam" else 0.01)


def schedule_grid(base: TrainConfig, microbatches: tuple[int, ...]) -> list[TrainConfig]:
    """Both schedules x M x {mlp, transformer} x {SGD, Adam}."""
    return [
        replace(base, schedule=kind, microbatches=m, model=model, optimizer=opt)
        for kind in ("gpipe", "1f1b")
        for m in microbatches
        for model in ("mlp", "transformer")
        for opt in ("sgd", "adam")
    ]


def configs(suite: str) -> list[TrainConfig]:
    base = TrainConfig(batch_size=48, steps=5, seed=3)
    out = []
    if suite == "data":
        for model in ("mlp", "cnn"):
            for opt in ("sgd", "adam"):
                out.append(replace(base, strategy="data", model=model, optimizer=opt))
        out.append(replace(base, strategy="data", model="mlp", optimizer="adam", accumulate=2))
        out.append(replace(base, strategy="data", model="cnn", optimizer="sgd", accumulate=2))
        out.append(
            replace(base, strategy="data", model="mlp", optimizer="sgd", fp16_allreduce=True)
        )
        out.append(replace(base, strategy="data", model="mlp", optimizer="adam", clip_norm=0.5))
        out.append(replace(base, strategy="data", model="mlp", optimizer="adam", loop="fit"))
        out.append(replace(base, strategy="data", model="cnn", optimizer="sgd", loop="fit"))
    elif suite == "pipeline":
        base = replace(base, steps=3)
        out += schedule_grid(replace(base, strategy="pipeline"), (1, 3, 8))
        out.append(replace(base, strategy="model", model="mlp", optimizer="adam"))
        out.append(
            replace(
                base,
                strategy="pipeline",
                model="mlp",
                optimizer="adam",
                microbatches=3,
                clip_norm=0.5,
            )
        )
        out.append(
            replace(
                base,
                strategy="pipeline",
                model="transformer",
                optimizer="adam",
                microbatches=8,
                sync_sends=True,
            )
        )
        out.append(
            replace(
                base,
                strategy="pipeline",
                model="mlp",
                optimizer="sgd",
                microbatches=8,
                partition="params",
                schedule="gpipe",
            )
        )
        out.append(
            replace(
                base,
                strategy="pipeline",
                model="transformer",
                optimizer="sgd",
                microbatches=3,
                partition="time",
            )
        )
    elif suite == "hybrid":
        base = replace(base, steps=3, strategy="hybrid", pp_size=2)
        out += schedule_grid(base, (2, 4))
    return [with_lr(cfg) for cfg in out]


def resume_checks(suite: str, world: runtime.World, folder: str) -> None:
    """Train S steps; then S/2, checkpoint, stop; then resume in fresh engines to S: equal."""
    strategy = {"data": "data", "pipeline": "pipeline", "hybrid": "hybrid"}[suite]
    for opt in ("sgd", "adam"):
        cfg = with_lr(
            TrainConfig(
                strategy=strategy,
                model="mlp",
                optimizer=opt,
                batch_size=48,
                steps=6,
                seed=5,
                microbatches=1 if suite == "data" else 4,
                pp_size=2 if suite == "hybrid" else None,
            )
        )
        full, full_weights = run_strategy(cfg, world)
        ckpt = replace(cfg, checkpoint_dir=f"{folder}/{suite}-{opt}")
        stopped, _ = run_strategy(replace(ckpt, stop_after=3), world)
        resumed, weights = run_strategy(replace(ckpt, resume=True), world)
        if world.rank == 0:
            print(
                json.dumps(
                    {
                        "check": "resume",
                        "suite": suite,
                        "optimizer": opt,
                        "stopped_finished": stopped["finished"],
                        "stopped_steps": stopped["steps"],
                        "rel_diff": relative_difference(weights, full_weights),
                        "loss_diff": float(
                            np.max(np.abs(np.array(resumed["losses"]) - np.array(full["losses"])))
                        ),
                        "steps": [full["steps"], resumed["steps"]],
                    }
                ),
                flush=True,
            )


def main() -> None:
    suite = sys.argv[1]
    from ringtrain.launch.env import who_am_i

    size = who_am_i().world_size
    stage_sets = None
    if suite == "hybrid":
        from ringtrain.pipeline.grid import Grid

        stage_sets = Grid(size, 2).stage_sets()
    world = runtime.start(with_horovod=True, process_sets=stage_sets)
    for cfg in configs(suite):
        reference, ref_losses = single_process(cfg, world)
        metrics, weights = run_strategy(cfg, world)
        if world.rank == 0:
            stages = pipeline_stages(cfg, world.size)
            print(
                json.dumps(
                    {
                        "config": {
                            k: v
                            for k, v in cfg.as_dict().items()
                            if k
                            in (
                                "strategy",
                                "model",
                                "optimizer",
                                "schedule",
                                "microbatches",
                                "accumulate",
                                "fp16_allreduce",
                                "clip_norm",
                                "loop",
                                "sync_sends",
                                "partition",
                            )
                        },
                        "world_size": world.size,
                        "stages": stages,
                        "rel_diff": relative_difference(weights, reference),
                        "loss_diff": float(
                            np.max(np.abs(np.array(metrics["losses"]) - np.array(ref_losses)))
                        ),
                        "replica_checksums": metrics.get("replica_checksums"),
                        "peak_inflight": metrics.get("peak_inflight"),
                        "bubble_measured": metrics.get("bubble_measured"),
                    }
                ),
                flush=True,
            )
    if len(sys.argv) > 2:
        resume_checks(suite, world, sys.argv[2])


if __name__ == "__main__":
    main()
