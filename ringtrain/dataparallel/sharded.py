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

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """(variable, start, stop) of each part of a variable, flattened, in rank's slice."""
        start, stop = rank * self.shard, (rank + 1) * self.shard
        found = []
        for i, (offset, size) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            a, b = max(start, offset), min(stop, offset + size)
            if a < b:
                found.append((i, a - offset, b - offset))
        return found

    def padding(self, rank: int) -> int:
        return self.shard - sum(b - a for _, a, b in self.pieces(rank))


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

    def __init__(self, hvd, optimizer, trainable: list, rank: int, ranks: int, fp16: bool):
        self.hvd, self.trainable, self.rank, self.refusal = hvd, trainable, rank, None
        self.flat = FlatLayout([tuple(v.shape) for v in trainable], ranks)
        self.pieces, self.pad = self.flat.pieces(rank), self.flat.padding(rank)
        self.compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
        self.clipnorm, self.global_clipnorm = optimizer.clipnorm, optimizer.global_clipnorm
        self.layout = OptimizerLayout(optimizer, len(trainable))
        self.optimizer = clone_optimizer(optimizer, clipnorm=None, global_clipnorm=None)
        self.params = keras.Variable(np.zeros(self.flat.shard, np.float32), name="shard")
        self.optimizer.build([self.params])
        self.own = [v for v in self.optimizer.variables if len(v.shape) == 0]
        self.slots = [v for v in self.optimizer.variables if len(v.shape) == 1]
        if len(self.own) != self.layout.own or len(self.slots) != self.layout.kinds:
            raise UserError(f"--shard-optimizer cannot lay out the slots of {optimizer.name}")

    def apply(self, grads: list, loss: tf.Tensor, stop: tf.Tensor) -> tuple:
        """(loss, stop) averaged over the replicas, the weights updated: in the step's graph."""
        ranks, shard = self.flat.ranks, self.flat.shard
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
        sent = tf.concat([x for r in range(ranks) for x in [*self._parts(flat, r), riders]], 0)
        mine = self.hvd.reducescatter(sent, op=self.hvd.Average, compression=self.compression)
        grad, loss, stop = mine[:shard], mine[shard], mine[shard + 1]
        if self.clipnorm or self.global_clipnorm:
            grad = self._clipped(grad)
        self.params.assign(self._slice([v.value for v in self.trainable], self.rank))
        self.optimizer.apply_gradients([(grad, self.params)])
        whole = self.hvd.allgather(tf.convert_to_tensor(self.params.value))
        for v, offset, size in zip(self.trainable, self.flat.offsets, self.flat.sizes, strict=True):
            v.assign(tf.reshape(whole[offset : offset + size], v.shape))
            if v.constraint is not None:  # as Keras's optimizer does after its update
                v.assign(v.constraint(v))
        return loss, stop

    def _parts(self, tensors: list, rank: int) -> list:
        """The pieces of rank's slice of per-variable tensors laid end to end, and zeros for its
        padding: concatenated once where they are needed, never as a whole flat vector first
        (each copy of the gradients is as large as Adam's two slots are over N)."""
        parts = [tf.reshape(tensors[i], [-1])[a:b] for i, a, b in self.flat.pieces(rank)]
        padding = self.flat.padding(rank)
        return parts + ([tf.zeros([padding], tf.float32)] if padding else [])

    def _slice(self, tensors: list, rank: int) -> tf.Tensor:
        return tf.concat(self._parts(tensors, rank), 0)

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
        found = {shard_key(k): np.asarray(slot.numpy()) for k, slot in enumerate(self.slots)}
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
        for kind, slot in enumerate(self.slots):
            per_variable = [by_slot.get((kind, i)) for i in range(len(self.trainable))]
            stored = [s for s in per_variable if s is not None]
            if len(stored) != len(per_variable) or any(
                s.size != n for s, n in zip(stored, self.flat.sizes, strict=True)
            ):
                raise UserError("checkpoint's optimizer slots do not match this model")
            slot.assign(self._slice([s.astype(np.float32) for s in per_variable], self.rank))

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

    def state(self) -> dict[str, np.ndarray]:
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
