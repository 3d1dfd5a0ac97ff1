"""The ranks of `ringtrain bench zoo`, one measurement per command.

    mpirun --bind-to none -np 2 python -m ringtrain.bench.zoo_worker GLOBAL_BATCH

Every contender is built once, in the same order on every rank, and traced before the ready
reply; rank 0 serves the parent's commands as in `bench strategies` (bench/common.serve). A
contender named `WEIGHTS + name` resets that contender's model to the initial weights it
shares with the others of its architecture, trains S given global batches, [t*B, (t+1)*B),
and replies with each tensor's distance from what one-process Keras `model.fit` made of the
same batches from the same weights (each fit once, before the first comparison, the ranks
fitting at once; rank 0 gathers them).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from statistics import median

import numpy as np

from ringtrain import runtime
from ringtrain.bench import common
from ringtrain.bench.strategies import LR, SEED, workload
from ringtrain.bench.strategies_worker import engine_runner
from ringtrain.bench.zoo import (
    CNN_BUILTIN,
    CNN_KERAS,
    COMPARED,
    MICROBATCHES,
    RESNET_DATA,
    RESNET_PIPELINE,
    RESNET_SINGLE,
    SHARES,
    VIRTUAL_STAGES,
    WEIGHTS,
    functional_cnn,
    resnet50,
)
from ringtrain.data import Dataset, Examples, UserData


@dataclass
class Contender:
    """One engine and what it trains: for a user's model, the model, its initial weights (the
    same for every contender of one architecture) and how to build it afresh, for the
    reference model.fit; `horovod`: whether Horovod must run while it steps."""

    engine: object
    horovod: bool
    model: object = None
    initial: list | None = None
    fresh: Callable[[], object] | None = None


def relative_distances(names: list[str], initial: list, trained: list, reference: list) -> dict:
    """Per tensor ||dw - dw_ref|| / ||dw_ref||, dw being what training changed: the summary
    over all tensors, and apart for BatchNormalization's moving statistics."""
    found = {}
    for name, start, mine, theirs in zip(names, initial, trained, reference, strict=True):
        moved = theirs - start
        gap = np.linalg.norm((mine - start) - moved)
        found[name] = float(gap / max(np.linalg.norm(moved), 1e-30))
    moving = [d for name, d in found.items() if "moving_" in name]
    others = [d for name, d in found.items() if "moving_" not in name]
    return {
        "median": median(found.values()),
        "max": max(found.values()),
        "worst_tensor": max(found, key=found.get),
        "median_moving_statistics": median(moving) if moving else None,
        "median_other_tensors": median(others),
        "tensors": len(found),
        "per_tensor": found,
    }


def fit_reference(
    c: Contender, data: Dataset, steps: int, batch: int, shares: int = 1
) -> list[np.ndarray]:
    """One-process Keras from the contender's initial weights: model.fit on the first
    `steps` global batches, in order; with `shares` K > 1, on batches of B/K, the optimizer
    stepping once per K of them on their mean gradient (gradient_accumulation_steps)."""
    model = c.fresh()
    model.set_weights(c.initial)
    if shares > 1:
        model.optimizer.gradient_accumulation_steps = shares
    n = steps * batch
    model.fit(
        data.x[:n], data.y[:n], batch_size=batch // shares, shuffle=False, epochs=1, verbose=0
    )
    return model.get_weights()


def fit_references(
    world: runtime.World, contenders: dict[str, Contender], data: Dataset, steps: int, batch: int
) -> dict[tuple, list[np.ndarray]]:
    """Every model.fit the comparisons need, once each, dealt out across the ranks so that they
    fit at once: rank 0 gets them all, keyed (fresh, shares); the others an empty dict."""
    wanted: dict[tuple, Contender] = {}  # in one order on every rank
    for name in COMPARED:
        c = contenders.get(name)
        if c is None:  # rank 0's lone contender, on rank 1: its model.fit is the data one's
            continue
        for shares in dict.fromkeys((1, SHARES.get(name, 1))):
            wanted.setdefault((c.fresh, shares), c)

    def job(c: Contender, shares: int) -> dict[str, np.ndarray]:
        fitted = fit_reference(c, data, steps, batch, shares)
        return {str(i): w for i, w in enumerate(fitted)}

    fitted = common.deal_out(world.comm, [partial(job, c, k) for (_, k), c in wanted.items()])
    return {
        key: list(tensors.values()) for key, tensors in zip(wanted, fitted, strict=False)
    }  # [] off rank 0


def _contenders(world: runtime.World, data: Dataset, batch: int) -> dict[str, Contender]:
    """Every contender, built in one order on every rank (Horovod matches by names Keras numbers
    per process), rank 0's lone one last."""
    from mpi4py import MPI

    from ringtrain.dataparallel.engine import DataParallelEngine
    from ringtrain.models import compile_classifier

    _, build = workload()
    users = UserData(Examples(data.x, data.y))
    cfg = common.bench_config("cnn", batch, LR, SEED)
    data_cfg = replace(cfg, strategy="data")
    new_cnn = partial(functional_cnn, data.input_shape, data.n_classes)
    new_resnet = partial(resnet50, data.n_classes)
    initial = new_resnet().get_weights()  # on every rank, so that names number alike
    for array in initial:  # rank 0's draw, as contiguous buffers (no pickle)
        world.comm.Bcast(array, root=0)

    def resnet(make_engine, horovod: bool = False) -> Contender:
        model = new_resnet()
        model.set_weights(initial)
        return Contender(make_engine(model), horovod, model, initial, new_resnet)

    found = {}
    with common.horovod_running(world.comm) as hvd:
        ranks = replace(world, hvd=hvd)
        builtin = compile_classifier(build(), "sgd", LR)
        found[CNN_BUILTIN] = Contender(common.engine_of(builtin, data, data_cfg, ranks), True)
        cnn = new_cnn()
        engine = DataParallelEngine(cnn, users, data_cfg, ranks)  # rank 0's weights
        found[CNN_KERAS] = Contender(engine, True, cnn, cnn.get_weights(), new_cnn)
        found[RESNET_DATA] = resnet(
            lambda m: DataParallelEngine(m, users, data_cfg, ranks), horovod=True
        )
        for c in found.values():
            engine_runner(c.engine, data, batch)(1)  # trace while Horovod is up
    pipeline_cfg = replace(
        cfg,
        strategy="pipeline",
        schedule="interleaved",
        virtual_stages=VIRTUAL_STAGES,
        microbatches=MICROBATCHES,
    )
    found[RESNET_PIPELINE] = resnet(lambda m: common.engine_of(m, users, pipeline_cfg, world))
    if world.rank == 0:
        alone = runtime.World(0, 1, 0, 1, MPI.COMM_SELF, None)
        found[RESNET_SINGLE] = resnet(lambda m: DataParallelEngine(m, users, cfg, alone))
    return found


def main() -> None:
    world = runtime.start(with_horovod=False, horovod_later=True)
    import tensorflow as tf

    data, _ = workload()
    batch = int(sys.argv[1])
    contenders = _contenders(world, data, batch)
    for c in contenders.values():
        if not c.horovod:
            engine_runner(c.engine, data, batch)(1)  # trace outside any timing
    cpus = common.ranks_cpus_allowed(world.comm)
    pipeline = contenders[RESNET_PIPELINE]
    if world.rank == 0:
        common.reply(
            {
                "ready": True,
                "threads": {
                    "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
                    "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
                },
                "cpus_allowed_list": cpus,
                "environment": common.settings_in_force(),
                "samples": len(data.x),
                "resnet50_parameters": int(pipeline.model.count_params()),
                "partition": [list(b) for b in pipeline.engine.bounds],
            }
        )
    references: dict[tuple, list] | None = None  # model.fit's weights, once compared

    def compare(contender: str, c: Contender, steps: int) -> dict | None:
        """S steps from the initial weights, then (rank 0) the distances from model.fit's."""
        c.model.set_weights(c.initial)
        with common.horovod_running(world.comm) if c.horovod else nullcontext():
            for t in range(steps):
                c.engine.step(np.arange(t * batch, (t + 1) * batch))
        gathered = c.engine.gather_weights()  # every stage's, under the model's own names
        if world.rank != 0:
            return None
        names = [v.path for v in c.model.weights]
        trained = [gathered[name] for name in names]

        def distance(shares: int) -> dict:
            return relative_distances(names, c.initial, trained, references[c.fresh, shares])

        found = {"distance": distance(1)}
        if SHARES.get(contender, 1) > 1:
            found["distance_per_share"] = distance(SHARES[contender])
        return found

    def measure(name: str, steps: int) -> dict | None:
        nonlocal references
        if name.startswith(WEIGHTS) and references is None:  # every rank, at the first
            references = fit_references(world, contenders, data, steps, batch)
        c = contenders.get(name.removeprefix(WEIGHTS))
        if c is None:  # rank 0's lone contender, on rank 1
            return None
        if name.startswith(WEIGHTS):
            return compare(name.removeprefix(WEIGHTS), c, steps)
        with common.horovod_running(world.comm) if c.horovod else nullcontext():
            return {"seconds": engine_runner(c.engine, data, batch)(steps)}

    timed = [CNN_BUILTIN, CNN_KERAS, RESNET_SINGLE, RESNET_DATA, RESNET_PIPELINE]
    common.serve(world.comm, timed + [WEIGHTS + name for name in COMPARED], measure)


if __name__ == "__main__":
    main()
