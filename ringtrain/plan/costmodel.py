"""The cost model behind `ringtrain plan`: a step's time and a rank's memory from a calibration.

Pure Python (neither TensorFlow nor MPI), so it is unit-tested in milliseconds on synthetic
calibrations with known answers. The pieces are the ones the rest of ringtrain predicts with:

- compute: a whole-model compiled step (data parallel), every contiguous range of elements run
  as a pipeline stage (F, B, the adds a BW is once BI made every gradient, the optimizer STEP),
  and each element's F + B (to split the model where the executor's time partition will), all
  fitted as fixed + per_sample x samples (two batch sizes measured by `plan calibrate`);
- data parallel: the no-overlap roofline, compute + ring allreduce of the gradient bytes, which
  is how ringtrain's default step runs (one allreduce after the backward); the same function
  gives the bench's limits (`roofline`). Plus what the engine's own step took beyond (or
  short of) those two in calibration (Calibration.step_overhead, with and without fp16), taken
  as the same at every D;
- pipelines: the schedule replayed by the pipeline simulator with measured costs
  (pipeline.costs.predict), each action's cost beyond its compute taken from two short runs of
  the executor itself (executor_overhead), the replica average of a hybrid grid added after;
- memory per rank: weights, gradients and optimizer state of the rank's elements, plus
  activations: every element's input and output for each microbatch in flight at the peak the
  schedule reaches (the saved tapes hold at least those), plus the process's baseline after
  TensorFlow's import and the runtime's own share, both measured: after a data-parallel step
  (Calibration.runtime_bytes) and in the executor's reference runs (pipeline_runtime_bytes).

A ring allreduce over D ranks runs 2(D-1) steps, each moving 1/D of the bytes through every
link. Calibration times Horovod's allreduce on D = 2 at several sizes (a measured curve), and
two of its steps move 1/D of the bytes each, as one D = 2 allreduce of 2/D of them does: so D
ranks take D - 1 times a D = 2 allreduce of 2/D of the bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ringtrain.errors import UserError
from ringtrain.pipeline.costs import LinkModel, MeasuredCurve, predict
from ringtrain.pipeline.ir import COMPUTE, Op
from ringtrain.pipeline.lower import send_when_made
from ringtrain.pipeline.partition import balanced
from ringtrain.pipeline.schedule import build_schedule
from ringtrain.pipeline.simulate import simulate

FORMAT = "ringtrain-calibration/5"
FLOAT_BYTES = 4
OPTIMIZER_SLOTS = {"sgd": 0, "adam": 2}  # float slots per weight (Adam: two moments)
SCHEDULE_KINDS = ("gpipe", "1f1b", "zb-h1")
_STAGE_TIMED = (Op.F, Op.B, Op.STEP)  # calibrated per stage range; the executor's runs add more


@dataclass(frozen=True)
class ElementCost:
    """One element (layer) of the model, as calibrated."""

    seconds: dict[str, tuple[float, float]]  # op -> (fixed s, s per sample)
    params: int
    input_floats: int  # per sample
    output_floats: int  # per sample

    def time(self, op: str, samples: float) -> float:
        return _linear(self.seconds[op], samples)


def _linear(fit: tuple[float, float], samples: float) -> float:
    """Seconds from a (fixed, per sample) fit, never below zero."""
    fixed, per_sample = fit
    return max(fixed + per_sample * samples, 0.0)


@dataclass(frozen=True)
class Calibration:
    model: str
    dataset: str
    optimizer: str
    elements: list[ElementCost]
    allreduce: dict[str, MeasuredCurve]  # "intra" (same node) and, if measured, "inter"
    p2p: dict[str, LinkModel]
    baseline_bytes: int  # a rank's resident set right after TensorFlow's import
    step_seconds: tuple[float, float]  # a whole-model compiled step: (fixed s, s per sample)
    # (bytes the data-parallel engine's steps added to the high-water mark, samples a rank ran)
    step_peak: tuple[int, float]
    # elements [a, b) run as one pipeline stage: op (F, B, BW, STEP) -> (fixed s, s per sample)
    stages: dict[tuple[int, int], dict[str, tuple[float, float]]]
    # 2-stage 1F1B runs of the executor at two microbatch sizes: each one's partition,
    # microbatch and in-run seconds per action ("0F", "1RECV_ACT", ...), which show what an
    # action costs beyond the compute above
    executor: list[dict]
    fingerprint: dict = field(default_factory=dict)
    # ringtrain's data-parallel engine on 2 ranks where the compute was measured: (seconds a
    # step, the same with --fp16-allreduce, the global batch, whether its 2 ranks were on 2
    # nodes); None: not measured
    engine_step: tuple[float, float, int, bool] | None = None
    # floats of optimizer state per weight, as measured; None: by the optimizer's name
    optimizer_slots: float | None = None

    @property
    def runtime_bytes(self) -> int:
        """What a data-parallel rank holds beyond weights, gradients, optimizer state and
        activations once it has run a step (compiled graphs, kernels' scratch, Horovod's
        buffers): the measured step's high-water mark less the model's own share."""
        added, samples = self.step_peak
        everything = range(len(self.elements))
        model = _weights_bytes(self, everything, False)[0] + _activation_bytes(
            self, everything, samples
        )
        return max(added - model, 0)

    @property
    def pipeline_runtime_bytes(self) -> int:
        """The same for a pipeline rank, from the executor's reference runs: the most a rank
        added there less the fullest stage's own share (the largest over the runs)."""
        found = 0
        for ref in self.executor:
            sim = build_schedule("1f1b", len(ref["bounds"]), ref["microbatches"])
            own = max(
                _stage_bytes(self, range(a, b), inflight, ref["microbatch"])
                for (a, b), inflight in zip(ref["bounds"], simulate(sim).peak_inflight, strict=True)
            )
            found = max(found, ref["added_bytes"] - own)
        return found

    def step_overhead(self, fp16: bool) -> float:
        """What ringtrain's data-parallel step took beyond its parts in calibration, signed:
        the engine's step less the compiled compute alone and a lone allreduce of the bytes it
        sends. Inside the step, Horovod's op waits for its thread's next cycle and the
        executor dispatches around it (more); a lone allreduce pays its own fixed cost, which
        in a step partly hides behind the compute's tail (less). fp16 has its own: its casts,
        and a capped link's token bucket, which passes half the bytes at a different rate."""
        if self.engine_step is None:
            return 0.0
        exact, halved, batch, across_nodes = self.engine_step
        grad_bytes = _weights_bytes(self, range(len(self.elements)), fp16)[1]
        link = self.link(self.allreduce, across_nodes)
        seconds = halved if fp16 else exact
        return seconds - self.step_compute(batch / 2) - allreduce_seconds(link, 2, grad_bytes)

    def step_compute(self, samples: float) -> float:
        return _linear(self.step_seconds, samples)

    def link(self, table: dict, across_nodes: bool) -> LinkModel | MeasuredCurve:
        if across_nodes and "inter" not in table:
            raise UserError(
                "the calibration has no across-node figures: run `ringtrain plan calibrate` "
                "on two nodes (--hosts or a Slurm allocation)"
            )
        return table["inter" if across_nodes else "intra"]


def allreduce_seconds(link: LinkModel | MeasuredCurve, ranks: int, nbytes: int) -> float:
    """Ring allreduce of nbytes over `ranks` ranks (0 for one rank), from `link`'s time of a
    2-rank allreduce by size."""
    if ranks < 2:
        return 0.0
    return (ranks - 1) * link.time(2 * nbytes / ranks)


def roofline(compute: float, allreduce: float) -> tuple[float, float]:
    """No-overlap (compute then allreduce) and full-overlap (the larger of the two) limits."""
    return compute + allreduce, max(compute, allreduce)


@dataclass(frozen=True)
class Candidate:
    """A configuration to predict: dp_size replicas of a pipeline of pp_size ranks (one stage
    each; pp_size = 1: data parallel)."""

    dp_size: int
    pp_size: int
    schedule: str | None = None  # None for data parallel
    microbatches: int = 1
    fp16_allreduce: bool = False
    shard_optimizer: bool = False  # optimizer slots divided among the (stage's) replicas

    @property
    def strategy(self) -> str:
        if self.pp_size == 1:
            return "data" if self.dp_size > 1 else "single"
        return "pipeline" if self.dp_size == 1 else "hybrid"

    def flags(self) -> list[str]:
        """ringtrain train's flags for this configuration."""
        out = ["--strategy", self.strategy]
        if self.strategy == "hybrid":
            out += ["--pp-size", str(self.pp_size)]
        if self.schedule:
            out += ["--schedule", self.schedule, "--microbatches", str(self.microbatches)]
        if self.fp16_allreduce:
            out.append("--fp16-allreduce")
        if self.shard_optimizer:
            out.append("--shard-optimizer")
        return out

    def label(self) -> str:
        name = self.strategy
        if self.schedule:
            name += f" {self.schedule} M={self.microbatches}"
        if self.strategy == "hybrid":
            name = f"hybrid {self.dp_size}x{self.pp_size} {self.schedule} M={self.microbatches}"
        name += " sharded optimizer" if self.shard_optimizer else ""
        return name + (" fp16 (lossy)" if self.fp16_allreduce else "")


@dataclass
class Prediction:
    candidate: Candidate
    step_seconds: float
    compute_seconds: float
    exposed_comm_seconds: float
    bubble: float
    peak_bytes: int
    samples_per_second: float
    fits: bool = True

    def to_json(self) -> dict:
        return {
            "configuration": self.candidate.label(),
            "flags": self.candidate.flags(),
            "replicas": self.candidate.dp_size,
            "stages": self.candidate.pp_size,
            "step_ms": self.step_seconds * 1e3,
            "samples_per_sec": self.samples_per_second,
            "compute_ms": self.compute_seconds * 1e3,
            "exposed_comm_ms": self.exposed_comm_seconds * 1e3,
            "bubble": self.bubble,
            "peak_memory_bytes": self.peak_bytes,
            "fits": self.fits,
        }


def model_bytes(
    weights: float, trainable: float, slots: float, activations: float, shards: int = 1
) -> dict[str, int]:
    """A rank's model memory by what holds it, in bytes, from counts of 4-byte words: its
    `weights`; a gradient per `trainable` weight; the optimizer's `slots` words per trainable
    weight (Adam's two moments), divided among `shards` replicas when the optimizer is
    sharded; and the `activations` its tapes hold for the examples in flight.
    The one arithmetic behind `plan`'s memory column and `train`'s memory check."""
    state_words = trainable * slots / shards
    return {
        "weights": int(weights * FLOAT_BYTES),
        "gradients": int(trainable * FLOAT_BYTES),
        "optimizer state": int(state_words * FLOAT_BYTES),
        "activations in flight": int(activations * FLOAT_BYTES),
    }


def _weights_bytes(
    cal: Calibration, elements: range, fp16: bool, shards: int = 1
) -> tuple[int, int]:
    """(bytes of weights + gradients + optimizer state, the state divided among `shards`
    replicas; bytes one gradient allreduce moves)."""
    params = sum(cal.elements[i].params for i in elements)
    state = sum(model_bytes(params, params, _slots(cal), 0, shards).values())
    return state, params * (2 if fp16 else FLOAT_BYTES)


def _slots(cal: Calibration) -> float:
    """Words of optimizer state per weight: as measured, else by the optimizer's name."""
    if cal.optimizer_slots is None:
        return OPTIMIZER_SLOTS.get(cal.optimizer, 2)
    return cal.optimizer_slots


def _stage_bytes(
    cal: Calibration, elements: range, inflight: int, microbatch: float, shards: int = 1
) -> int:
    """A stage's own memory: its state (its slots divided among `shards` replicas), and its
    activations for each microbatch in flight."""
    params = sum(cal.elements[i].params for i in elements)
    words = inflight * _activation_words(cal, elements) * microbatch
    return sum(model_bytes(params, params, _slots(cal), words, shards).values())


def _activation_bytes(cal: Calibration, elements: range, samples: float) -> int:
    return model_bytes(0, 0, 0, _activation_words(cal, elements) * samples)["activations in flight"]


def _activation_words(cal: Calibration, elements: range) -> float:
    """Per example: every element's input and output (the saved tapes hold at least those)."""
    return sum(cal.elements[i].input_floats + cal.elements[i].output_floats for i in elements)


def predict_data_parallel(
    cal: Calibration, ranks: int, nodes: int, batch: int, fp16: bool, shard: bool = False
):
    """Data parallel over `ranks` ranks on `nodes` nodes at a global batch. A sharded
    optimizer (`shard`) keeps 1/ranks of the slots; its reduce-scatter and all-gather move what
    a ring allreduce moves (which is those two phases), so its predicted time is the same."""
    per_rank = batch / ranks
    everything = range(len(cal.elements))
    compute = cal.step_compute(per_rank)
    state, grad_bytes = _weights_bytes(cal, everything, fp16, ranks if shard else 1)
    allreduce = allreduce_seconds(cal.link(cal.allreduce, nodes > 1), ranks, grad_bytes)
    comm = max(allreduce + cal.step_overhead(fp16), 0.0)  # the step is never below its compute
    step, _ = roofline(compute, comm)
    peak = cal.baseline_bytes + cal.runtime_bytes + state
    peak += _activation_bytes(cal, everything, per_rank)
    candidate = Candidate(ranks, 1, fp16_allreduce=fp16, shard_optimizer=shard)
    return Prediction(candidate, step, compute, comm, 0.0, peak, batch / step)


def predict_pipeline(cal: Calibration, candidate: Candidate, nodes: int, batch: int):
    """D replicas of a P-stage pipeline: the simulator's makespan, then the replica average."""
    pp_size, dp_size = candidate.pp_size, candidate.dp_size
    microbatch = batch / dp_size / candidate.microbatches
    elements = cal.elements
    f_and_b = [e.time(Op.F, microbatch) + e.time(Op.B, microbatch) for e in elements]
    bounds = balanced(f_and_b, pp_size)
    seconds = {}
    for s, bound in enumerate(bounds):
        ranged = {op: _linear(fit, microbatch) for op, fit in cal.stages[bound].items()}
        extra = executor_overhead(cal, s == 0, s == pp_size - 1, microbatch)
        # BI makes and adds every gradient (a whole B); BW only releases the microbatch
        ranged[Op.BI] = max(ranged[Op.B] - ranged[Op.BW], 0.0)
        extra[Op.BI], extra[Op.BW] = extra[Op.B], 0.0
        for op in (*COMPUTE, Op.STEP):
            seconds[(s, op)] = ranged[op] + extra.pop(op)
        seconds.update({(s, op): value for op, value in extra.items()})
    boundary = [int(elements[b - 1].output_floats * FLOAT_BYTES * microbatch) for _, b in bounds]
    ranks_per_node = dp_size * pp_size // nodes
    pipeline_spans_nodes = pp_size > ranks_per_node
    link = cal.link(cal.p2p, pipeline_spans_nodes)
    schedule = send_when_made(build_schedule(candidate.schedule, pp_size, candidate.microbatches))
    sim = predict(schedule, seconds, link, boundary)
    average, peak = 0.0, 0
    runtime = cal.pipeline_runtime_bytes
    for s, (a, b) in enumerate(bounds):
        grad_bytes = _weights_bytes(cal, range(a, b), candidate.fp16_allreduce)[1]
        replica_link = cal.link(cal.allreduce, dp_size > 1 and nodes > 1)
        average = max(average, allreduce_seconds(replica_link, dp_size, grad_bytes))
        shards = dp_size if candidate.shard_optimizer else 1
        own = _stage_bytes(cal, range(a, b), sim.peak_inflight[s], microbatch, shards)
        peak = max(peak, cal.baseline_bytes + runtime + own)
    compute = max(sim.busy)
    step = sim.makespan + average
    exposed = max(step - compute - sim.bubble * sim.makespan, 0.0)
    return Prediction(candidate, step, compute, exposed, sim.bubble, peak, batch / step)


def executor_overhead(
    cal: Calibration, first: bool, last: bool, microbatch: float
) -> dict[str, float]:
    """What the executor's actions cost beyond their compute on a stage at this position, from
    the reference runs: F, B and STEP less the same stage's calibrated compute, and the host work
    of messages and REDUCE as measured; linear in the microbatch through the two runs. A middle
    stage takes the mean of first and last."""
    at: dict[float, dict[str, float]] = {}
    for ref in cal.executor:
        count = len(ref["bounds"])
        positions = [0] if first else [count - 1] if last else [0, count - 1]
        found: dict[str, list[float]] = {}
        for r in positions:
            bound = ref["bounds"][r]
            compute = {op: _linear(f, ref["microbatch"]) for op, f in cal.stages[bound].items()}
            for key, value in ref["seconds"].items():
                stage, op = re.fullmatch(r"(\d+)(\D.*)", key).groups()
                if int(stage) == r:
                    beyond = value - compute[op] if op in _STAGE_TIMED else value
                    found.setdefault(op, []).append(beyond)
        at[ref["microbatch"]] = {op: sum(v) / len(v) for op, v in found.items()}
    ops = {op for values in at.values() for op in values} | set(_STAGE_TIMED)
    sizes = sorted(at)
    extra = {}
    for op in ops:
        points = {n: at[n].get(op, 0.0) for n in sizes}
        fit = fit_line(points) if len(points) > 1 else (points.get(sizes[0], 0.0), 0.0)
        extra[op] = max(_linear(fit, microbatch), 0.0)
    return extra


def fit_line(points: dict[float, float]) -> tuple[float, float]:
    """(fixed, per sample) through the smallest and largest of {samples: seconds} points: the
    calibration measures at two sample counts, so a line through both."""
    (small, t_small), (large, t_large) = min(points.items()), max(points.items())
    slope = (t_large - t_small) / (large - small)
    return t_small - slope * small, slope


def candidates(ranks: int, elements: int, microbatch_counts: list[int]) -> list[Candidate]:
    """Data parallel (with and without fp16, and with its optimizer sharded), and every grid
    D x P with P <= elements, with each pipeline schedule and M (and, with D > 1, each stage's
    optimizer sharded among its replicas)."""
    found = [Candidate(ranks, 1)]
    if ranks > 1:
        found.append(Candidate(ranks, 1, fp16_allreduce=True))
        found.append(Candidate(ranks, 1, shard_optimizer=True))
    for pp_size in range(2, min(ranks, elements) + 1):
        if ranks % pp_size:
            continue
        for kind in SCHEDULE_KINDS:
            for m in microbatch_counts:
                found.append(Candidate(ranks // pp_size, pp_size, kind, m))
                if pp_size < ranks:
                    found.append(
                        Candidate(ranks // pp_size, pp_size, kind, m, shard_optimizer=True)
                    )
    return found


def plan(
    cal: Calibration,
    nodes: int,
    ranks_per_node: int,
    batch: int,
    memory_per_rank: int | None = None,
    microbatch_counts: tuple[int, ...] = (2, 4, 8),
) -> list[Prediction]:
    """Every candidate that divides the batch, predicted, fastest fitting one first."""
    ranks = nodes * ranks_per_node
    found = []
    for c in candidates(ranks, len(cal.elements), list(microbatch_counts)):
        if batch % (c.dp_size * c.microbatches):
            continue
        if c.pp_size == 1:
            p = predict_data_parallel(cal, ranks, nodes, batch, c.fp16_allreduce, c.shard_optimizer)
        else:
            p = predict_pipeline(cal, c, nodes, batch)
        p.fits = memory_per_rank is None or p.peak_bytes <= memory_per_rank
        found.append(p)

    # fp16 changes the training (lossy), and sharding adds work its bytes do not show (a
    # second collective to wait on): each ranks after the plain run it ties.
    def order(p: Prediction) -> tuple:
        c = p.candidate
        return (not p.fits, c.fp16_allreduce, p.step_seconds, c.shard_optimizer)

    return sorted(found, key=order)
