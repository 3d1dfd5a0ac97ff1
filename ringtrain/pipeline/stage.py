"""A pipeline stage and what crosses its boundaries, for both kinds of model the executor runs.

`Stage` holds a contiguous run of ringtrain's built-in elements: one float tensor in, one out.
`KerasStage` holds a piece of a user's functional graph (a keras.Model over the tensors that
cross its cuts): several tensors may cross together, of any dtype (hidden states and an
integer padding mask), and only the float ones carry gradients back. The executor treats both
alike through the same methods, and moves their values with a codec: `FloatCodec` sends the
one float32 tensor as it is, `PackedCodec` packs several tensors' bytes into one buffer
(contiguous numpy, never pickled), sized for the largest microbatch, as a partial batch makes
smaller ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ringtrain.models import forward, loss_fn, trainable_variables
from ringtrain.tensorflow_loader import tf


class FloatCodec:
    """One float32 tensor of a fixed shape per example: a built-in boundary."""

    def __init__(self, shape: Sequence[int]):
        self.shape = tuple(shape)

    def nbytes(self, batch: int) -> int:
        return 4 * batch * int(np.prod(self.shape))

    def empty(self, batch: int) -> np.ndarray:
        return np.zeros((batch, *self.shape), np.float32)

    def encode(self, value) -> np.ndarray:
        return np.ascontiguousarray(value.numpy())

    def decode(self, buf: np.ndarray, batch: int):
        return tf.constant(np.copy(buf[:batch]))


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
    """One of a built-in model's stages held by this rank: its elements, compiled functions."""

    def __init__(self, index: int, n_stages: int, elements: list, microbatches: int):
        self.index, self.first, self.last = index, index == 0, index == n_stages - 1
        self.elements, self.microbatches = elements, microbatches
        self.variables = trainable_variables(elements)
        self.weights = self.variables  # what a checkpoint and the gathered weights hold
        self.grads: list | None = None  # the step's sum so far: no zeros to add the first to
        # Graphs, not eager ops: per-op Python overhead would dwarf a microbatch's compute.
        self.output = tf.function(self._output)
        self.recompute = tf.function(self._recompute)

    def _output(self, x: tf.Tensor, y: tf.Tensor, share=None) -> tf.Tensor:
        """The activation sent downstream or, on the last stage, its share of the loss (equal
        microbatches: a 1/M share, whatever `share` says)."""
        out = forward(self.elements, x)
        return loss_fn(y, out) / self.microbatches if self.last else out

    def sources(self, x: tf.Tensor, weights: bool, inputs: bool) -> list:
        """What a backward differentiates: the weights and/or, except on stage 0, the input."""
        return (self.variables if weights else []) + ([x] if inputs and not self.first else [])

    def targets(self, out, upstream) -> tuple:
        """(what the backward differentiates, the gradients it starts from)."""
        return out, upstream

    def input_gradient(self, tail: list):
        return tail[0] if tail else None

    def first_inputs(self, x: np.ndarray) -> tf.Tensor:
        return tf.constant(x)

    def infer(self, x):
        return forward(self.elements, x)

    def _recompute(self, x, y, share, upstream, weights: bool, inputs: bool) -> list:
        """--recompute: the forward again under a tape (only the input was kept), then the
        gradients a full backward (B) or one half of a split one (BI, BW) needs."""
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = self._output(x, y, share)
        targets, upstream = self.targets(out, upstream)
        return tape.gradient(
            targets,
            self.sources(x, weights, inputs),
            output_gradients=upstream,
            unconnected_gradients="zero",
        )


class KerasStage(Stage):
    """A piece of a user's compiled model: `piece` is a keras.Model from the tensors crossing
    into it to the tensors crossing out (on the last stage, the model's outputs, whose loss
    is the user's compiled loss, weighted by the microbatch's share of the global batch)."""

    def __init__(self, index: int, n_stages: int, piece, model, microbatches: int):
        self.piece, self.model = piece, model
        super().__init__(index, n_stages, [], microbatches)
        self.variables = list(piece.trainable_variables)
        self.weights = list(piece.weights)
        self.float_inputs = [i for i, t in enumerate(piece.inputs) if is_float(t.dtype)]
        self.float_outputs = [i for i, t in enumerate(piece.outputs) if is_float(t.dtype)]
        self.output = tf.function(self._output, reduce_retracing=True)
        self.recompute = tf.function(self._recompute, reduce_retracing=True)

    def _output(self, x: tuple, y, share=None):
        out = self.piece(list(x), training=True)
        outs = tuple(out) if isinstance(out, list | tuple) else (out,)
        if not self.last:
            return outs
        y_pred = outs[0] if len(outs) == 1 else list(outs)
        return self.model.compute_loss(y=y, y_pred=y_pred, training=True) * share

    def sources(self, x: tuple, weights: bool, inputs: bool) -> list:
        differentiable = [x[i] for i in self.float_inputs] if inputs and not self.first else []
        return (self.variables if weights else []) + differentiable

    def targets(self, out, upstream) -> tuple:
        if self.last:
            return out, None
        return [out[i] for i in self.float_outputs], list(upstream)

    def input_gradient(self, tail: list):
        return tuple(tail) if tail else None

    def first_inputs(self, x) -> tuple:
        """The model's inputs in its own order, from an array or a dict keyed by input name."""
        if isinstance(x, dict):
            return tuple(tf.constant(x[t.name.split(":")[0]]) for t in self.piece.inputs)
        return (tf.constant(x),)

    def infer(self, x: tuple):
        out = self.piece(list(x), training=False)
        return tuple(out) if isinstance(out, list | tuple) else (out,)

    @staticmethod
    def codecs_of(piece) -> tuple[PackedCodec, PackedCodec]:
        """(what a piece sends downstream, the gradient it sends upstream: its float inputs')."""
        outs = [(_per_example(t), t.dtype) for t in piece.outputs]
        grads = [(_per_example(t), t.dtype) for t in piece.inputs if is_float(t.dtype)]
        return PackedCodec(outs), PackedCodec(grads)


def is_float(dtype) -> bool:
    """Whether a tensor of this dtype carries gradients across a cut."""
    return np.dtype(str(dtype)).kind == "f"


def _per_example(tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in tensor.shape[1:])
