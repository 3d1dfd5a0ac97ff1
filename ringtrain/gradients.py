"""Sums of gradient lists, across microbatches or accumulation slices, dense or sparse.

An embedding's gradient is IndexedSlices: the parts' rows are kept together, as one
process's gradient over the whole batch holds them (see collectives._average_slices). Keras's
optimizers then update only those rows; a dense sum would move every row and differ from one
process.
"""

from __future__ import annotations

from ringtrain.tensorflow_loader import tf


def add_gradients(total: list, new: list) -> list:
    return [_add(a, g) for a, g in zip(total, new, strict=True)]


def _add(total, new):
    if isinstance(new, tf.IndexedSlices):
        values = tf.concat([total.values, new.values], 0)
        return tf.IndexedSlices(values, tf.concat([total.indices, new.indices], 0), new.dense_shape)
    return total + new


def scaled_gradient(grad, factor: float):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * factor
