"""ZeRO stage 1 (--shard-optimizer): each data-parallel replica keeps the optimizer's slots
(Adam's moments, momentum) for 1/N of the weights instead of all of them.

The trainable variables, in the model's order, are cut into N runs of whole variables of about
equal size; rank r owns the r-th. A step reduce-scatters the gradients laid end to end (each
run padded to the longest), so each rank receives the average for its own variables alone (the
loss and the stop flag ride along, once in every run). A clone of the compiled optimizer (same
class, options, schedule and step count), built over the rank's own variables, updates them as
Keras would, with no copy of them; an allgather brings the runs back and every rank writes the
others' variables. Only global_clipnorm spans variables: its norm comes from one small
allreduce of sums of squares.

What needs more than a variable's own update (an EMA of the weights, Keras's own gradient
accumulation, exclude_from_weight_decay, which a clone does not carry) is refused, and so is
an optimizer this has not been proven with.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from ringtrain.tensorflow_loader import tf  # before Keras: keeps scikit-learn out of it

# isort: split
import keras

from ringtrain.checkpoint import (
    SHARDS,
    ReadWhenWritten,
    assign_checked,
    optimizer_key,
    shard_part,
    weight_key,
    weights_state,
)
from ringtrain.dataparallel.engine import DataParallelEngine
from ringtrain.errors import UserError

CHUNK_BYTES = 4 * 2**20  # a reduce-scatter's input at most (--bucket-mb sets it)

ELEMENTWISE = (
    keras.optimizers.SGD,
    keras.optimizers.Adam,
    keras.optimizers.AdamW,
    keras.optimizers.Adamax,
    keras.optimizers.Adagrad,
    keras.optimizers.Adadelta,
    keras.optimizers.RMSprop,
    keras.optimizers.Nadam,
    keras.optimizers.Lion,
)


def check_shardable(optimizer, trainable: list) -> None:
    """Refuse, in one line, what a rank updating its own variables cannot compute as Keras
    would."""
    name = type(optimizer).__name__
    if type(optimizer) not in ELEMENTWISE:
        known = ", ".join(kind.__name__ for kind in ELEMENTWISE)
        raise UserError(
            f"--shard-optimizer splits the slots of elementwise optimizers ({known}); the "
            f"compiled {name} is not one of them"
        )
    excluded = getattr(optimizer, "_exclude_from_weight_decay", None) or getattr(
        optimizer, "_exclude_from_weight_decay_pattern", None
    )
    for option, given in (
        ("exclude_from_weight_decay", excluded),
        ("use_ema", optimizer.use_ema),
        ("gradient_accumulation_steps (use --accumulate)", optimizer.gradient_accumulation_steps),
    ):
        if given:
            raise UserError(f"--shard-optimizer does not keep the compiled {name}'s {option}")
    wrong = [v.path for v in trainable if v.dtype != "float32"]
    wrong += [v.path for v in trainable if getattr(v, "overwrite_with_gradient", False)]
    if wrong:
        raise UserError(
            f"--shard-optimizer lays out float32 weights updated by the optimizer; {wrong[0]} "
            "is not one"
        )


def clone_optimizer(optimizer, **changes):
    """A fresh optimizer of the compiled one's class and options; its schedule is shared (a
    schedule is stateless), so a custom one needs no registration."""
    config = optimizer.get_config() | changes
    if isinstance(optimizer._learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        config["learning_rate"] = optimizer._learning_rate
    return type(optimizer).from_config(config)


def owner_bounds(sizes: list[int], ranks: int) -> list[int]:
    """Where each rank's run of whole variables begins, in the model's order (and the end):
    each cut at the variable boundary nearest an even share of the elements, every rank given
    at least one variable while there are enough."""
    starts = np.cumsum([0, *sizes])
    total, count, bounds = starts[-1], len(sizes), [0]
    for r in range(1, ranks):
        lowest = min(bounds[-1] + 1, count)
        highest = max(lowest, count - (ranks - r))
        target = total * r / ranks
        bounds.append(min(range(lowest, highest + 1), key=lambda k: abs(starts[k] - target)))
    return [*bounds, count]


class FlatLayout:
    """The trainable variables end to end; rank r owns a run of whole variables, its slice.
    Slices differ in length: a collective's share of each is padded to the longest, `shard`."""

    def __init__(self, shapes: list[tuple[int, ...]], ranks: int):
        self.shapes = [tuple(shape) for shape in shapes]
        self.sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self.shapes]
        self.offsets = [int(x) for x in np.cumsum([0, *self.sizes[:-1]])]
        self.total, self.ranks = sum(self.sizes), ranks
        self.bounds = owner_bounds(self.sizes, ranks)
        ends = [*self.offsets, self.total]
        self.starts = [ends[b] for b in self.bounds]
        self.shard = max(b - a for a, b in zip(self.starts, self.starts[1:], strict=False))

    def owned(self, rank: int) -> range:
        """The variables rank updates."""
        return range(self.bounds[rank], self.bounds[rank + 1])

    def pieces(self, rank: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int, int]]:
        """(variable, start, stop) of each part of a variable, flattened, in rank's slice (or in
        its elements lo to hi)."""
        hi = self.shard if hi is None else hi
        start = self.starts[rank] + lo
        stop = min(self.starts[rank] + hi, self.starts[rank + 1])
        found = []
        for i in self.owned(rank):
            a, b = max(start, self.offsets[i]), min(stop, self.offsets[i] + self.sizes[i])
            if a < b:
                found.append((i, a - self.offsets[i], b - self.offsets[i]))
        return found

    def padding(self, rank: int, lo: int = 0, hi: int | None = None) -> int:
        hi = self.shard if hi is None else hi
        return hi - lo - sum(b - a for _, a, b in self.pieces(rank, lo, hi))

    def chunks(self, chunk_elements: int) -> list[tuple[int, int]]:
        """Equal ranges of every slice, each reduce-scattered on its own: rank r's elements lo
        to hi of chunk (lo, hi) are its share of that call, so the slices stay as laid out."""
        step = max(1, chunk_elements // self.ranks)
        return [(lo, min(lo + step, self.shard)) for lo in range(0, max(self.shard, 1), step)]


class OptimizerLayout:
    """Where the compiled optimizer's variables would sit had it been built over the model's
    variables: the order a whole checkpoint keeps them in. Found by building a clone over small
    stand-ins, the i-th of i+1 elements: a variable of shape () is the optimizer's own (step
    count, learning rate), any other is a slot of the stand-in of its length. `positions` holds
    ("own", j) or ("slot", kind, variable) per position; `kinds` counts the slots per weight."""

    def __init__(self, optimizer, n_variables: int):
        probe = clone_optimizer(optimizer)
        probe.build([keras.Variable(np.zeros(i + 1, np.float32)) for i in range(n_variables)])
        self.positions: list[tuple] = []
        kinds, own = [0] * n_variables, 0
        for v in probe.variables:
            if len(v.shape) == 0:
                self.positions.append(("own", own))
                own += 1
            else:
                i = v.shape[0] - 1
                self.positions.append(("slot", kinds[i], i))
                kinds[i] += 1
        self.kinds = kinds[0] if kinds else 0
        self.own = own


class ShardedUpdate:
    """This rank's variables, its optimizer over them, and the step that updates through it."""

    def __init__(
        self,
        hvd,
        optimizer,
        trainable: list,
        rank: int,
        ranks: int,
        fp16: bool,
        bucket_mb: float | None = None,
        process_set=None,
    ):
        self.hvd, self.trainable, self.rank, self.refusal = hvd, trainable, rank, None
        self.group = {"process_set": process_set} if process_set is not None else {}
        self.flat = FlatLayout([tuple(v.shape) for v in trainable], ranks)
        self.owned = [trainable[i] for i in self.flat.owned(rank)]
        self.compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
        self.global_clipnorm = optimizer.global_clipnorm
        self.layout = OptimizerLayout(optimizer, len(trainable))
        chunk_bytes = int(bucket_mb * 2**20) if bucket_mb else CHUNK_BYTES  # --bucket-mb
        self.chunks = self.flat.chunks(chunk_bytes // 4)
        # Keras's own update of whole variables, so per-variable options (clipnorm) hold as
        # compiled; the global norm spans every rank's variables, so it is taken here.
        self.optimizer = clone_optimizer(optimizer, global_clipnorm=None)
        self.optimizer.build(self.owned)
        mine = OptimizerLayout(self.optimizer, len(self.owned))
        self.own, self.slots = [], [[None] * len(self.owned) for _ in range(mine.kinds)]
        for v, where in zip(self.optimizer.variables, mine.positions, strict=False):
            if where[0] == "own":
                self.own.append(v)
            else:
                self.slots[where[1]][where[2]] = v
        if (
            len(self.optimizer.variables) != len(mine.positions)
            or len(self.own) != self.layout.own
            or (self.owned and mine.kinds != self.layout.kinds)
        ):
            raise UserError(f"--shard-optimizer cannot lay out the slots of {optimizer.name}")

    def apply(self, grads: list, loss: tf.Tensor, stop: tf.Tensor) -> tuple:
        """(loss, stop) averaged over the replicas, the weights updated: in the step's graph.
        Chunk by chunk, one after another, so the step holds the gradients and one chunk's
        copy of them: one reduce-scatter of them all would copy them whole, and MPI and
        Horovod add buffers of that size."""
        sparse = [
            v.path
            for v, g in zip(self.trainable, grads, strict=True)
            if isinstance(g, tf.IndexedSlices)
        ]
        if sparse:  # found as the step is traced, alike on every rank (see the engine's step)
            self.refusal = (
                f"--shard-optimizer needs dense gradients; {sparse[0]} gets sparse ones (rows "
                "looked up, as an Embedding's), which Keras's optimizer updates row by row"
            )
            raise UserError(self.refusal)
        riders = tf.stack([loss, stop])
        received, previous = [], riders
        for lo, hi in self.chunks:  # rank r's elements lo to hi of the slice come to rank r
            last = [riders] if hi == self.flat.shard else []
            with tf.control_dependencies(received[-1:]):
                parts = [
                    x
                    for r in range(self.flat.ranks)
                    for x in self._parts(grads, r, lo, hi, previous) + last
                ]
            previous = self.hvd.reducescatter(
                tf.concat(parts, 0),
                op=self.hvd.Average,
                compression=self.compression,
                name=f"shard_{lo}",
                **self.group,
            )
            received.append(previous)
        tail = self.chunks[-1][1] - self.chunks[-1][0]
        loss, stop, received[-1] = received[-1][tail], received[-1][tail + 1], received[-1][:tail]
        if self.owned:
            mine = tf.concat(received, 0) if len(received) > 1 else received[0]
            sizes = [self.flat.sizes[i] for i in self.flat.owned(self.rank)]
            mine = tf.split(mine, [*sizes, self.flat.shard - sum(sizes)])[: len(sizes)]
            averaged = [tf.reshape(g, v.shape) for g, v in zip(mine, self.owned, strict=True)]
            if self.global_clipnorm:
                averaged = self._clipped(averaged)
            self.optimizer.apply_gradients(zip(averaged, self.owned, strict=True))
        self._gather_back(after=previous)
        return loss, stop

    def _gather_back(self, after: tf.Tensor) -> None:
        """Every rank's updated variables into every replica's model: a variable is written
        once all its pieces have come, this rank's own too (with what it already holds): a
        gather whose output fed no write would be pruned by TensorFlow (Horovod's ops are not
        marked stateful) while the other ranks wait in it. The gathers follow the
        reduce-scatters (`after`, the last one's output)."""
        values = {i: self.trainable[i].value for i in self.flat.owned(self.rank)}
        pieces: dict[int, list] = {i: [] for i in range(len(self.trainable))}
        done, got = [after], after
        for lo, hi in self.chunks:
            with tf.control_dependencies(done):
                mine = self._parts(values, self.rank, lo, hi, got)
                got = self.hvd.allgather(tf.concat(mine, 0), name=f"gather_{lo}", **self.group)
            done = [got]
            for r in range(self.flat.ranks):
                start = r * (hi - lo) - (self.flat.starts[r] + lo)  # flat position -> in `got`
                for i, a, b in self.flat.pieces(r, lo, hi):
                    at = start + self.flat.offsets[i] + a
                    pieces[i].append((a, b - a, got[at : at + b - a]))
                    if sum(n for _, n, _ in pieces[i]) == self.flat.sizes[i]:
                        ordered = sorted(pieces.pop(i), key=lambda piece: piece[0])
                        done.append(self._write(i, [p for _, _, p in ordered]))

    def _write(self, i: int, pieces: list):
        v = self.trainable[i]
        return v.assign(
            tf.reshape(pieces[0] if len(pieces) == 1 else tf.concat(pieces, 0), v.shape)
        )

    def _parts(self, tensors, rank: int, lo: int, hi: int, previous: tf.Tensor) -> list:
        """The pieces of rank's slice (elements lo to hi of it) of per-variable tensors (a list,
        or a dict by variable index) laid end to end, concatenated once where they are needed,
        never as a whole flat vector first. Padding repeats an element of the `previous`
        collective's output, which is discarded where it lands: zeros would be constants,
        which TensorFlow runs as early as it likes, and a collective made of padding alone
        would then be sent before the ones it follows (on another rank, its peers are still
        waiting in those)."""
        pieces = self.flat.pieces(rank, lo, hi)
        parts = [tf.reshape(tensors[i], [-1])[a:b] for i, a, b in pieces]
        padding = self.flat.padding(rank, lo, hi)
        filler = tf.tile(tf.reshape(previous, [-1])[:1], [padding])
        return parts + ([filler] if padding else [])

    def _clipped(self, grads: list) -> list:
        """Keras's global_clipnorm: every gradient scaled to their joint norm, summed over the
        ranks' variables."""
        mine = tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])
        norm = tf.sqrt(self.hvd.allreduce(mine, op=self.hvd.Sum, name="global_norm", **self.group))
        clip = self.global_clipnorm
        scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
        return [g * scale for g in grads]

    def _held(self, own: bool) -> list[tuple[str, object]]:
        """(name in the whole optimizer's layout, variable) of this rank's slots, and of the
        optimizer's own variables (step count, learning rate) if `own`."""
        owned, first = self.flat.owned(self.rank), self.flat.bounds[self.rank]
        found = []
        for position, where in enumerate(self.layout.positions):
            if where[0] == "own" and own:
                found.append((optimizer_key(position), self.own[where[1]]))
            elif where[0] == "slot" and where[2] in owned:
                found.append((optimizer_key(position), self.slots[where[1]][where[2] - first]))
        return found

    def state(self) -> dict[str, ReadWhenWritten]:
        """This rank's slots; replica 0 adds the optimizer's own variables."""
        return {key: ReadWhenWritten(v) for key, v in self._held(own=self.rank == 0)}

    def load(self, state: dict[str, np.ndarray]) -> None:
        """Take this rank's variables' slots from a whole optimizer's state (checkpoint layout)."""
        assign_checked(state, self._held(own=True))


class ShardedCheckpoint:
    """A checkpoint of engines whose replicas each keep a shard of the optimizer (`update`):
    replica 0 of a group writes the group's weights part with its shard, every other replica
    its own shard; the manifest lists each group's parts (checkpoint.whole_optimizer_state).
    The engine gives `update`, `variables` (the weights its part holds), `replica`, and
    `read_part()`."""

    def checkpoint_part(self) -> str:
        read = self.read_part()
        return read if self.replica == 0 else shard_part(read, self.replica)

    def state(self) -> dict[str, ArrayLike]:
        weights = weights_state(self.variables) if self.replica == 0 else {}
        return weights | self.update.state()

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        expected = {weight_key(v) for v in self.variables}
        expected |= {optimizer_key(p) for p in range(len(self.update.layout.positions))}
        if expected != state.keys():
            missing = sorted(expected ^ state.keys())[:3]
            raise UserError(f"checkpoint does not match this model (differing {missing})")
        assign_checked(state, [(weight_key(v), v) for v in self.variables])
        self.update.load(state)


def shard_groups(weights_parts: list[str], replicas: int) -> dict:
    """The manifest's entry: each group's parts, its weights part first."""
    groups = {
        read: [read, *(shard_part(read, r) for r in range(1, replicas))] for read in weights_parts
    }
    return {SHARDS: groups}


class ShardedDataParallelEngine(ShardedCheckpoint, DataParallelEngine):
    """Data parallelism whose replicas each hold 1/N of the optimizer's slots."""

    def _stepping_optimizer(self):
        world = self.world
        self.update = ShardedUpdate(
            self.hvd,
            self.optimizer,
            self.trainable,
            world.rank,
            world.size,
            self.cfg.fp16_allreduce,
            self.cfg.bucket_mb,
        )
        return self.update.optimizer

    def _replicated_state(self) -> list:
        return []  # every rank's clone starts afresh, alike; the slots differ by rank

    def _average_and_apply(self, grads: list, loss: tf.Tensor, stop: tf.Tensor) -> tuple:
        loss, stop = self.update.apply(grads, loss, stop)
        return loss, stop, []

    def step_agreeing(self, global_indices: np.ndarray, stop_requested: bool) -> tuple[float, bool]:
        """The base step; a refusal found while its graph was traced is said once for the job
        (TensorFlow re-raises it wrapped in the trace's frames, without its rank marks)."""
        try:
            return super().step_agreeing(global_indices, stop_requested)
        except UserError:
            if self.update.refusal is None:
                raise
            raise UserError(self.update.refusal).on_every_rank(self.world.rank) from None

    @property
    def replica(self) -> int:
        return self.world.rank

    def checkpoint_meta(self) -> dict:
        return shard_groups([self.read_part()], self.world.size)
