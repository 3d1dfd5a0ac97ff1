"""The ranks of `ringtrain bench dp`: every contender and every roofline term of one workload,
measured in one mpirun, alternating round by round.

    mpirun -np 2 python -m ringtrain.bench.roofline_worker \
        WORKLOAD ROUNDS STEPS OUT.json TURNS_FOLDER ORDER

ORDER names the launches that take turns round by round (ringtrain, then TensorFlow's
MultiWorkerMirrored workers, see roofline_mwms_worker); TURNS_FOLDER holds their markers.

Contenders: one process on the global batch (the efficiency baseline), ringtrain's data
parallelism as `ringtrain train` runs it (the real loop: learning rate, step, stop agreement,
progress), the same with --bucket-mb, and a plain Horovod step (one tf.function, one
grouped_allreduce, nothing else) as the floor a Horovod engineer would write. Roofline terms:
the compute of one rank's half batch while the other rank computes its own, the in-place and
out-of-place MPI_Allreduce of the gradient bytes, and the link rate. Horovod runs only while a
contender that needs it is measured: its background thread would take CPU from the others.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np

from ringtrain import log, runtime
from ringtrain.bench.allreduce_worker import mpi_in_place, mpi_out_of_place, payload, self_check
from ringtrain.bench.common import (
    Turns,
    batch_stream,
    cpus_allowed,
    engine_of,
    horovod_running,
    idle_barrier,
    settings_in_force,
)
from ringtrain.bench.roofline import BUCKET_MB, CONTENDERS, LAUNCH, WORKLOADS, Workload
from ringtrain.config import TrainConfig
from ringtrain.data import Dataset, load_synthetic, shard
from ringtrain.timing import slowest_rank_seconds, timed_steps
from ringtrain.weights import variable_bytes

SEED, LR = 0, 0.01


def ringtrain_loop(engine, data: Dataset, cfg: TrainConfig, world) -> tuple[float, dict]:
    """ms per step of `ringtrain train`'s own loop (evaluation and checkpoints left out), and
    where the time went."""
    from ringtrain import loop
    from ringtrain.guard import Watchdog

    watchdog = Watchdog(cfg.comm_timeout, world.rank)
    try:
        metrics = loop.run(engine, data, cfg, world, world.size, watchdog)
    finally:
        watchdog.stop()
    phases = metrics["step_breakdown_ms"]
    return sum(v for k, v in phases.items() if k != "checkpoints_and_evaluation"), phases


def ringtrain_engine(workload: Workload, data: Dataset, cfg: TrainConfig, world):
    """ringtrain's engine for cfg, as `ringtrain train` runs it, on a model of its own."""
    from ringtrain.models import compile_classifier

    return engine_of(compile_classifier(workload.model(data), "sgd", LR), data, cfg, world)


def plain_horovod(workload: Workload, data: Dataset, hvd, world):
    """The step a Horovod user writes by hand: tape, one grouped_allreduce, apply."""
    import keras
    import tensorflow as tf

    model = workload.model(data)
    variables = model.trainable_variables
    optimizer = keras.optimizers.SGD(learning_rate=LR)
    optimizer.build(variables)
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = cross_entropy(y, model(x, training=True))
        grads = tape.gradient(loss, variables)
        *grads, loss = hvd.grouped_allreduce([*grads, loss], op=hvd.Average)
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        return loss

    def run(batch: np.ndarray) -> None:
        local = shard(batch, world.rank, world.size)
        float(step(data.x[local], data.y[local]))

    return run


def allreduce_ms(comm, nbytes: int, repeats: int) -> dict[str, float]:
    """MPI_Allreduce of the gradient bytes in place and out of place, as `bench allreduce`
    runs them (ms a call on the slowest rank), each then checked against the local sum."""
    array = payload(comm.Get_rank(), nbytes)
    expected = sum(payload(r, nbytes) for r in range(comm.Get_size()))
    times = {}
    for name, make in (("in_place", mpi_in_place), ("out_of_place", mpi_out_of_place)):
        times[name] = 1e3 * slowest_rank_seconds(comm, make(comm, array), repeats)
        problem = self_check(f"MPI_Allreduce {name}", make, comm, array, expected)
        if problem is not None:
            raise RuntimeError(problem)
    return times


def link_rate_mb_s(comm, nbytes: int = 16 << 20, repeats: int = 3) -> float:
    """MB/s one way between rank 0 and rank 1, from simultaneous exchanges of `nbytes`."""
    send = np.ones(nbytes, np.uint8)
    receive = np.empty_like(send)
    peer = 1 - comm.Get_rank()
    best = float("inf")
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        comm.Sendrecv(send, dest=peer, recvbuf=receive, source=peer)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e6


def overlap_trace(engine, stream: np.ndarray, steps: int = 5) -> dict:
    """The traced step whose first bucket came in closest to the backward's end, as the median
    of `steps` after a warm-up (the first run of a graph negotiates its tensors anew)."""
    engine.traced_step(stream[0])
    traces = [engine.traced_step(batch) for batch in stream[1 : steps + 1]]
    traces.sort(key=lambda t: t["bucket_arrival_ms"][0] - t["backward_end_ms"])
    return traces[len(traces) // 2]


@contextmanager
def horovod_settings(**values: str | None) -> Iterator[None]:
    """Environment for the next hvd.init (None: unset, so Horovod's default applies)."""
    before = {k: os.environ.get(k) for k in values}
    _set(values)
    try:
        yield
    finally:
        _set(before)


def _set(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def timeline_ms(path: str, steps: int) -> dict[str, float]:
    """Horovod's own activities per step (negotiation, fusion copies, the allreduce), from its
    timeline: each activity's intervals merged across tensors, summed, divided by steps."""
    text = Path(path).read_text().strip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    open_at: dict[tuple, float] = {}
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "B":
            open_at[key] = (e["name"], e["ts"])
        elif e.get("ph") == "E" and key in open_at:
            name, began = open_at.pop(key)
            spans.setdefault(name, []).append((began, e["ts"]))
    totals = {}
    for name, intervals in spans.items():
        merged, end = 0.0, -1.0
        for began, ended in sorted(intervals):
            merged += max(0.0, ended - max(began, end))
            end = max(end, ended)
        totals[name] = round(merged / 1e3 / steps, 4)
    return totals


def measure(workload: Workload, rounds: int, steps: int, out: str, turns: Turns) -> None:
    from mpi4py import MPI

    users_cycle = os.environ.get("HOROVOD_CYCLE_TIME")  # before ringtrain's default fills it
    world = runtime.start(with_horovod=False, horovod_later=True)
    data = load_synthetic(workload.samples, workload.shape, 10, SEED)
    cfg = TrainConfig(
        strategy="data",
        model=workload.name,
        batch_size=workload.batch,
        optimizer="sgd",
        lr=LR,
        seed=SEED,
        steps=steps + 1,
        progress="none",
        comm_timeout=600,
    )
    # Horovod broadcasts by variable name and Keras numbers names per process, so every rank
    # builds the broadcasting contenders first, in the same order.
    with horovod_running(world.comm) as hvd:
        ranks = replace(world, hvd=hvd)
        engines = {
            "ringtrain": ringtrain_engine(workload, data, cfg, ranks),
            "ringtrain bucketed": ringtrain_engine(
                workload, data, replace(cfg, bucket_mb=BUCKET_MB), ranks
            ),
        }
        plain = plain_horovod(workload, data, hvd, world)
        stream = batch_stream(len(data.x), steps + 1, workload.batch, SEED)
        for engine in engines.values():
            engine.step(stream[0])
        plain(stream[0])
    alone = runtime.World(0, 1, 0, 1, MPI.COMM_SELF, None)  # a world of its own: rank 0 of 1
    half = replace(cfg, strategy="single", batch_size=workload.batch // world.size)
    local = ringtrain_engine(workload, data, half, alone)  # one rank's compute, no allreduce
    single = ringtrain_engine(workload, data, replace(cfg, strategy="single"), alone)
    grad_bytes = sum(variable_bytes(local.trainable))

    rows = []
    for r in range(rounds):
        take_turn(turns, world.comm, r)
        order = CONTENDERS[r % len(CONTENDERS) :] + CONTENDERS[: r % len(CONTENDERS)]
        row: dict = {"round": r}
        for name in order:
            idle_barrier(world.comm)
            log.any_rank(f"round {r + 1}/{rounds}: {name}")
            if name == "single":
                if world.rank == 0:
                    row[name] = timed_steps(single.step, stream)
            elif name == "compute per rank":
                own = [shard(b, world.rank, world.size) for b in stream]
                row[name] = timed_steps(local.step, own)
            elif name == "MPI_Allreduce":
                row |= {
                    f"MPI_Allreduce {k}": v
                    for k, v in allreduce_ms(world.comm, grad_bytes, 5).items()
                }
            elif name == "plain Horovod":  # as a Horovod user runs it: Horovod's defaults
                stock = horovod_settings(HOROVOD_CYCLE_TIME=users_cycle, RINGTRAIN_HOROVOD_NICE="0")
                with stock, horovod_running(world.comm):
                    row[name] = timed_steps(plain, stream)
            else:
                with horovod_running(world.comm):
                    ms, phases = ringtrain_loop(engines[name], data, cfg, world)
                row[name], row[f"{name} breakdown"] = ms, phases
        rows.append(row)
        if world.rank == 0:
            turns.done(r)
    take_turn(turns, world.comm, rounds)  # TensorFlow's last round is over
    link = link_rate_mb_s(world.comm)
    with horovod_settings(HOROVOD_TIMELINE="DYNAMIC"), horovod_running(world.comm) as hvd:
        trace = overlap_trace(engines["ringtrain bucketed"], stream)
        timeline = Path(tempfile.mkdtemp()) / "timeline.json"
        hvd.start_timeline(str(timeline))
        ringtrain_loop(engines["ringtrain"], data, cfg, world)
        hvd.stop_timeline()
    ranks = world.comm.gather(
        {
            "host": MPI.Get_processor_name(),
            "cpus_allowed_list": cpus_allowed(),
            "environment": settings_in_force(),
        }
    )
    if world.rank == 0:
        report = {
            "workload": workload.name,
            "global_batch": workload.batch,
            "gradient_bytes": grad_bytes,
            "buckets": len(engines["ringtrain bucketed"].buckets),
            "link_mb_s": link,
            "rounds": rows,
            "overlap_trace": trace,
            "horovod_timeline_ms_per_step": timeline_ms(str(timeline), steps + 1),
            "hosts": sorted({r["host"] for r in ranks}),
            "ranks": ranks,
        }
        Path(out).write_text(json.dumps(report, indent=1))


def take_turn(turns: Turns, comm, round_: int) -> None:
    """Rank 0 waits for the launch before ringtrain's; the other rank sleeps in a barrier."""
    if comm.Get_rank() == 0:
        turns.wait(round_)
    idle_barrier(comm)


if __name__ == "__main__":
    name, rounds, steps, out, folder, order = sys.argv[1:7]
    turns = Turns(folder, order.split(","), LAUNCH)
    measure(WORKLOADS[name], int(rounds), int(steps), out, turns)
