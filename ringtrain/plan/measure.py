"""`ringtrain plan calibrate`'s ranks (2, under mpirun): what the cost model needs, measured.

Both ranks compute at once, as in training, and rank 0 reports. A data-parallel step's compute
is timed as one compiled function over the whole model, the way ringtrain runs it; each
unit's F, B, BI and BW the way the pipeline executor runs them (a unit is a block of the
model's graph between valid cuts: a built-in's layer, or a block of a user's graph). Both at
two sample counts (a 16th and a half of the global batch: the microbatches and per-rank batches
the planner considers lie between), fitted as fixed + per-sample seconds. Horovod's allreduce
is timed at several sizes, the model's gradient bytes among them, and read between them along
lines; point-to-point messages as the pipeline's own calibration times them
(pipeline.calibrate). The resident set after TensorFlow's import (MPI started first, as in
training) is the baseline a rank pays before any model, and the high-water mark after
ringtrain's data-parallel engine's first block of steps what that step adds at half the batch.
Rank 0 writes the JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from statistics import median

import numpy as np

from ringtrain.keras_model.source import add_source_arguments
from ringtrain.plan.costmodel import fit_line
from ringtrain.proc import resident_bytes
from ringtrain.timing import horovod_sum, slowest_rank_seconds, timed_steps

ALLREDUCE_SIZES = (4 << 10, 256 << 10, 4 << 20)
P2P_SIZES = (64, 64 << 10, 1 << 20)
REPEATS = 8
STEPS_TIMED = 30
ENGINE_BLOCKS = 5


def _elements(subject) -> list[dict]:
    """Each unit's parameters, and the 4-byte words per example crossing into and out of it."""
    words = subject.plan.boundary_words()
    return [
        {"params": int(params), "input_floats": words[i], "output_floats": words[i + 1]}
        for i, params in enumerate(subject.plan.unit_params())
    ]


def _element_seconds(subject, batch: int) -> list[dict]:
    """Each unit's F, B, BI and BW seconds as fixed + per sample, timed as the executor's
    time partition times them (so the planner splits the model where the executor will)."""
    from ringtrain.pipeline.ir import COMPUTE

    plan = subject.plan
    at = {n: plan.unit_seconds(n) for n in _sample_counts(batch)}
    units = range(plan.n_units)
    return [{op: fit_line({n: at[n][i][op] for n in at}) for op in COMPUTE} for i in units]


def _stage_ranges(subject, batch: int, tf) -> list[dict]:
    """Every contiguous range of units as one pipeline stage, run the way the executor runs
    it (the stage the plan builds, its own calls): F, the compiled forward that keeps the
    activations (the loss read on the last stage); B, the compiled backward that takes every
    gradient from them and adds the weights' into the stage's sums; BW, nothing (BI makes and
    adds every gradient, and BW only releases the microbatch); STEP, the compiled optimizer
    step over the range's weights. Fitted as fixed + per sample.

    Each round times every range at both sizes once, so each figure's REPEATS timings are
    spread over the whole pass: this machine's speed moves by tens of percent over a fraction
    of a second, and timings taken back to back all fell in one such spell."""
    from ringtrain.pipeline.profile import ones_upstream, time_microbatch

    plan, n = subject.plan, subject.plan.n_units
    share = np.float32(1.0)
    cases = []
    for a in range(n):
        for b in range(a + 1, n + 1):
            bounds = [r for r in ((0, a), (a, b), (b, n)) if r[0] < r[1]]
            index = bounds.index((a, b))
            stage = plan.build(index, bounds, 1)
            optimizer = subject.fresh_optimizer()
            apply = tf.function(
                lambda grads, s=stage, o=optimizer: o.apply_gradients(
                    zip(grads, s.variables, strict=True)
                )
            )
            if not stage.variables:  # weightless layers take no step, as in the executor
                apply = _no_step
            for samples in _sample_counts(batch):
                x_rows, y = subject.rows(samples)
                x = (
                    stage.first_inputs(x_rows)
                    if stage.first
                    else plan.stand_in(bounds, index, samples)
                )
                upstream = ones_upstream(stage, x, y, share)
                cases.append((a, b, samples, stage, apply, x, y, upstream))
    ops = ("F", "B", "BW", "STEP")
    times = {case[:3]: {op: [] for op in ops} for case in cases}
    for round_index in range(REPEATS + 1):  # the first traces
        for a, b, samples, stage, apply, x, y, upstream in cases:
            forward, backward = time_microbatch(stage, x, y, share, upstream)
            start = time.perf_counter()
            apply(stage.summed_gradients())
            step = time.perf_counter() - start
            if round_index:
                timed = times[(a, b, samples)]
                for op, seconds in (("F", forward), ("B", backward), ("BW", 0.0), ("STEP", step)):
                    timed[op].append(seconds)
    found = []
    for a, b in dict.fromkeys(key[:2] for key in times):  # the ranges, in order
        at = {
            samples: {op: median(v) for op, v in times[(a, b, samples)].items()}
            for samples in _sample_counts(batch)
        }
        fits = {op: fit_line({k: at[k][op] for k in at}) for op in ops}
        found.append({"start": a, "end": b, "seconds": fits})
    return found


def _no_step(_grads: list) -> None:
    return None


def _sample_counts(batch: int) -> tuple[int, int]:
    return max(1, batch // 16), max(2, batch // 2)


def _whole_step(subject, batch: int, tf) -> tuple[list, float]:
    """A data-parallel step's compute as ringtrain compiles it (forward, backward and the
    optimizer in one function, over the model as one stage), fitted as fixed + per sample;
    and the floats of optimizer state per weight that step's optimizer made (Adam's two
    moments, momentum's one): the kind a compiled model brings decides its memory, whatever
    its name."""
    whole = subject.plan.build(0, [(0, subject.plan.n_units)], 1)
    optimizer = subject.fresh_optimizer()
    share = np.float32(1.0)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = whole.output(x, y, share)
        grads = tape.gradient(loss, whole.variables, unconnected_gradients="zero")
        optimizer.apply_gradients(zip(grads, whole.variables, strict=True))
        return loss

    at = {}
    for n in _sample_counts(batch):
        x, y = subject.rows(n)
        x = whole.first_inputs(x)
        times = []
        for _ in range(REPEATS + 1):  # the first traces
            start = time.perf_counter()
            step(x, y).numpy()
            times.append(time.perf_counter() - start)
        at[n] = median(times[1:])
    params = sum(int(np.prod(v.shape)) for v in whole.variables)
    state = sum(int(np.prod(v.shape)) for v in optimizer.variables if len(v.shape))
    return fit_line(at), state / max(params, 1)


def _engine_steps(subject, args, world) -> tuple[dict[str, float], int]:
    """Seconds a step of ringtrain's own data-parallel engine takes here at the global batch
    (compute, Horovod's average of the gradients in the compiled step, the optimizer), without
    and with `--fp16-allreduce`; and the high-water mark after the first's opening block, a
    training rank's own, read before the second engine adds to it. The two take turns, a block
    of STEPS_TIMED steps after an untimed one each, for ENGINE_BLOCKS rounds, and each gives
    its median block, so a slow stretch of a noisy machine or link decides neither. What a
    step takes beyond its compute and a lone allreduce of the bytes it sends is the per-step
    cost the cost model adds to each data-parallel prediction of its kind."""
    from ringtrain.config import TrainConfig
    from ringtrain.data import epoch_batches

    def engine(kind: str):
        cfg = TrainConfig(
            model=args.model,
            dataset=args.dataset,
            optimizer=args.optimizer,
            batch_size=args.batch_size,
            seed=args.seed,
            fp16_allreduce=kind == "fp16",
        )
        return subject.engine(cfg, world)

    batches = epoch_batches(subject.n_examples, args.batch_size, args.seed, 0)
    # The epoch's batches, cycled when it is shorter than a block.
    block = np.resize(batches, (STEPS_TIMED + 1, batches.shape[1]))
    engines = {"float32": engine("float32")}
    blocks = {"float32": [timed_steps(engines["float32"].step, block) / 1e3]}
    peak = resident_bytes("VmHWM")
    engines["fp16"] = engine("fp16")
    blocks["fp16"] = [timed_steps(engines["fp16"].step, block) / 1e3]
    for _ in range(ENGINE_BLOCKS - 1):
        for kind, each in engines.items():
            blocks[kind].append(timed_steps(each.step, block) / 1e3)
    return {kind: median(seconds) for kind, seconds in blocks.items()}, peak


def _allreduce(comm, grad_bytes: int) -> list[tuple[int, float]]:
    """(bytes, seconds) of Horovod's allreduce at each size, as `bench allreduce` times it:
    the slowest rank's mean over REPEATS calls back to back, after a first that negotiates.
    The model's gradient bytes, and their half (fp16), are among the sizes, so the data-parallel
    predictions read a time measured at their own size."""
    fp16_bytes = grad_bytes // 8 * 4  # fp16 halves the bytes; timed as whole float32s
    sizes = sorted({*ALLREDUCE_SIZES, max(grad_bytes, 4), max(fp16_bytes, 4)})
    return [
        (n, slowest_rank_seconds(comm, horovod_sum(comm, np.ones(n // 4, np.float32)), REPEATS))
        for n in sizes
    ]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compute", action="store_true")
    parser.add_argument("--out", required=True)
    add_source_arguments(parser)
    args = parser.parse_args(argv)

    from ringtrain.runtime import start

    # Before anything imports TensorFlow: as in `ringtrain train`, MPI starts first, so the
    # baseline after TensorFlow's import holds MPI's own 15 MiB here too (not the step's peak).
    world = start(with_horovod=True)

    from ringtrain.comm import Link
    from ringtrain.heartbeat import gather_hosts
    from ringtrain.pipeline.calibrate import measure_link
    from ringtrain.pipeline.costs import MeasuredCurve
    from ringtrain.plan.subject import Subject
    from ringtrain.tensorflow_loader import RESIDENT_AFTER_IMPORT, tf

    subject = Subject(args)
    elements = _elements(subject)
    params = sum(e["params"] for e in elements)
    report: dict = {"hosts": gather_hosts(world.comm)}
    report["baseline_bytes"] = RESIDENT_AFTER_IMPORT
    if args.compute:  # ringtrain's data-parallel engine first: the high-water mark is its own
        report["engine_step_seconds"], peak = _engine_steps(subject, args, world)
        report["step_peak"] = [peak - RESIDENT_AFTER_IMPORT, args.batch_size / world.size]
        step = _whole_step(subject, args.batch_size, tf)
        report["step_seconds"], report["optimizer_slots"] = step
    world.comm.Barrier()
    allreduce = MeasuredCurve.of(_allreduce(world.comm, params * 4))
    p2p = measure_link(Link(world.comm, timeout=60.0), world.rank, P2P_SIZES, tag=7)
    report["allreduce"], report["p2p"] = allreduce.to_json(), p2p.to_json()
    report["elements"] = elements
    if args.compute:
        for element, seconds in zip(
            elements, _element_seconds(subject, args.batch_size), strict=True
        ):
            element["seconds"] = seconds
        report["stages"] = _stage_ranges(subject, args.batch_size, tf)
    if world.rank == 0:
        with open(args.out, "w") as out:
            json.dump(report, out)


if __name__ == "__main__":
    main(sys.argv[1:])
