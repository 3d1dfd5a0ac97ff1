"""ZeRO stage 1 (--shard-optimizer): each data-parallel replica keeps the optimizer's slots
(Adam's moments, momentum) for 1/N of the weights instead of all of them.

The trainable variables are laid end to end, in the model's order, as one flat vector padded
to a multiple of N; rank r owns its r-th contiguous slice. A step reduce-scatters the flat
gradient, so each rank receives the average of its slice alone (the loss and the stop flag ride
along, once in every slice). A clone of the compiled optimizer (same class, options, schedule
and step count), built over one flat variable holding this rank's slice of the weights, updates
that slice; an allgather brings the slices back and every rank writes the whole model.

Keras's elementwise optimizers compute the same numbers over a slice as over the variables it
cuts across. Gradient clipping needs whole gradients: their norms (per variable for clipnorm,
all together for global_clipnorm) come from one small allreduce of per-variable sums of
squares, and Keras's formulas are applied to the slice. What needs a variable's identity or
more than its elements (exclude_from_weight_decay, an EMA of the weights, Keras's own gradient
accumulation, a non-elementwise optimizer) is refused.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from ringtrain.tensorflow_loader import tf  # before Keras: keeps scikit-learn out of it

# isort: split
import keras

from ringtrain.checkpoint import (
    SHARDS,
    assign_checked,
    optimizer_key,
    shard_key,
    weight_key,
    weights_state,
)
from ringtrain.dataparallel.engine import DataParallelEngine
from ringtrain.errors import UserError

CHUNK_BYTES = 16 * 2**20  # a reduce-scatter's input at most (--bucket-mb sets it)

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
    """Refuse, in one line, what a slice of the flat weights cannot compute as Keras would."""
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


class FlatLayout:
    """The trainable variables end to end, padded to `ranks` equal slices of `shard` elements."""

    def __init__(self, shapes: list[tuple[int, ...]], ranks: int):
        self.shapes = [tuple(shape) for shape in shapes]
        self.sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self.shapes]
        self.offsets = [int(x) for x in np.cumsum([0, *self.sizes[:-1]])]
        self.total, self.ranks = sum(self.sizes), ranks
        self.shard = -(-self.total // ranks)

    def pieces(self, rank: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int, int]]:
        """(variable, start, stop) of each part of a variable, flattened, in rank's slice (or in
        its elements lo to hi)."""
        hi = self.shard if hi is None else hi
        start, stop = rank * self.shard + lo, rank * self.shard + hi
        found = []
        for i, (offset, size) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            a, b = max(start, offset), min(stop, offset + size)
            if a < b:
                found.append((i, a - offset, b - offset))
        return found

    def padding(self, rank: int, lo: int = 0, hi: int | None = None) -> int:
        hi = self.shard if hi is None else hi
        return hi - lo - sum(b - a for _, a, b in self.pieces(rank, lo, hi))

    def chunks(self, chunk_elements: int) -> list[tuple[int, int]]:
        """Equal ranges of every slice, each reduce-scattered on its own: rank r's elements lo
        to hi of chunk (lo, hi) are its share of that call, so the slices stay as laid out."""
        step = max(1, chunk_elements // self.ranks)
        return [(lo, min(lo + step, self.shard)) for lo in range(0, self.shard, step)]


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
    """This rank's slice of the weights, its optimizer, and the step that updates through it."""

    def __init__(
        self,
        hvd,
        optimizer,
        trainable: list,
        rank: int,
        ranks: int,
        fp16: bool,
        chunk_bytes: int = CHUNK_BYTES,
    ):
        self.hvd, self.trainable, self.rank, self.refusal = hvd, trainable, rank, None
        self.flat = FlatLayout([tuple(v.shape) for v in trainable], ranks)
        self.pieces, self.pad = self.flat.pieces(rank), self.flat.padding(rank)
        self.compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
        self.clipnorm, self.global_clipnorm = optimizer.clipnorm, optimizer.global_clipnorm
        self.layout = OptimizerLayout(optimizer, len(trainable))
        # The slice in chunks, each its own variable: the optimizer's temporaries (Adam makes
        # several per variable as it updates) are then a chunk's size, not the slice's.
        self.chunks = self.flat.chunks(chunk_bytes // 4)
        self.params = [
            keras.Variable(np.zeros(hi - lo, np.float32), name=f"shard_{lo}")
            for lo, hi in self.chunks
        ]
        self.optimizer = clone_optimizer(optimizer, clipnorm=None, global_clipnorm=None)
        self.optimizer.build(self.params)
        chunked = OptimizerLayout(self.optimizer, len(self.params))
        self.own, self.slots = [], [[None] * len(self.params) for _ in range(chunked.kinds)]
        for v, where in zip(self.optimizer.variables, chunked.positions, strict=False):
            if where[0] == "own":
                self.own.append(v)
            else:
                self.slots[where[1]][where[2]] = v
        if (
            len(self.optimizer.variables) != len(chunked.positions)
            or len(self.own) != self.layout.own
            or chunked.kinds != self.layout.kinds
        ):
            raise UserError(f"--shard-optimizer cannot lay out the slots of {optimizer.name}")

    def apply(self, grads: list, loss: tf.Tensor, stop: tf.Tensor) -> tuple:
        """(loss, stop) averaged over the replicas, the weights updated: in the step's graph.
        Chunk by chunk, one after another, so the step holds the gradients and one chunk's
        copy of them: one reduce-scatter of them all would copy them whole, and MPI and
        Horovod add buffers of that size; one allgather would hold a second copy of the
        weights."""
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
        flat = [tf.reshape(g, [-1]) for g in grads]
        riders = tf.stack([loss, stop])
        received, done = [], []
        for lo, hi in self.chunks:  # rank r's elements lo to hi of the slice come to rank r
            last = [riders] if hi == self.flat.shard else []
            with tf.control_dependencies(done):
                sent = tf.concat(
                    [
                        x
                        for r in range(self.flat.ranks)
                        for x in [*self._parts(flat, r, lo, hi), *last]
                    ],
                    0,
                )
            done = [
                self.hvd.reducescatter(
                    sent, op=self.hvd.Average, compression=self.compression, name=f"shard_{lo}"
                )
            ]
            received.append(done[0])
        tail = self.chunks[-1][1] - self.chunks[-1][0]
        loss, stop, received[-1] = received[-1][tail], received[-1][tail + 1], received[-1][:tail]
        if self.clipnorm or self.global_clipnorm:
            whole = self._clipped(tf.concat(received, 0) if len(received) > 1 else received[0])
            received = tf.split(whole, [hi - lo for lo, hi in self.chunks])
        weights = [v.value for v in self.trainable]
        for (lo, hi), params in zip(self.chunks, self.params, strict=True):
            params.assign(tf.concat(self._parts(weights, self.rank, lo, hi), 0))
        self.optimizer.apply_gradients(zip(received, self.params, strict=True))
        self._gather_back()
        return loss, stop

    def _gather_back(self) -> None:
        """Every rank's updated chunks into the model's variables: a variable is written once
        all its pieces have come."""
        shard = self.flat.shard
        pieces: dict[int, list] = {i: [] for i in range(len(self.trainable))}
        done: list = []
        for (lo, hi), params in zip(self.chunks, self.params, strict=True):
            with tf.control_dependencies(done):
                got = self.hvd.allgather(tf.convert_to_tensor(params.value), name=f"gather_{lo}")
            done = [got]
            for r in range(self.flat.ranks):
                start = r * (hi - lo) - (r * shard + lo)  # flat position -> place in `got`
                for i, a, b in self.flat.pieces(r, lo, hi):
                    at = start + self.flat.offsets[i] + a
                    pieces[i].append((a, b - a, got[at : at + b - a]))
                    if sum(n for _, n, _ in pieces[i]) == self.flat.sizes[i]:
                        ordered = sorted(pieces.pop(i), key=lambda piece: piece[0])
                        done.append(self._write(i, [p for _, _, p in ordered]))

    def _write(self, i: int, pieces: list):
        v = self.trainable[i]
        written = v.assign(
            tf.reshape(pieces[0] if len(pieces) == 1 else tf.concat(pieces, 0), v.shape)
        )
        if v.constraint is not None:  # as Keras's optimizer does after its update
            written = v.assign(v.constraint(v))
        return written

    def _parts(self, tensors: list, rank: int, lo: int = 0, hi: int | None = None) -> list:
        """The pieces of rank's slice (elements lo to hi of it) of per-variable tensors laid end
        to end, and zeros for its padding: concatenated once where they are needed, never as a
        whole flat vector first (each copy of the gradients is as large as Adam's two slots are
        over N)."""
        pieces = self.flat.pieces(rank, lo, hi)
        parts = [tf.reshape(tensors[i], [-1])[a:b] for i, a, b in pieces]
        padding = self.flat.padding(rank, lo, hi)
        return parts + ([tf.zeros([padding], tf.float32)] if padding else [])

    def _clipped(self, grad: tf.Tensor) -> tf.Tensor:
        """Keras's clipnorm (each variable's gradient to its own norm) or global_clipnorm (all of
        them to their joint norm), from the squared norms every rank's slice contributes."""
        sizes = [b - a for _, a, b in self.pieces]
        parts = tf.split(grad, [*sizes, self.pad]) if self.pieces else [grad]
        ids = [[i] for i, _, _ in self.pieces]
        sums = tf.zeros([len(self.trainable)], tf.float32)
        if ids:
            squares = tf.stack([tf.reduce_sum(tf.square(p)) for p in parts[: len(ids)]])
            sums = tf.scatter_nd(ids, squares, [len(self.trainable)])
        sums = self.hvd.allreduce(sums, op=self.hvd.Sum)
        if self.global_clipnorm:
            clip, norm = self.global_clipnorm, tf.sqrt(tf.reduce_sum(sums))
            scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
            return grad * scale
        clip, clipped = self.clipnorm, []
        for (i, _, _), part in zip(self.pieces, parts, strict=False):
            positive = sums[i] > 0
            safe = tf.where(positive, sums[i], tf.ones_like(sums[i]))
            norm = tf.where(positive, tf.sqrt(safe), sums[i])
            clipped.append(part * clip / tf.maximum(norm, clip))
        return tf.concat(clipped + parts[len(self.pieces) :], 0)

    def state(self, rank: int) -> dict[str, np.ndarray]:
        """This rank's slots; rank 0 adds the optimizer's own variables, in the whole layout."""
        found = {
            shard_key(k): np.concatenate([chunk.numpy() for chunk in chunks])
            for k, chunks in enumerate(self.slots)
        }
        if rank == 0:
            for position, where in enumerate(self.layout.positions):
                if where[0] == "own":
                    found[optimizer_key(position)] = np.asarray(self.own[where[1]].numpy())
        return found

    def load(self, state: dict[str, np.ndarray]) -> None:
        """Take this rank's slice of a whole optimizer's state (checkpoint layout)."""
        by_slot, own = {}, []
        for position, where in enumerate(self.layout.positions):
            key = optimizer_key(position)
            if where[0] == "own":
                own.append((key, self.own[where[1]]))
            else:
                by_slot[where[1:]] = state[key]
        assign_checked(state, own)
        for kind, chunks in enumerate(self.slots):
            per_variable = [by_slot.get((kind, i)) for i in range(len(self.trainable))]
            stored = [s for s in per_variable if s is not None]
            if len(stored) != len(per_variable) or any(
                s.size != n for s, n in zip(stored, self.flat.sizes, strict=True)
            ):
                raise UserError("checkpoint's optimizer slots do not match this model")
            values = [s.astype(np.float32) for s in per_variable]
            for (lo, hi), chunk in zip(self.chunks, chunks, strict=True):
                chunk.assign(tf.concat(self._parts(values, self.rank, lo, hi), 0))

    def manifest_entry(self, parts: list[str]) -> dict:
        """How the shards lay out each slot of the whole optimizer, for checkpoint.py."""
        slots = [
            [position, where[1], self.flat.offsets[where[2]], list(self.flat.shapes[where[2]])]
            for position, where in enumerate(self.layout.positions)
            if where[0] == "slot"
        ]
        return {SHARDS: {"parts": parts, "slots": slots}}


class ShardedDataParallelEngine(DataParallelEngine):
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
            int(self.cfg.bucket_mb * 2**20) if self.cfg.bucket_mb else CHUNK_BYTES,
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

    def checkpoint_part(self) -> str:
        return self._part(self.world.rank)

    @staticmethod
    def _part(rank: int) -> str:
        """Rank 0 writes the weights beside its shard, under the whole model's part name."""
        return "model" if rank == 0 else f"optimizer-shard-{rank:05d}"

    def state(self) -> dict[str, ArrayLike]:
        weights = weights_state(self.variables) if self.world.rank == 0 else {}
        return weights | self.update.state(self.world.rank)

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        expected = {weight_key(v) for v in self.variables}
        expected |= {optimizer_key(p) for p in range(len(self.update.layout.positions))}
        if expected != state.keys():
            missing = sorted(expected ^ state.keys())[:3]
            raise UserError(f"checkpoint does not match this model (differing {missing})")
        assign_checked(state, [(weight_key(v), v) for v in self.variables])
        self.update.load(state)

    def checkpoint_meta(self) -> dict:
        return self.update.manifest_entry([self._part(r) for r in range(self.world.size)])
