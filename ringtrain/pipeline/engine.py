"""The pipeline executor: interprets any lowered schedule for this rank's stage.

One method per action op (a dispatch table), so a new schedule is a new generator in
generators.py, never a new loop here. Used by `model` (one microbatch), `pipeline` and `hybrid`
(stage gradients then averaged over the stage's replicas with Horovod process sets).
"""

from __future__ import annotations

import json
import time

import numpy as np

from ringtrain import log
from ringtrain.checkpoint import Checkpointable
from ringtrain.comm import Link
from ringtrain.config import TrainConfig, pipeline_stages
from ringtrain.data import Dataset, shard
from ringtrain.dataparallel.collectives import average_gradients
from ringtrain.evaluate import count_accuracy
from ringtrain.models import ModelSpec, forward, loss_fn, trainable_variables
from ringtrain.optim import make_optimizer
from ringtrain.pipeline import partition
from ringtrain.pipeline.grid import Grid
from ringtrain.pipeline.schedule import build_schedule
from ringtrain.pipeline.simulate import simulate
from ringtrain.pipeline.trace import Trace, measured_bubble, timeline, write_chrome_trace
from ringtrain.runtime import World
from ringtrain.tensorflow_loader import tf
from ringtrain.weights import replica_checksums

ACT, GRAD, EVAL, LOSS, WEIGHTS = 0, 1, 2, 3, 4  # message kinds; tag = 8 * microbatch + kind


def _tag(kind: int, mb: int = 0) -> int:
    return 8 * mb + kind


class PipelineEngine(Checkpointable):
    """One stage of one pipeline replica."""

    def __init__(self, spec: ModelSpec, data: Dataset, cfg: TrainConfig, world: World):
        self.data, self.cfg, self.world = data, cfg, world
        self.grid = Grid(world.size, pipeline_stages(cfg, world.size))
        self.stages, self.replicas = self.grid.stages, self.grid.replicas
        self.stage, self.replica = self.grid.stage_of(world.rank), self.grid.replica_of(world.rank)
        self.pipe = world.comm.Split(color=self.replica, key=self.stage)
        self.link = Link(
            self.pipe,
            cfg.comm_timeout,
            cfg.sync_sends,
            name=lambda s: self._who(self.grid.pipeline_ranks(self.replica)[s]),
            min_rate=cfg.min_link_rate,
        )
        self.world_link = Link(
            world.comm, cfg.comm_timeout, name=self._who, min_rate=cfg.min_link_rate
        )
        self.stage_set = world.process_sets[self.stage] if world.process_sets else None
        if cfg.strategy == "hybrid":
            log.info(self.grid.describe())

        self.mb_size = cfg.batch_size // self.replicas // cfg.microbatches
        self.bounds = self._partition(spec)
        first, last = self.bounds[self.stage]
        self.first_stage, self.last_stage = self.stage == 0, self.stage == self.stages - 1
        self.elements = spec.build(range(first, last), cfg.seed)
        self.variables = trainable_variables(self.elements)
        self.optimizer = make_optimizer(cfg)
        self.optimizer.build(self.variables)

        self.schedule = build_schedule(cfg.schedule, self.stages, cfg.microbatches)
        self.actions = self.schedule.actions[self.stage]
        self.predicted = simulate(self.schedule)
        shapes = spec.shapes()
        # Receive buffers, preallocated: a microbatch's input lives until its backward, and at
        # most peak_inflight consecutive microbatches are alive, so mb % slots never collides.
        slots = self.predicted.peak_inflight[self.stage]
        self.act_in = np.zeros((slots, self.mb_size, *shapes[first]), np.float32)
        self.grad_in = np.zeros((self.mb_size, *shapes[last]), np.float32)
        self.dispatch = {
            "F": self._forward,
            "B": self._backward,
            "BI": self._backward_input,
            "BW": self._backward_weight,
            "SEND_ACT": self._send_act,
            "RECV_ACT": self._recv_act,
            "SEND_GRAD": self._send_grad,
            "RECV_GRAD": self._recv_grad,
            "REDUCE": self._reduce,
            "STEP": self._step_optimizer,
        }
        self.trace, self.step_index, self.peak_inflight = Trace(), 0, 0
        self.epoch_start = 0  # step_index where the epoch epoch_scalars() will report began
        # Graphs, not eager ops: per-op Python overhead would dwarf a microbatch's compute.
        self._compiled_output = tf.function(self._stage_output)
        self._compiled_gradients = tf.function(self._stage_gradients)

    def _who(self, rank: int) -> str:
        """How errors name a peer: its stage, and its rank for finding the process."""
        return f"stage {self.grid.stage_of(rank)} (rank {rank})"

    def _partition(self, spec: ModelSpec) -> list[tuple[int, int]]:
        method = self.cfg.partition
        if method == "uniform":
            bounds, costs = partition.uniform(len(spec), self.stages), None
        else:
            costs = self._element_costs(spec, method)
            bounds = partition.balanced(costs, self.stages)
        log.info(f"partition ({method}): {partition.describe(bounds, costs)}")
        return bounds

    def _element_costs(self, spec: ModelSpec, method: str) -> list[float]:
        """Parameter counts, or forward+backward seconds measured on rank 0 and broadcast so
        every rank splits identically. Elements are built one at a time and dropped."""
        costs = np.zeros(len(spec), np.float64)
        if method == "params" or self.world.rank == 0:
            shapes = spec.shapes()
            for i in range(len(spec)):
                element = spec.build([i], self.cfg.seed)[0]
                if method == "params":
                    costs[i] = sum(int(np.prod(v.shape)) for v in element.trainable_weights)
                else:
                    costs[i] = _time_element(element, (self.mb_size, *shapes[i]))
        if method == "time":
            self.world.comm.Bcast(costs, root=0)
        return costs.tolist()

    # ---- one optimizer step -------------------------------------------------------------
    def set_learning_rate(self, lr: float) -> None:
        self.optimizer.learning_rate.assign(lr)

    def step(self, global_indices: np.ndarray) -> float:
        mine = shard(global_indices, self.replica, self.replicas)
        self.microbatches = [
            shard(mine, m, self.cfg.microbatches) for m in range(self.cfg.microbatches)
        ]
        self.grads = [tf.zeros_like(v) for v in self.variables]
        self.loss, self.inflight, self.received, self.input_grads = 0.0, {}, {}, {}
        self.output_grads = {}  # split backwards: BI's output gradient, kept for BW
        for action in self.actions:
            start = time.time()
            self.dispatch[action.op](action.mb)
            self.trace.record(self.step_index, action.code, action.mb, start)
        self.step_index += 1
        return self._loss_to_rank0()

    def _reduce(self, _mb: None) -> None:
        """REDUCE: once this stage's messages are out, average its gradients over replicas."""
        self.link.flush()
        self.grads = self._average_over_replicas(self.grads)

    def _step_optimizer(self, _mb: None) -> None:
        """STEP: clip by the norm over all stages, then apply."""
        grads = self._clip(self.grads)
        self.optimizer.apply_gradients(zip(grads, self.variables, strict=True))

    def _average_over_replicas(self, grads: list) -> list:
        if self.stage_set is None or self.replicas == 1:
            return grads
        start = time.time()
        grads = average_gradients(self.world.hvd, grads, self.cfg.fp16_allreduce, self.stage_set)
        self.trace.record(self.step_index, "ALLREDUCE", -1, start)
        return grads

    def _clip(self, grads: list) -> list:
        """Clip by the norm over all stages: the same scaling single-process clipping applies."""
        if self.cfg.clip_norm is None:
            return grads
        squares = np.array([sum(float(tf.reduce_sum(tf.square(g))) for g in grads)])
        self.pipe.Allreduce(np.copy(squares), squares)
        norm, limit = float(np.sqrt(squares[0])), self.cfg.clip_norm
        return [g * (limit / max(norm, limit)) for g in grads]

    def _loss_to_rank0(self) -> float:
        """Each replica's last stage sends its loss to rank 0 as a buffer; rank 0 averages."""
        last_ranks = [self.grid.pipeline_ranks(d)[-1] for d in range(self.replicas)]
        value = np.array([self.loss], np.float64)
        if self.world.rank == 0:
            total = 0.0
            for r in last_ranks:
                total += (
                    value[0]
                    if r == 0
                    else self.world_link.recv_buffer(np.empty(1), r, _tag(LOSS), "the step's loss")[
                        0
                    ]
                )
            return total / self.replicas
        if self.last_stage:
            self.world_link.send_buffer(value, 0, _tag(LOSS), "the step's loss")
            self.world_link.flush()
        return float("nan")

    # ---- the actions ----------------------------------------------------------------------
    def _stage_output(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        """The activation sent downstream or, on the last stage, its share of the loss."""
        out = forward(self.elements, x)
        return loss_fn(y, out) / self.cfg.microbatches if self.last_stage else out

    def _stage_gradients(
        self, x: tf.Tensor, y: tf.Tensor, upstream: tf.Tensor, weights=True, inputs=True
    ) -> list:
        """Recomputes the forward under a tape (the inputs were kept, not the tape), then the
        weight gradients and, except on stage 0, the input gradient to send upstream: both for
        a full backward (B), only one for each half of a split one (BI, BW)."""
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = self._stage_output(x, y)
        sources = (self.variables if weights else []) + (
            [x] if inputs and not self.first_stage else []
        )
        return tape.gradient(out, sources, output_gradients=None if self.last_stage else upstream)

    def _forward(self, mb: int) -> None:
        idx = self.microbatches[mb]
        x = tf.constant(self.data.x[idx]) if self.first_stage else self.received.pop(mb)
        y = tf.constant(self.data.y[idx])  # labels come from the shared batch order, not a peer
        out = self._compiled_output(x, y)
        if self.last_stage:
            self.loss += float(out)
        self.inflight[mb] = (x, y, out)
        self.peak_inflight = max(self.peak_inflight, len(self.inflight))

    def _backward(self, mb: int) -> None:
        x, y, _ = self.inflight.pop(mb)
        grads = self._compiled_gradients(x, y, tf.constant(self.grad_in))
        self._accumulate(grads[: len(self.variables)])
        if not self.first_stage:
            self.input_grads[mb] = grads[-1]

    def _backward_input(self, mb: int) -> None:
        """BI: only the input gradient, sent upstream at once. BW needs the output gradient
        later, so it is copied: the receive buffer takes the next microbatch's."""
        x, y, _ = self.inflight[mb]
        self.output_grads[mb] = tf.constant(self.grad_in)
        if not self.first_stage:
            grads = self._compiled_gradients(x, y, self.output_grads[mb], False, True)
            self.input_grads[mb] = grads[0]

    def _backward_weight(self, mb: int) -> None:
        """BW: the weight gradients; the microbatch's activations are released here."""
        x, y, _ = self.inflight.pop(mb)
        self._accumulate(self._compiled_gradients(x, y, self.output_grads.pop(mb), True, False))

    def _accumulate(self, grads: list) -> None:
        self.grads = [a + g for a, g in zip(self.grads, grads, strict=True)]

    def _send_act(self, mb: int) -> None:
        out = np.ascontiguousarray(self.inflight[mb][2].numpy())
        self.link.send_buffer(out, self.stage + 1, _tag(ACT, mb), f"activation of microbatch {mb}")

    def _recv_act(self, mb: int) -> None:
        buf = self.act_in[mb % len(self.act_in)]
        self.link.recv_buffer(buf, self.stage - 1, _tag(ACT, mb), f"activation of microbatch {mb}")
        self.received[mb] = tf.constant(buf)

    def _send_grad(self, mb: int) -> None:
        grad = np.ascontiguousarray(self.input_grads.pop(mb).numpy())
        self.link.send_buffer(grad, self.stage - 1, _tag(GRAD, mb), f"gradient of microbatch {mb}")

    def _recv_grad(self, mb: int) -> None:
        self.link.recv_buffer(
            self.grad_in, self.stage + 1, _tag(GRAD, mb), f"gradient of microbatch {mb}"
        )

    # ---- evaluation, weights, metrics ---------------------------------------------------
    def evaluate(self) -> float:
        """Forward-only pass through the stages; nothing gathers the whole model."""
        mine = np.arange(len(self.data.x_test))[self.replica :: self.replicas]
        correct = 0
        for start in range(0, len(mine), 512):
            idx = mine[start : start + 512]
            if self.first_stage:
                x = self.data.x_test[idx]
            else:
                x = np.empty((len(idx), *self.act_in.shape[2:]), np.float32)
                self.link.recv_buffer(x, self.stage - 1, _tag(EVAL), "evaluation activations")
            out = forward(self.elements, tf.constant(x)).numpy()
            if self.last_stage:
                correct += int(np.sum(np.argmax(out, axis=-1) == self.data.y_test[idx]))
            else:
                self.link.send_buffer(
                    np.ascontiguousarray(out), self.stage + 1, _tag(EVAL), "evaluation activations"
                )
                self.link.flush()
        total = len(mine) if self.last_stage else 0
        return count_accuracy(self.world.comm, correct, total)

    def gather_weights(self) -> dict[str, np.ndarray] | None:
        """Replica 0's stages send their weights to rank 0 under the single-process names."""
        mine = {v.path: v.numpy() for v in self.variables}
        if self.replica != 0:
            return None
        if self.world.rank != 0:
            header = json.dumps([[k, list(a.shape)] for k, a in mine.items()]).encode()
            flat = np.concatenate([a.ravel() for a in mine.values()]).astype(np.float32)
            for buf in (np.array([len(header)], np.int64), np.frombuffer(header, np.uint8), flat):
                self.world_link.send_buffer(np.ascontiguousarray(buf), 0, _tag(WEIGHTS), "weights")
                self.world_link.flush()
            return None
        weights = dict(mine)
        for r in self.grid.pipeline_ranks(0)[1:]:
            size = self.world_link.recv_buffer(np.empty(1, np.int64), r, _tag(WEIGHTS), "weights")
            header = self.world_link.recv_buffer(
                np.empty(int(size[0]), np.uint8), r, _tag(WEIGHTS), "weights"
            )
            names = json.loads(header.tobytes())
            flat = np.empty(sum(int(np.prod(s)) for _, s in names), np.float32)
            self.world_link.recv_buffer(flat, r, _tag(WEIGHTS), "weights")
            offset = 0
            for name, shape in names:
                n = int(np.prod(shape))
                weights[name] = flat[offset : offset + n].reshape(shape)
                offset += n
        return {k: weights[k] for k in sorted(weights)}

    def layout(self) -> dict:
        return {
            "layout": "stages",
            "stages": self.stages,
            "partition": [list(b) for b in self.bounds],
        }

    def checkpoint_part(self) -> str | None:
        """One replica per stage writes; the others hold the same weights."""
        return f"stage{self.stage}" if self.replica == 0 else None

    def read_part(self) -> str:
        return f"stage{self.stage}"

    def epoch_scalars(self) -> dict[str, float]:
        """The bubble measured over this epoch's steps (collective: rank 0 gets the value).
        The process's first step is left out, as in the run's figure: it includes tracing."""
        rows = self.trace.gather(self.world.comm, since=self.epoch_start)
        first, self.epoch_start = self.epoch_start, self.step_index
        if rows is None:
            return {}
        return {"bubble_measured": measured_bubble(rows, self.stages, skip_first=first == 0)}

    def extra_metrics(self) -> dict:
        rows = self.trace.gather(self.world.comm)
        peaks = np.zeros(self.world.size, np.int64)
        self.world.comm.Allgather(np.array([self.peak_inflight], np.int64), peaks)
        checksums = replica_checksums(self.world.comm, self.variables)
        if rows is None:
            return {}
        if self.cfg.trace:
            write_chrome_trace(rows, self.stages, self.cfg.trace)
        if self.cfg.gantt:
            from ringtrain.pipeline.gantt import draw_gantt

            draw_gantt(
                timeline(rows, self.stages, self.step_index - 1),
                self.cfg.gantt,
                f"{self.cfg.schedule} P={self.stages} M={self.cfg.microbatches} (measured)",
            )
        return {
            "schedule": self.cfg.schedule,
            "microbatches": self.cfg.microbatches,
            "pp_size": self.stages,
            "dp_size": self.replicas,
            "partition": [list(b) for b in self.bounds],
            "bubble_measured": measured_bubble(rows, self.stages),
            "bubble_predicted": self.predicted.bubble,
            "peak_inflight": peaks.tolist(),
            "replica_checksums": checksums,
        }


def _time_element(element, input_shape: tuple[int, ...], repeats: int = 3) -> float:
    """Median seconds of one forward+backward of an element on a microbatch-sized input."""
    x = tf.random.normal(input_shape)
    timings = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = element(x)
        tape.gradient(out, element.trainable_weights + [x])
        timings.append(time.perf_counter() - start)
    return float(np.median(timings[1:]))
