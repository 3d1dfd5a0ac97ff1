"""A pipeline stage and what crosses its boundaries.

A `Stage` holds a piece of a compiled Keras model's graph: a keras.Model over the tensors
that cross its cuts. Several tensors may cross together, of any dtype (hidden states and an
integer padding mask), and only the float ones carry gradients back. `PackedCodec` moves them:
their bytes packed into one buffer (contiguous numpy, never pickled), sized for the largest
microbatch, as a partial batch makes smaller ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ringtrain.gradients import add_gradients
from ringtrain.pipeline.calls import CompiledCall, KeptPair
from ringtrain.tensorflow_loader import tf


class PackedCodec:
    """Several tensors (shape per example, dtype) packed as bytes into one uint8 buffer."""

    def __init__(self, specs: Sequence[tuple[tuple[int, ...], str]]):
        self.specs = [(tuple(shape), np.dtype(dtype)) for shape, dtype in specs]
        self.row_bytes = [int(np.prod(s)) * d.itemsize for s, d in self.specs]

    def nbytes(self, batch: int) -> int:
        return batch * sum(self.row_bytes)

    def empty(self, batch: int) -> np.ndarray:
        return np.zeros(self.nbytes(batch), np.uint8)

    def encode(self, values) -> np.ndarray:
        parts = [np.ascontiguousarray(v.numpy()).reshape(-1).view(np.uint8) for v in values]
        if len(parts) == 1:  # most cuts: one tensor, sent from its own bytes without a copy
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, np.uint8)

    def decode(self, buf: np.ndarray, batch: int) -> tuple:
        values, offset = [], 0
        for (shape, dtype), row in zip(self.specs, self.row_bytes, strict=True):
            size = batch * row
            part = np.copy(buf[offset : offset + size]).view(dtype).reshape(batch, *shape)
            values.append(tf.constant(part))
            offset += size
        return tuple(values)


class Stage:
    """One of the stages this rank holds: `piece`, a keras.Model from the tensors crossing
    into it to the tensors crossing out (on the last stage, the model's outputs, whose loss is
    the compiled loss, weighted by the microbatch's share of the global batch), and its
    compiled functions. It shares the model's layers, so their weights and names.

    A microbatch's backward adds its weight gradients into the stage's sums (variables, in
    the backward's own graph), which the optimizer's compiled step reads at REDUCE. The
    forward either keeps its activations (`forward_keeping`, the default) or only its input,
    and the backward then redoes it (`recomputes`, --recompute: less memory, a forward more).
    """

    def __init__(self, index: int, n_stages: int, piece, model, microbatches: int):
        self.index, self.first, self.last = index, index == 0, index == n_stages - 1
        self.piece, self.model, self.microbatches = piece, model, microbatches
        self.float_inputs = [i for i, t in enumerate(piece.inputs) if is_float(t.dtype)]
        self.float_outputs = [i for i, t in enumerate(piece.outputs) if is_float(t.dtype)]
        self.variables = list(piece.trainable_variables)
        self.weights = list(piece.weights)  # what a checkpoint and the gathered weights hold
        self.grads: list | None = None  # the step's reduced gradients, for STEP
        self.stateful = changes_state(piece)
        self.recomputes = False  # the executor's choice: see changes_state for when it may
        self.sums: list | None = None  # the step's weight-gradient sums, made on first use
        self.summing = False  # whether this step's first backward has written the sums
        self.slices: dict[int, tf.IndexedSlices] = {}  # sparse gradients' sums, by variable
        # Graphs, not eager ops: per-op Python overhead would dwarf a microbatch's compute. A
        # partial batch's smaller microbatch may come, so shapes are relaxed, not retraced.
        self.output = CompiledCall(tf.function(self._output, reduce_retracing=True))
        # Its own function: a concrete function once run under a tape carries that tape's
        # extra outputs, and the pair is built from the function's outputs as traced.
        self.kept = KeptPair(
            tf.function(self._output_keeping, reduce_retracing=True),
            self.variables,
            self._add_into_sums,
        )
        self._compiled_backward = CompiledCall(
            tf.function(self._recomputed_backward, reduce_retracing=True)
        )
        # evaluation's forward, compiled too: eagerly it took 20 ms a chunk on a small stage
        self.infer = CompiledCall(tf.function(self._inferred, reduce_retracing=True))

    def forward(self, x, y, share) -> tuple:
        """(the output, its kept activations or None) of one microbatch, as the stage runs."""
        if self.recomputes:
            return self.output(x, y, share), None
        return self.forward_keeping(x, y, share)

    def forward_keeping(self, x, y, share):
        """(the output, its kept activations) of one microbatch."""
        return self.kept.forward(x, y, share)

    def backward(self, kept, x, y, share, upstream):
        """One microbatch's whole backward in one compiled call: from its kept activations
        (`kept`), or else (--recompute) with its forward redone in the same call. Its weight
        gradients are added into the stage's sums in that call's graph; the step's first
        backward overwrites them, so they are never zeroed. Returns the input gradient, or
        None."""
        inputs = not self.first
        if not self.sources(x, True, inputs):  # a frozen first stage: nothing to compute
            return None
        if self.sums is None:
            self.sums = [tf.Variable(tf.zeros_like(v), trainable=False) for v in self.variables]
        first, self.summing = not self.summing, True
        if kept is None:
            tail, slices = self._compiled_backward(x, y, share, upstream, inputs, first)
        else:
            seeds = None if self.last else tf.nest.flatten(self.targets(None, upstream)[1])
            grads, slices = self.kept.backward(kept, seeds, first)
            tail = self.sources(tuple(grads), False, inputs)
        for i, grad in slices.items():
            self.slices[i] = grad if first else add_gradients([self.slices[i]], [grad])[0]
        return self.input_gradient(tail)

    def _recomputed_backward(self, x, y, share, upstream, inputs: bool, first: bool) -> tuple:
        with tf.GradientTape() as tape:
            tape.watch(self.sources(x, False, inputs))
            out = self._output(x, y, share)
        targets, upstream = self.targets(out, upstream)
        grads = tape.gradient(
            targets,
            self.sources(x, True, inputs),
            output_gradients=upstream,
            unconnected_gradients="zero",
        )
        count = len(self.variables)
        return grads[count:], self._add_into_sums(grads[:count], first)

    def _add_into_sums(self, grads: list, first: bool) -> dict:
        """Inside a backward's graph: each weight's gradient written into (`first`) or added
        to its sum; an embedding's slices are returned instead. None is an unused weight's."""
        slices = {}
        for i, (total, grad) in enumerate(zip(self.sums, grads, strict=True)):
            if isinstance(grad, tf.IndexedSlices):
                # An embedding's rows, duplicates and all: Keras's optimizers update by the
                # slices (Adam squares each), so they are kept as slices, as a tape's are.
                slices[i] = grad
            elif grad is None:
                if first:
                    total.assign(tf.zeros_like(total))
            elif first:
                total.assign(grad)
            else:
                total.assign_add(grad)
        return slices

    def summed_gradients(self) -> list:
        """The step's weight-gradient sums (variables, which a compiled step reads in place;
        an embedding's slices), and the next backward starts a new sum."""
        self.summing = False
        return [self.slices.get(i, total) for i, total in enumerate(self.sums or [])]

    def _output(self, x: tuple, y, share=None):
        out = self.piece(list(x), training=True)
        outs = tuple(out) if isinstance(out, list | tuple) else (out,)
        if not self.last:
            return outs
        y_pred = outs[0] if len(outs) == 1 else list(outs)
        loss = self.model.compute_loss(y=y, y_pred=y_pred, training=True)
        return loss * tf.cast(share, loss.dtype)

    def _output_keeping(self, x: tuple, y, share=None):
        """`_output`, whose backward takes no gradient for the model's inputs: none flows
        into them. Stopped in the graph, it prunes that work from every backward."""
        if self.first:
            x = tf.nest.map_structure(tf.stop_gradient, x)
        return self._output(x, y, share)

    def sources(self, x: tuple, weights: bool, inputs: bool) -> list:
        differentiable = [x[i] for i in self.float_inputs] if inputs and not self.first else []
        return (self.variables if weights else []) + differentiable

    def targets(self, out, upstream) -> tuple:
        if self.last:
            return out, None
        made = None if out is None else [out[i] for i in self.float_outputs]
        return made, list(upstream)

    def input_gradient(self, tail: list):
        return tuple(tail) if tail else None

    def first_inputs(self, x) -> tuple:
        """The model's inputs in its own order, from an array or a dict keyed by input name."""
        if isinstance(x, dict):
            return tuple(tf.constant(x[t.name.split(":")[0]]) for t in self.piece.inputs)
        return (tf.constant(x),)

    def state_variables(self) -> list:
        """What a training forward may change: BatchNormalization's statistics, seeds."""
        return list(self.piece.non_trainable_variables)

    def _inferred(self, x: tuple):
        out = self.piece(list(x), training=False)
        return tuple(out) if isinstance(out, list | tuple) else (out,)

    @staticmethod
    def codecs_of(piece) -> tuple[PackedCodec, PackedCodec]:
        """(what a piece sends downstream, the gradient it sends upstream: its float inputs')."""
        outs = [(_per_example(t), t.dtype) for t in piece.outputs]
        grads = [(_per_example(t), t.dtype) for t in piece.inputs if is_float(t.dtype)]
        return PackedCodec(outs), PackedCodec(grads)


def share_tensors(shares: list[float]) -> list[tf.Tensor]:
    """Microbatches' loss shares as float32 tensors, made in one op: one trace then serves
    every share, where a Python float is traced into the graph, once per value."""
    return tf.unstack(tf.constant(shares, tf.float32))


def changes_state(piece) -> bool:
    """Whether a training forward changes state: BatchNormalization's moving statistics, a
    dropout's random seed. A forward redone in the backward would change it twice and draw
    other masks than the forward did, so such a stage keeps its tape instead."""
    for layer in piece._flatten_layers(include_self=False):
        if list(layer._flatten_layers(include_self=False)):
            continue  # a container: its leaves decide
        weights = {id(w) for w in layer.weights}
        seeds = [v for v in layer.non_trainable_variables if id(v) not in weights]
        if seeds or (layer.trainable and layer.non_trainable_weights):
            return True
    return False


def is_float(dtype) -> bool:
    """Whether a tensor of this dtype carries gradients across a cut."""
    return np.dtype(str(dtype)).kind == "f"


def _per_example(tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in tensor.shape[1:])
