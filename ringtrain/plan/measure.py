"""`ringtrain plan calibrate`'s ranks (2, under mpirun): what the cost model needs, measured.

Both ranks compute at once, as in training, and rank 0 reports. A data-parallel step's compute
is timed as one compiled function over the whole model, the way ringtrain runs it; each
element's F, B, BI and BW the way the pipeline executor runs them. Both at two sample counts (a
16th and a half of the global batch: the microbatches and per-rank batches the planner
considers lie between), fitted as fixed + per-sample seconds. Horovod's allreduce is timed at
several sizes up to the model's gradient bytes and fitted to latency + bytes / rate;
point-to-point messages by the pipeline's own ping-pong (pipeline.calibrate). The resident set
after TensorFlow's import is the baseline a rank pays before any model, and the high-water mark
after the data-parallel step (and one allreduce of its gradients) what that step adds at half
the batch. Rank 0 writes the JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from statistics import median

import numpy as np

ALLREDUCE_SIZES = (4 << 10, 256 << 10, 4 << 20)
P2P_SIZES = (64, 64 << 10, 1 << 20)
REPEATS = 8


def _elements(spec, batch: int, seed: int, timed: bool) -> list[dict]:
    """Each element's parameters and per-sample input and output sizes, and if `timed` its
    F, B, BI and BW seconds as fixed + per sample."""
    from ringtrain.pipeline.engine import time_element

    shapes = spec.shapes()
    found = []
    for i in range(len(spec)):
        element = spec.build([i], seed)[0]
        found.append(
            {
                "params": sum(int(np.prod(v.shape)) for v in element.trainable_weights),
                "input_floats": int(np.prod(shapes[i])),
                "output_floats": int(np.prod(shapes[i + 1])),
            }
        )
        if timed:
            at = {n: time_element(element, (n, *shapes[i])) for n in _sample_counts(batch)}
            ops = next(iter(at.values()))
            found[-1]["seconds"] = {op: _fit({n: at[n][op] for n in at}) for op in ops}
    return found


def _fit(seconds_at: dict[int, float]) -> list[float]:
    """[fixed, per sample] through the two sample counts measured."""
    (small, t_small), (large, t_large) = sorted(seconds_at.items())
    slope = (t_large - t_small) / (large - small)
    return [t_small - slope * small, slope]


def _sample_counts(batch: int) -> tuple[int, int]:
    return max(1, batch // 16), max(2, batch // 2)


def _whole_step(spec, optimizer_name: str, batch: int, seed: int, tf) -> list[float]:
    """A data-parallel step's compute as ringtrain compiles it (forward, backward and the
    optimizer in one function, no allreduce), fitted as fixed + per sample."""
    import keras

    from ringtrain.models import forward, loss_fn, trainable_variables

    elements = spec.build(range(len(spec)), seed)
    variables = trainable_variables(elements)
    kind = keras.optimizers.SGD if optimizer_name == "sgd" else keras.optimizers.Adam
    optimizer = kind(learning_rate=1e-6)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, forward(elements, x))
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
        return loss

    at = {}
    for n in _sample_counts(batch):
        x = tf.random.normal((n, *spec.input_shape))
        y = tf.zeros((n,), tf.int32)
        times = []
        for _ in range(REPEATS + 1):  # the first traces
            start = time.perf_counter()
            step(x, y).numpy()
            times.append(time.perf_counter() - start)
        at[n] = median(times[1:])
    return _fit(at)


def _allreduce(hvd, tf, grad_bytes: int) -> list[tuple[int, float]]:
    samples = []
    for nbytes in sorted({*ALLREDUCE_SIZES, max(grad_bytes, 4)}):
        tensor = tf.ones([nbytes // 4], tf.float32)
        times = []
        for _ in range(REPEATS + 1):  # the first negotiates and allocates
            start = time.perf_counter()
            hvd.allreduce(tensor, op=hvd.Sum).numpy()
            times.append(time.perf_counter() - start)
        samples.append((nbytes, median(times[1:])))
    return samples


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compute", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from ringtrain.comm import Link
    from ringtrain.data import load_dataset
    from ringtrain.models import BUILTIN
    from ringtrain.pipeline.calibrate import ping_pong
    from ringtrain.pipeline.costs import LinkModel
    from ringtrain.runtime import resident_bytes, start
    from ringtrain.tensorflow_loader import RESIDENT_AFTER_IMPORT, tf

    world = start(with_horovod=True)
    data = load_dataset(args.dataset, args.seed)
    spec = BUILTIN[args.model](data.input_shape, data.n_classes)
    elements = _elements(spec, args.batch_size, args.seed, timed=False)
    params = sum(e["params"] for e in elements)
    report: dict = {"hosts": world.comm.allgather(socket.gethostname())}
    report["baseline_bytes"] = RESIDENT_AFTER_IMPORT
    if args.compute:  # a data-parallel step first, so the high-water mark is its alone
        report["step_seconds"] = _whole_step(spec, args.optimizer, args.batch_size, args.seed, tf)
        world.hvd.allreduce(tf.zeros([params]), op=world.hvd.Sum).numpy()
        report["step_peak"] = [
            resident_bytes("VmHWM") - RESIDENT_AFTER_IMPORT,
            _sample_counts(args.batch_size)[1],
        ]
    world.comm.Barrier()
    allreduce = LinkModel.fit(_allreduce(world.hvd, tf, params * 4))
    p2p = ping_pong(Link(world.comm, timeout=60.0), world.rank, P2P_SIZES, tag=7)
    report["allreduce"], report["p2p"] = allreduce.to_json(), p2p.to_json()
    report["elements"] = _elements(spec, args.batch_size, args.seed, timed=args.compute)
    if world.rank == 0:
        with open(args.out, "w") as out:
            json.dump(report, out)


if __name__ == "__main__":
    main(sys.argv[1:])
