"""`train`'s memory check: a rank's peak predicted from the model it was given, against the
limit it runs under, so a configuration that cannot fit is refused in one line before the
kernel kills it part-way.

The prediction is `plan`'s arithmetic (costmodel.model_bytes) on what the built model says,
with no calibration and no profile:
- weights: the bytes of the rank's weights; gradients: one float per trainable weight;
  optimizer state: the floats per weight the compiled optimizer's kind makes (a fresh one of
  its kind is built on a probe variable), divided among the replicas under --shard-optimizer;
- activations in flight: per example, every tensor the model's flattened graph makes (each
  layer call's outputs) and the inputs, times the examples in flight: a rank's share of the
  batch (a --accumulate slice), or for a pipeline stage a microbatch times the microbatches
  its schedule holds at once (simulate's peak_inflight). A subclassed model has no graph to
  read, so only its inputs count: a lower bound;
- around them (_around): rank 0's copy of the weights gathered at the end, Horovod's averaged
  gradients and fusion buffer where replicas average, and the optimizer step's temporaries;
- input buffers: the arrays held in memory, the batch a step takes and the reads ahead
  (ahead.KEPT), and the epoch's order of positions that --shuffle permutes (a file shard's
  shuffle window permutes positions, not rows);
- BASELINE_BYTES, what a rank holds before its model.

It predicts the memory a limit counts and cannot reclaim (anonymous memory): a cgroup at its
limit drops file-backed pages, such as the libraries' code, before it kills.

A pipeline's stages are cut as the run will cut them where that needs no profile (--split-at,
uniform, params); the time partition is approximated by the params one. Every rank predicts
the fullest rank of the grid and takes the tightest limit any rank found, so all reach the
same verdict.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ringtrain import log
from ringtrain.ahead import KEPT
from ringtrain.config import (
    TrainConfig,
    gathers_whole_model,
    partition_method,
    pp_size_of,
    runs_stages,
)
from ringtrain.errors import UserError
from ringtrain.launch.env import RankInfo
from ringtrain.memory_limit import SOURCES, Limit, rank_limit
from ringtrain.pipeline import partition
from ringtrain.pipeline.schedule import pipeline_schedule
from ringtrain.pipeline.simulate import simulate
from ringtrain.plan.costmodel import FLOAT_BYTES, model_bytes
from ringtrain.validation import validate_flags

GIB = 2**30
# What a rank holds before its model that the kernel cannot take back: TensorFlow, MPI,
# Horovod and ringtrain loaded and a step compiled. Measured here as the peak anonymous memory
# (RssAnon) of each rank of `mpirun -np 2 ringtrain train --model mlp` (whose model is a tenth
# of a MiB): 0.21-0.22 GiB; the transformer's ranks, 0.25 GiB; a pipeline rank of 100 Dense
# layers before its weights, 0.26 GiB. Their peak resident set is
# 0.33 GiB more: the shared libraries' pages, which a memory cgroup at its limit reclaims
# (and reads again) rather than kill for, so no limit is predicted against them.
BASELINE_BYTES = int(0.25 * GIB)
CONSUMERS = ("weights", "gradients", "optimizer state", "activations in flight")
HOROVOD_FUSION_BYTES = 64 * 2**20  # Horovod's default HOROVOD_FUSION_THRESHOLD
# A stage's microbatches in flight hold more than its layers' outputs: the executor keeps each
# one's input and the compiled forward's saved tensors for its backward. Measured here: 1.3
# times the layers' outputs, on a chain of wide activations.
STAGE_ACTIVATION_FACTOR = 1.5
# The compiled step's graph, per trainable variable and per (1 + 2 x slots): under Adam, 0.6
# MiB a variable (100 Dense layers of 256 in 2 stages: the first step added 60 MiB to a
# stage), under SGD 0.07 MiB.
STEP_GRAPH_BYTES = int(0.12 * 2**20)
MICROBATCH_COUNTS = (8, 4, 2)  # tried for a fitting pipeline, most first (smaller, less bubble)


@dataclass(frozen=True)
class Unit:
    """A block of the model's graph (a pipeline's stages are runs of them), in 4-byte words:
    weights, trainable weights, and per example the tensors crossing into it and made in it."""

    weights: float
    trainable: float
    largest: float  # the largest trainable weight
    variables: int  # how many trainable weights
    inputs: float
    made: float


@dataclass(frozen=True)
class ModelFacts:
    """What the prediction needs from the built model and its data, read once."""

    weights: float
    trainable: float
    largest: float  # the largest trainable weight
    variables: int  # how many trainable weights
    slots: float
    activations: float  # words per example the whole model's tape holds
    units: list[Unit]  # none for a subclassed model, which no pipeline can cut
    split: Any  # the graph's GraphSplit (None: subclassed), for --split-at
    input_bytes: int  # bytes of input buffers at the run's global batch


def check_memory(
    model, data, cfg: TrainConfig, me: RankInfo, gathers: bool = True, asked: bool = True
) -> None:
    """Refuse, alike on every rank, a run predicted to need more memory per rank than its
    limit (see module doc); nothing is checked where no limit is found. Rank 0 says what it
    did (the log knows no rank before the runtime starts). `gathers`: whether rank 0 copies
    the whole model's weights out (config.gathers_whole_model); `asked`: whether the run's
    outputs ask for them whole (--save, --weights-out, callbacks), as a pipeline suggested
    instead would gather them only then."""
    if cfg.ignore_memory_check:
        if me.rank == 0:
            log.info("--ignore-memory-check: memory per rank is not checked against its limit")
        return
    limit = agreed_limit(cfg, me)
    if limit is None:
        return
    facts = model_facts(model, data, cfg.batch_size)
    peaks = rank_peaks(facts, cfg, me.world_size, gathers)
    need = _fullest(peaks)
    total = sum(need.values())
    if total <= limit.bytes:
        if me.rank == 0:
            each = ", ".join(_gib(sum(r.values())) for r in peaks)
            by_rank = f" (by pipeline rank: {each})" if len(peaks) > 1 else ""
            log.info(
                f"memory: predicted {_gib(total)} per rank{by_rank}, within its limit of "
                f"{_gib(limit.bytes)} ({limit.source})"
            )
        return
    gathered = need["weights gathered at the end"]
    if runs_stages(cfg) and gathered and total - gathered <= limit.bytes:
        raise UserError(
            f"--save, --weights-out, --initial-weights-out and callbacks gather the whole "
            f"model's weights ({_gib(gathered)}) on rank 0, and its limit of "
            f"{_gib(limit.bytes)} ({limit.source}) cannot hold them beside its stage; without "
            "them each stage's weights stay on its rank, and --checkpoint-dir writes them"
        )
    name = max(CONSUMERS, key=need.__getitem__)
    raise UserError(
        f"predicted {_gib(total)} per rank (largest: {name} {_gib(need[name])}) but the limit "
        f"is {_gib(limit.bytes)} ({limit.source}); "
        f"{fitting(facts, cfg, me.world_size, limit, asked)}; "
        "--ignore-memory-check runs it anyway"
    )


def agreed_limit(cfg: TrainConfig, me: RankInfo) -> Limit | None:
    """The tightest limit any rank found (--memory-per-rank is the same on every rank, and a
    node's cgroup or Slurm limit may differ between nodes): one allgather among the ranks."""
    limit = rank_limit(cfg.memory_per_rank, me.local_size)
    if cfg.memory_per_rank is not None or me.world_size == 1:
        return limit
    from ringtrain import runtime
    from ringtrain.comm import Link

    comm = runtime.communicator(me.local_size)
    none = np.iinfo(np.int64).max
    mine = np.array([limit.bytes, SOURCES.index(limit.source)] if limit else [none, 0], np.int64)
    rows = np.empty(2 * comm.Get_size(), np.int64)
    wait = Link(comm, cfg.startup_timeout).wait
    wait(comm.Iallgather(mine, rows), None, "the other ranks' memory limits")
    least, source = rows.reshape(-1, 2)[rows[::2].argmin()]
    return None if least == none else Limit(int(least), SOURCES[source])


def rank_peak(
    facts: ModelFacts, cfg: TrainConfig, world_size: int, gathers: bool = True
) -> dict[str, int]:
    """The fullest rank's predicted peak in bytes, by what holds it (see rank_peaks)."""
    return _fullest(rank_peaks(facts, cfg, world_size, gathers))


def _fullest(peaks: list[dict[str, int]]) -> dict[str, int]:
    return max(peaks, key=lambda r: sum(r.values()))


def rank_peaks(
    facts: ModelFacts, cfg: TrainConfig, world_size: int, gathers: bool = True
) -> list[dict[str, int]]:
    """Each pipeline rank's predicted peak in bytes (one for all where every rank is alike), by
    what holds it: the model's consumers (costmodel's arithmetic), what the run adds around
    them, its input buffers, the baseline. `gathers`: whether rank 0 copies the whole model's
    weights out at the end."""
    fixed = {"input buffers": facts.input_bytes, "baseline": BASELINE_BYTES}
    if not runs_stages(cfg):  # every rank alike
        share = math.ceil(cfg.batch_size / world_size / cfg.accumulate)
        shards = world_size if cfg.shard_optimizer else 1
        model = model_bytes(
            facts.weights, facts.trainable, facts.slots, facts.activations * share, shards
        )
        whole = (facts.trainable, facts.largest, facts.variables)
        around = _around(facts, *whole, world_size, gathers)
        return [{**model, **around, **fixed}]
    pp_size = pp_size_of(cfg, world_size)
    dp_size = world_size // pp_size
    schedule = pipeline_schedule(cfg, pp_size)
    bounds = _bounds(facts, cfg, schedule.n_stages)
    inflight = simulate(schedule).peak_inflight
    microbatch = math.ceil(cfg.batch_size / dp_size / cfg.microbatches)
    ranks = []
    for rank in range(pp_size):
        held = {s: facts.units[slice(*bounds[s])] for s in schedule.stages_on(rank)}
        summed = dict.fromkeys(CONSUMERS, 0)
        for s, units in held.items():
            made = sum(u.made for u in units)
            if cfg.recompute:  # each microbatch's input kept, its activations for one at a time
                words = units[0].inputs * inflight[s] + made
            else:
                words = (units[0].inputs + made) * inflight[s]
            weights, trainable = sum(u.weights for u in units), sum(u.trainable for u in units)
            activations = STAGE_ACTIVATION_FACTOR * words * microbatch
            shards = dp_size if cfg.shard_optimizer else 1  # a stage's replicas share its slots
            stage = model_bytes(weights, trainable, facts.slots, activations, shards)
            summed = {k: summed[k] + stage[k] for k in CONSUMERS}
        mine = [u for units in held.values() for u in units]
        trainable = sum(u.trainable for u in mine)
        largest = max((u.largest for u in mine), default=0.0)
        variables = sum(u.variables for u in mine)
        at_end = gathers and rank == 0
        around = _around(facts, trainable, largest, variables, dp_size, at_end, stages=True)
        ranks.append({**summed, **around, **fixed})
    return ranks


def _around(
    facts: ModelFacts,
    trainable: float,
    largest: float,
    variables: int,
    replicas: int,
    gathers: bool,
    stages: bool = False,
) -> dict[str, int]:
    """What a training rank holds beyond plan's four consumers, in bytes, as measured here
    (peak anonymous memory of tall MLPs under SGD and Adam on 1 and 2 ranks), for the weights
    it trains: rank 0's copy of the whole model's weights where it copies them out at
    the end; where replicas average, 2.5 copies of the trainable weights beside the gradients
    (Horovod's outputs and the averaged step's) and Horovod's fusion buffer; and the optimizer
    step's temporaries: two of its largest weight (a compiled step frees each gradient once
    its update has run; a stage updates one variable after another,
    optim.one_variable_at_a_time), and the compiled step's graph, which grows with its ops per
    variable (STEP_GRAPH_BYTES). A stage adds 1 + slots/2 copies of its weights: on tall MLPs
    its step's temporaries and what its compiled backward holds beside its sums came to less
    than half of that, but a BERT-large encoder's stages held that much more, in activations
    its layers keep inside them (69 MiB a microbatch of 64 tokens on 6 layers, where their
    outputs count 2 MiB), which the graph's layer outputs do not show."""
    fusion = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", HOROVOD_FUSION_BYTES))
    graph = variables * STEP_GRAPH_BYTES * (1 + facts.slots * 2)
    stage = (1 + facts.slots / 2) * trainable if stages else 0
    temporaries = (2 * largest + stage) * FLOAT_BYTES
    return {
        "weights gathered at the end": int(facts.weights * FLOAT_BYTES) if gathers else 0,
        "gradient averaging": int(2.5 * trainable * FLOAT_BYTES) + fusion if replicas > 1 else 0,
        "step temporaries": int(temporaries + graph),
    }


def _bounds(facts: ModelFacts, cfg: TrainConfig, n_stages: int) -> list[tuple[int, int]]:
    """The stages' units as the run cuts them, with the time partition (which profiles the
    units first) approximated by the parameters one."""
    if cfg.split_at:
        return facts.split.bounds_at(cfg.split_at.split(","), n_stages)
    if partition_method(cfg, len(facts.units), n_stages) == "uniform":
        return partition.uniform(len(facts.units), n_stages)
    return partition.balanced([u.trainable for u in facts.units], n_stages)


def fitting(
    facts: ModelFacts, cfg: TrainConfig, world_size: int, limit: Limit, asked: bool = True
) -> str:
    """What the same arithmetic says fits under `limit` at the same global batch: the
    optimizer sharded among the same ranks, else a pipeline (or hybrid) on them, else a
    pipeline on more ranks, up to one stage per unit of the graph. A pipeline's rank 0
    gathers the whole model where the outputs ask for it (`asked`), data parallel for
    --weights-out alone."""
    tried = []
    if not runs_stages(cfg) and world_size > 1 and not cfg.shard_optimizer:
        tried.append((world_size, replace(cfg, shard_optimizer=True, bucket_mb=None)))
    units = len(facts.units)
    for ranks in [world_size, *range(world_size + 1, units + 1)]:
        for pp_size in range(2, min(ranks, units) + 1):
            if ranks % pp_size or (ranks > world_size and pp_size < ranks):
                continue
            for count in MICROBATCH_COUNTS:
                hybrid = pp_size < ranks
                changed = {"strategy": "hybrid" if hybrid else "pipeline", "schedule": "1f1b"}
                changed |= {"pp_size": pp_size if hybrid else None, "partition": None}
                changed |= {"microbatches": count, "split_at": None, "shard_optimizer": False}
                tried.append((ranks, replace(cfg, **changed, accumulate=1, bucket_mb=None)))
    for ranks, candidate in tried:
        try:
            validate_flags(candidate, ranks)
        except UserError:
            continue
        gathers = gathers_whole_model(candidate, asked, built_whole=False)
        need = sum(rank_peak(facts, candidate, ranks, gathers).values())
        if need <= limit.bytes:
            return f"fits: `{_flags(candidate)}` on {ranks} ranks (predicted {_gib(need)})"
    if (floor := BASELINE_BYTES + facts.input_bytes) > limit.bytes:
        return f"a rank's baseline and input buffers alone take {_gib(floor)}"
    return f"no data-parallel or pipeline split on up to {max(units, world_size)} ranks fits"


def _flags(candidate: TrainConfig) -> str:
    """The flags that make `candidate` of the run's configuration."""
    if candidate.shard_optimizer:
        return "--shard-optimizer"
    flags = ["--strategy", candidate.strategy]
    if candidate.strategy == "hybrid":
        flags += ["--pp-size", str(candidate.pp_size)]
    flags += ["--schedule", candidate.schedule, "--microbatches", str(candidate.microbatches)]
    return " ".join(flags)


def model_facts(model, data, batch: int) -> ModelFacts:
    """Read the model's sizes, its optimizer's state per weight and its graph's activations,
    and the data's buffers at global batch `batch`."""
    from ringtrain.keras_model.graph import split_graph
    from ringtrain.pipeline.split import GraphPlan

    try:
        split = split_graph(model, data.train.x)
    except UserError:  # subclassed: no graph to read
        split, units, activations = None, [], _example_bytes(data.train.x) / FLOAT_BYTES
    else:
        units = _units(split, GraphPlan(model, split).boundary_words())
        activations = units[0].inputs + sum(u.made for u in units)
    return ModelFacts(
        _words(model.weights),
        _words(model.trainable_weights),
        max((_words([v]) for v in model.trainable_weights), default=0.0),
        len(model.trainable_weights),
        optimizer_slots(model.optimizer),
        activations,
        units,
        split,
        input_bytes(data, batch),
    )


def _units(split, crossing: list[float]) -> list[Unit]:
    """Each block's weights (a layer called twice counted once) and per example its words."""
    ends = [*split.block_starts[1:], len(split.nodes)]
    units = []
    for i, (a, b) in enumerate(zip(split.block_starts, ends, strict=True)):
        nodes = split.nodes[a:b]
        operations = {id(n.operation): n.operation for n in nodes}.values()
        # a Keras op in the graph (a dict output's GetItem) is not a layer: it holds no weights
        layers = [op for op in operations if hasattr(op, "trainable_weights")]
        made = sum(_tensor_words(t) for n in nodes for t in n.outputs)
        trainable = [v for layer in layers for v in layer.trainable_weights]
        units.append(
            Unit(
                _words(v for layer in layers for v in layer.weights),
                _words(trainable),
                max((_words([v]) for v in trainable), default=0.0),
                len(trainable),
                crossing[i],
                made,
            )
        )
    return units


def optimizer_slots(optimizer) -> float:
    """Floats of state per weight that this optimizer's kind keeps (Adam's two moments,
    momentum's one): a fresh one with the same settings, built on a probe variable."""
    from ringtrain.tensorflow_loader import tf  # noqa: F401  (before Keras)

    # isort: split
    import keras

    probe = keras.Variable(np.zeros(16, np.float32), name="memory_check_probe")
    fresh = type(optimizer).from_config(optimizer.get_config())
    fresh.build([probe])
    return sum(int(np.prod(v.shape)) for v in fresh.variables if len(v.shape)) / 16


def input_bytes(data, batch: int) -> int:
    """A run's input buffers: arrays held in memory (training and validation), the batch a
    step takes and the reads ahead of it, and the epoch's order of positions."""
    held = [data.train, *([data.validation] if data.validation is not None else [])]
    arrays = sum(a.nbytes for e in held for a in _leaves((e.x, e.y)) if isinstance(a, np.ndarray))
    example = _example_bytes(data.train.x) + _example_bytes(data.train.y)
    return arrays + (KEPT + 1) * batch * example + 8 * data.n_examples


def _leaves(value) -> list:
    """The arrays of an (x, y) structure of tuples and dicts."""
    if isinstance(value, dict):
        return [a for part in value.values() for a in _leaves(part)]
    if isinstance(value, tuple | list):
        return [a for part in value for a in _leaves(part)]
    return [value]


def _example_bytes(part) -> int:
    """Bytes of one example of x or y (arrays, columns read from files, dicts of them)."""
    return sum(
        np.dtype(a.dtype).itemsize * math.prod(d or 1 for d in a.shape[1:]) for a in _leaves(part)
    )


def _tensor_words(t) -> float:
    """Per example, the 4-byte words of a symbolic tensor (an unknown dimension taken as 1)."""
    return math.prod(d or 1 for d in t.shape[1:]) * np.dtype(str(t.dtype)).itemsize / 4


def _words(variables) -> float:
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables) / 4


def _gib(n: int) -> str:
    """A size as people read it: GiB from one up, else MiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"
