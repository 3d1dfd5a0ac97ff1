"""The pipeline executor: interprets any lowered schedule for the stages this rank holds.

One method per action op (a dispatch table), so a new schedule is a new generator in
generators.py, never a new loop here. Each action names its stage; a rank holds one stage, or
several under interleaving or a user's schedule file, and hands tensors between its own stages
in memory. Used by `model` (one microbatch), `pipeline` and `hybrid` (stage gradients then
averaged over the stage's replicas with Horovod process sets).

A forward is one compiled call that keeps the microbatch's activations, and a backward one
compiled call that takes every gradient from them and adds the weights' into the stage's sums
in the same graph, with no eager tape (stage.py, calls.py). With `--recompute` the forward
keeps only the stage's input and the backward redoes it: less memory, a forward more. A stage
whose forward changes state (BatchNormalization, dropout) always keeps its activations.

Its neighbours hold the other jobs: a stage's pieces and codecs (stage.py), what stages are
cut from (split.py), the partition and its profiling (profile.py), the report (report.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ringtrain import log
from ringtrain.checkpoint import Checkpointable
from ringtrain.comm import Link, PostedReceive
from ringtrain.config import TrainConfig, pp_size_of
from ringtrain.data import take, uneven_shard
from ringtrain.dataparallel.collectives import average_gradients
from ringtrain.evaluate import CHUNK
from ringtrain.gradients import scaled_gradient
from ringtrain.keras_model.source import RESIDENT_BEFORE_MODEL
from ringtrain.optim import LearningRate, one_variable_at_a_time
from ringtrain.pipeline import report
from ringtrain.pipeline.calibrate import (
    measure_link,
)
from ringtrain.pipeline.costs import FREE_LINK
from ringtrain.pipeline.grid import Grid
from ringtrain.pipeline.ir import Action, Op, Tensor, carries, consumes, produces
from ringtrain.pipeline.lower import send_when_made
from ringtrain.pipeline.profile import (
    call_floor_seconds,
    choose_bounds,
    microbatch_seconds,
    untouched,
)
from ringtrain.pipeline.schedule import pipeline_schedule
from ringtrain.pipeline.simulate import SimResult, simulate
from ringtrain.pipeline.stage import share_tensors
from ringtrain.pipeline.tags import message_tag
from ringtrain.pipeline.trace import ALL, Trace
from ringtrain.proc import resident_bytes
from ringtrain.progress import progress_ticker
from ringtrain.runtime import World
from ringtrain.tensorflow_loader import tf

LOSS, WEIGHTS = 0, 1  # tags on the world communicator; pipeline tags are tags.message_tag's
KINDS = {"ACT": 0, "GRAD": 1}
SLOTS = 2  # receive buffers per kind and sending stage: one being waited on, one posted ahead


@dataclass
class Held:
    """A microbatch between its forward and the end of its backward on one stage."""

    x: tf.Tensor
    y: tf.Tensor
    share: tf.Tensor  # its share of the global batch's loss
    kept: object | None  # its kept activations (calls.Kept); None when the backward recomputes


class Inbox:
    """This rank's receives of one step, each posted into a preallocated buffer ahead of need.

    Receives of one kind from one stage form a queue in the order the list takes them, with a
    ring of SLOTS buffers: the first SLOTS are posted at the step's start, and each later one
    as soon as the one SLOTS before it is taken, so it is posted before the list reaches it
    (earlier than a blocking receive, so no schedule that runs with those can wait longer).
    Taking copies the data out, so a slot is free again at once. Memory stays two messages
    per neighbour and kind, whatever M is.
    """

    def __init__(self, link: Link, receives: list[Tensor], codec, largest: int, peer, tag):
        """`codec(t)` says how tensor t travels; `largest` is the most examples a microbatch
        holds, which sizes the buffers (a partial batch's microbatches send less)."""
        self.link, self.codec, self.peer, self.tag = link, codec, peer, tag
        self.queues: dict[tuple[str, int], list[Tensor]] = {}
        for t in receives:
            self.queues.setdefault((t.kind, t.stage), []).append(t)
        self.position = {t: i for queue in self.queues.values() for i, t in enumerate(queue)}
        self.step_bytes = sum(codec(t).nbytes(largest) for t in receives)
        self.slots = {
            key: [codec(q[0]).empty(largest) for _ in q[:SLOTS]] for key, q in self.queues.items()
        }
        self.posted: dict[Tensor, PostedReceive] = {}

    def post_step(self) -> None:
        """At a step's start: the first receives of every queue, as many as it has slots."""
        for key, slots in self.slots.items():
            for i in range(len(slots)):
                self._post(self.queues[key][i])

    def _post(self, t: Tensor) -> None:
        slots = self.slots[(t.kind, t.stage)]
        buf = slots[self.position[t] % len(slots)]
        self.posted[t] = self.link.post_receive(buf, self.peer(t), self.tag(t), _what(t))

    def take(self, t: Tensor, batch: int) -> tuple:
        """Wait for `t` (the comm deadline starts now), copy its `batch` examples out, post
        the queue's next. Returns the value and the seconds waited for it."""
        start = time.time()
        buf = self.link.complete(self.posted.pop(t))
        waited = time.time() - start
        value = self.codec(t).decode(buf, batch)
        key = (t.kind, t.stage)
        after = self.position[t] + len(self.slots[key])
        if after < len(self.queues[key]):
            self._post(self.queues[key][after])
        return value, waited


def _what(t: Tensor) -> str:
    """How a timeout names a message."""
    what = "activation" if t.kind == "ACT" else "gradient"
    return f"{what} of microbatch {t.mb} from stage {t.stage}"


class PipelineEngine(Checkpointable):
    """The stages one rank holds in one pipeline replica."""

    def __init__(self, plan, data, cfg: TrainConfig, world: World):
        """`plan`: the GraphPlan of a compiled model; `data`: a Dataset, or a UserData."""
        self.data, self.cfg, self.world = data, cfg, world
        self.plan = plan
        self.train = data.train  # the examples every global batch indexes
        self.grid = Grid(world.size, pp_size_of(cfg, world.size))
        self.pp_size, self.dp_size = self.grid.pp_size, self.grid.dp_size
        self.pp_rank, self.dp_rank = self.grid.pp_rank(world.rank), self.grid.dp_rank(world.rank)
        self.schedule = pipeline_schedule(cfg, self.pp_size)
        if not cfg.sync_sends:  # an Isend never blocks: each goes out as soon as it is made
            self.schedule = send_when_made(self.schedule)
        self.n_stages = self.schedule.n_stages
        self.pipe = world.comm.Split(color=self.dp_rank, key=self.pp_rank)
        self.link = Link(
            self.pipe,
            cfg.comm_timeout,
            cfg.sync_sends,
            name=lambda p: self._who(self.grid.pipeline_ranks(self.dp_rank)[p]),
            min_rate=cfg.min_link_rate,
        )
        self.world_link = Link(
            world.comm, cfg.comm_timeout, name=self._who, min_rate=cfg.min_link_rate
        )
        self.stage_set = world.process_sets[self.pp_rank] if world.process_sets else None
        if cfg.strategy == "hybrid":
            log.info(self.grid.describe())

        self.mb_size = -(-cfg.batch_size // self.dp_size // cfg.microbatches)  # the largest
        # With the time partition, rank 0 keeps each unit's timings for the calibration report.
        self.bounds, self.element_seconds = choose_bounds(
            self.plan, cfg, world, self.schedule, self.mb_size
        )
        self.local_stages = {  # the stages this rank holds, by index
            s: self.plan.build(s, self.bounds, cfg.microbatches)
            for s in self.schedule.stages_on(self.pp_rank)
        }
        self.plan.hold_only(self.local_stages, self.bounds)
        for stage in self.local_stages.values():
            stage.recomputes = cfg.recompute and not stage.stateful
        self.variables = [v for stage in self.local_stages.values() for v in stage.variables]
        self.state_variables = [v for stage in self.local_stages.values() for v in stage.weights]
        # what this rank added by building its part of the model (its stages and, on rank 0,
        # the time partition's units timed one at a time), before its optimizer's slots
        before = RESIDENT_BEFORE_MODEL[0]  # 0: the caller built the model (ringtrain.fit)
        self.model_resident = resident_bytes("VmHWM") - before if before else 0
        self.optimizer, self.clip_limit = self.plan.optimizer(cfg)
        stepping = self._stepping_optimizer()
        self.base_learning_rate = self.plan.base_learning_rate(self.optimizer, cfg)
        self.scorer = self.plan.scorer()
        self._lr = LearningRate(stepping)
        self._apply = tf.function(self._apply_gradients)

        self.actions = self.schedule.actions[self.pp_rank]
        self.predicted = simulate(self.schedule)
        # Bytes of stage s's output per microbatch (its gradient is as big): the boundaries.
        self.boundary_bytes = [
            self._codec(Tensor("ACT", s, 0)).nbytes(self.mb_size) for s in range(self.n_stages - 1)
        ]
        receives = [carries(a) for a in self.actions if a.op.is_recv]
        self.inbox = Inbox(self.link, receives, self._codec, self.mb_size, self._peer, self._tag)
        self.microbatch_bytes = self.inbox.step_bytes // cfg.microbatches
        self.dispatch = {
            Op.F: self._forward,
            Op.B: self._backward,
            Op.BI: self._backward_input,
            Op.BW: self._backward_weight,
            Op.SEND_ACT: self._send,
            Op.RECV_ACT: self._receive,
            Op.SEND_GRAD: self._send,
            Op.RECV_GRAD: self._receive,
            Op.REDUCE: self._reduce,
            Op.STEP: self._step_optimizer,
        }
        self.trace, self.step_index, self.peak_inflight = Trace(), 0, 0
        self.ticker = progress_ticker(self.pipe, cfg.mpi_progress)
        self.epoch_start = 0  # step_index where the epoch epoch_scalars() will report began
        self.link_model = FREE_LINK
        self.fixed_seconds: dict[tuple[int, Op], float] = {}  # (stage, F/B/BI/BW) -> seconds
        self.call_floor = 0.0  # seconds of a compiled call that does no work, when measured
        self.waited = 0.0  # seconds the current action spent blocked on a message
        if cfg.metrics_out or cfg.gantt or cfg.trace:  # a prediction, and the costs' split
            self.calibrate_link()
            self.fixed_seconds = self.measure_fixed_costs()
            self.call_floor = call_floor_seconds()
        # Each action's fixed cost for the trace: a message's or REDUCE's own work is all fixed.
        self.action_fixed = [
            ALL
            if a.op.is_message or a.op is Op.REDUCE
            else self.fixed_seconds.get((a.stage, a.op), 0.0)
            for a in self.actions
        ]

    def calibrate_link(self) -> None:
        """Time messages between the first two pipeline ranks (collective in the pipeline)."""
        sizes = (8, max(self.boundary_bytes, default=8))
        tag = message_tag(self.n_stages, self.cfg.microbatches, self.n_stages)  # above all
        self.link_model = measure_link(self.link, self.pp_rank, sizes, tag)

    def measure_fixed_costs(self) -> dict[tuple[int, Op], float]:
        """Each local stage's F and B on a 1-example microbatch (the median of 5, after one
        that traces): what a microbatch costs whatever its size, which the trace splits from
        each action's compute. The stage's state and gradient sums are left as they were."""
        fixed = {}
        y = tf.nest.map_structure(tf.constant, take(self.train.y, np.arange(1)))
        share = share_tensors([self.plan.loss_share(1, 1, 1)])[0]
        for s, stage in self.local_stages.items():
            if stage.first:
                x = stage.first_inputs(take(self.train.x, np.arange(1)))
            else:
                x = self.plan.stand_in(self.bounds, s, 1)
            with untouched(stage):
                seconds = microbatch_seconds(stage, x, y, share, repeats=5)
            fixed |= {(s, op): value for op, value in seconds.items()}
        return fixed

    def _who(self, rank: int) -> str:
        """How errors name a peer: its stages, and its rank for finding the process."""
        held = self.schedule.stages_on(self.grid.pp_rank(rank))
        label = "stage" if len(held) == 1 else "stages"
        return f"{label} {'+'.join(map(str, held))} (rank {rank})"

    def _codec(self, t: Tensor):
        """How stage t.stage's activation (ACT), or the gradient for its input (GRAD), travels."""
        return self.plan.codec(t, self.bounds)

    def _peer(self, t: Tensor) -> int:
        """The pipeline rank at the other end of `t`'s message, seen from this rank."""
        stage_ranks = self.schedule.stage_ranks
        if stage_ranks[t.stage] == self.pp_rank:
            return stage_ranks[t.consumer]
        return stage_ranks[t.stage]

    def _tag(self, t: Tensor) -> int:
        return message_tag(t.stage, self.cfg.microbatches, t.mb, KINDS[t.kind])

    # ---- one optimizer step -------------------------------------------------------------
    def set_learning_rate(self, lr: float) -> None:
        self._lr.set(lr)

    def reads(self, global_indices: np.ndarray) -> np.ndarray:
        """The replica's share, where this rank holds its first or last stage."""
        if not any(s.first or s.last for s in self.local_stages.values()):
            return global_indices[:0]
        return uneven_shard(global_indices, self.dp_rank, self.dp_size)

    def step(self, global_indices: np.ndarray) -> float:
        mine = uneven_shard(global_indices, self.dp_rank, self.dp_size)
        micro = self.cfg.microbatches
        self.microbatches = [uneven_shard(mine, m, micro) for m in range(micro)]
        self.shares = share_tensors(
            [
                self.plan.loss_share(len(idx), len(global_indices), self.dp_size)
                for idx in self.microbatches
            ]
        )
        for stage in self.local_stages.values():
            stage.grads = None
        self.loss, self.stepped = 0.0, 0
        self.inflight: dict[tuple[int, int], Held] = {}
        self.ready: dict[Tensor, tf.Tensor] = {}  # received or handed over within this rank
        self.outbox: dict[Tensor, tf.Tensor] = {}  # computed, for a send action to take
        self.inbox.post_step()
        with self.ticker:
            for action, fixed in zip(self.actions, self.action_fixed, strict=True):
                start, self.waited = time.time(), 0.0
                self.dispatch[action.op](action)
                code, mb, stage = action.op.code, action.mb, action.stage
                self.trace.record(self.step_index, code, mb, start, stage, fixed, self.waited)
        self.step_index += 1
        return self._loss_to_rank0()

    def _reduce(self, a: Action) -> None:
        """REDUCE: once this stage's messages are out, average its gradients over replicas."""
        start = time.time()
        self.link.flush()
        self.waited = time.time() - start
        stage = self.local_stages[a.stage]
        stage.grads = self._average_over_replicas(stage.summed_gradients())

    def _step_optimizer(self, _a: Action) -> None:
        """STEP: at the rank's last one, clip by the norm over all stages, then apply (one
        collective per rank and step, however many stages each rank holds)."""
        self.stepped += 1
        if self.stepped < len(self.local_stages):
            return
        grads = self._clip([g for stage in self.local_stages.values() for g in stage.grads])
        if self.variables:  # none on a rank that holds only frozen layers
            self._apply(grads)

    def _stepping_optimizer(self):
        """The optimizer that applies this rank's averaged gradients, built: here the compiled
        one, with a slot for each of its stages' weights."""
        self.optimizer.build(self.variables)
        one_variable_at_a_time(self.optimizer)
        return self.optimizer

    def _apply_gradients(self, grads: list) -> None:
        """Compiled: applied eagerly, Adam's per-variable ops cost 0.2 s a step on the
        transformer, several times its stage's compute."""
        self.optimizer.apply_gradients(zip(grads, self.variables, strict=True))

    def _average_over_replicas(self, grads: list) -> list:
        if self.stage_set is None or self.dp_size == 1 or not grads:
            return grads
        start = time.time()
        grads = average_gradients(self.world.hvd, grads, self.cfg.fp16_allreduce, self.stage_set)
        self.trace.record(self.step_index, "ALLREDUCE", -1, start, wait=time.time() - start)
        return grads

    def _clip(self, grads: list) -> list:
        """Clip by the norm over all stages: the same scaling single-process clipping applies."""
        if self.clip_limit is None:
            return grads
        squares = np.array(
            [sum(float(tf.reduce_sum(tf.square(tf.convert_to_tensor(g)))) for g in grads)]
        )
        self.pipe.Allreduce(np.copy(squares), squares)
        norm, limit = float(np.sqrt(squares[0])), self.clip_limit
        return [scaled_gradient(g, limit / max(norm, limit)) for g in grads]

    def _loss_to_rank0(self) -> float:
        """Each replica's rank holding the last stage sends its loss to rank 0 as a buffer;
        rank 0 averages."""
        holder = self.schedule.stage_ranks[-1]
        last_ranks = [self.grid.pipeline_ranks(d)[holder] for d in range(self.dp_size)]
        value = np.array([self.loss], np.float64)
        if self.world.rank == 0:
            total = 0.0
            for r in last_ranks:
                total += (
                    value[0]
                    if r == 0
                    else self.world_link.recv_buffer(np.empty(1), r, LOSS, "the step's loss")[0]
                )
            return total / self.dp_size
        if self.pp_rank == holder:
            self.world_link.send_buffer(value, 0, LOSS, "the step's loss")
            self.world_link.flush()
        return float("nan")

    # ---- the actions ----------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        stage, idx = self.local_stages[a.stage], self.microbatches[a.mb]
        # Only the last stage reads labels (from the shared batch order: they never travel
        # through the pipe), and only stage 0 reads features.
        y = tf.nest.map_structure(tf.constant, take(self.train.y, idx)) if stage.last else None
        if stage.first:
            x = stage.first_inputs(take(self.train.x, idx))
        else:
            x = self.ready.pop(consumes(a, self.n_stages))
        share = self.shares[a.mb]
        out, kept = stage.forward(x, y, share)
        if stage.last:
            self.loss += float(out)
        self.inflight[(a.stage, a.mb)] = Held(x, y, share, kept)
        self.peak_inflight = max(self.peak_inflight, len(self.inflight))
        self._hand_on(a, out)

    def _backward(self, a: Action) -> None:
        self._hand_on(a, self._whole_backward(a, self.inflight.pop((a.stage, a.mb))))

    def _backward_input(self, a: Action) -> None:
        """BI: the input gradient, handed upstream at once. The same backward makes the
        weight gradients and adds them (a second pass would cost a whole B): BW has no
        compute left."""
        self._hand_on(a, self._whole_backward(a, self.inflight[(a.stage, a.mb)]))

    def _backward_weight(self, a: Action) -> None:
        """BW: the microbatch's activations are released."""
        del self.inflight[(a.stage, a.mb)]

    def _whole_backward(self, a: Action, held: Held):
        """Every gradient of one microbatch, the weights' added into the stage's sums;
        returns the input gradient."""
        stage, upstream = self.local_stages[a.stage], self._upstream(a)
        return stage.backward(held.kept, held.x, held.y, held.share, upstream)

    def _upstream(self, a: Action) -> tf.Tensor | None:
        """The gradient of the stage's output: received, handed over, or none (the loss)."""
        need = consumes(a, self.n_stages)
        return None if need is None else self.ready.pop(need)

    def _hand_on(self, a: Action, value: tf.Tensor | None) -> None:
        """What a computation made for a neighbouring stage: kept for a send, or, when that
        stage is on this rank too, handed over in memory."""
        made = produces(a, self.n_stages)
        if made is None:
            return
        mine = self.schedule.stage_ranks[made.consumer] == self.pp_rank
        (self.ready if mine else self.outbox)[made] = value

    def _send(self, a: Action) -> None:
        t = carries(a)
        out = self._codec(t).encode(self.outbox.pop(t))
        self.link.send_buffer(out, self._peer(t), self._tag(t), _what(t))

    def _receive(self, a: Action) -> None:
        t = carries(a)
        self.ready[t], self.waited = self.inbox.take(t, len(self.microbatches[t.mb]))

    # ---- evaluation, weights, metrics ---------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Forward-only pass through the stages in order; nothing gathers the whole model.
        The last stage scores (collective: every rank gets the scores)."""
        held_out = self.data.validation
        if held_out is None:
            return {}
        mine = np.arange(len(held_out))[self.dp_rank :: self.dp_size]
        stage_ranks = self.schedule.stage_ranks
        self.scorer.reset()
        for start in range(0, len(mine), CHUNK):
            idx = mine[start : start + CHUNK]
            x, y = held_out.take(idx)
            value = None  # stage 0's input, then each stage's output in turn
            for s, stage in self.local_stages.items():
                if stage.first:
                    value = stage.first_inputs(x)
                elif stage_ranks[s - 1] != self.pp_rank:
                    codec = self._codec(Tensor("ACT", s - 1, 0))
                    buf = codec.empty(len(idx))
                    tag = self._evaluation_tag(s - 1)
                    self.link.recv_buffer(buf, stage_ranks[s - 1], tag, "evaluation activations")
                    value = codec.decode(buf, len(idx))
                value = stage.infer(value)
                if stage.last:
                    self.scorer.update(value, y)
                elif stage_ranks[s + 1] != self.pp_rank:
                    out = self._codec(Tensor("ACT", s, 0)).encode(value)
                    tag = self._evaluation_tag(s)
                    self.link.send_buffer(out, stage_ranks[s + 1], tag, "evaluation activations")
                    self.link.flush()
        return self.scorer.result(self.world.comm)

    def _evaluation_tag(self, stage: int) -> int:
        """Above every training message's tag, one per sending stage."""
        return message_tag(self.n_stages, self.cfg.microbatches, stage)

    def gather_weights(self) -> dict[str, np.ndarray] | None:
        """Replica 0's stages send their weights to rank 0 under the single-process names."""
        mine = {v.path: v.numpy() for v in self.state_variables}
        if self.dp_rank != 0:
            return None
        if self.world.rank != 0:
            self.world_link.send_named(mine, 0, WEIGHTS, "weights")
            self.world_link.flush()
            return None
        weights = dict(mine)
        for r in self.grid.pipeline_ranks(0)[1:]:
            weights |= self.world_link.recv_named(r, WEIGHTS, "weights")
        return {k: weights[k] for k in sorted(weights)}

    def layout(self) -> dict:
        return {
            "layout": "stages",
            "stages": self.n_stages,
            "stage_ranks": list(self.schedule.stage_ranks),
            "partition": [list(b) for b in self.bounds],
        }

    def checkpoint_part(self) -> str | None:
        """One replica per stage writes; the others hold the same weights."""
        return self.read_part() if self.dp_rank == 0 else None

    def read_part(self) -> str:
        """`stage1`, or `stage0+2` for a rank holding several stages."""
        return "stage" + "+".join(map(str, self.local_stages))

    def epoch_scalars(self) -> dict[str, float]:
        return report.epoch_scalars(self)

    def prediction(self, rows: np.ndarray, steps: list[int]) -> tuple[SimResult, dict]:
        return report.prediction(self, rows, steps)

    def extra_metrics(self) -> dict:
        return report.run_metrics(self)
