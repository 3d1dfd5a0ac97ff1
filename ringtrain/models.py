"""Built-in models as ordered lists of elements, with strategy-independent initialisation.

An element maps one tensor to one tensor (a residual block is one element). Its weights are drawn
from (run seed, element index, variable index) alone, so a pipeline stage that builds only its own
elements starts from exactly the weights single-process training starts from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ringtrain.tensorflow_loader import tf  # before Keras: keeps scikit-learn out of it

# isort: split
import keras


@dataclass
class ModelSpec:
    """A model as element factories; a factory is cheap and creates no weights until built."""

    input_shape: tuple[int, ...]
    factories: list[Callable[[], keras.layers.Layer]]

    def __len__(self) -> int:
        return len(self.factories)

    def shapes(self) -> list[tuple[int, ...]]:
        """Input shape of every element and the output shape of the last, without any weights."""
        shapes = [tuple(self.input_shape)]
        for factory in self.factories:
            out = factory().compute_output_shape((None, *shapes[-1]))
            shapes.append(tuple(int(d) for d in out[1:]))
        return shapes

    def build(self, indices: Sequence[int], seed: int) -> list[keras.layers.Layer]:
        """Build and initialise only the elements named by indices."""
        shapes = self.shapes()
        elements = []
        for i in indices:
            layer = self.factories[i]()
            layer.build((None, *shapes[i]))
            initialise(layer, seed, i)
            elements.append(layer)
        return elements


def _initial_value(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if "bias" in name or name == "beta":
        return np.zeros(shape, np.float32)
    if name == "gamma":
        return np.ones(shape, np.float32)
    if "position" in name:
        return rng.normal(0.0, 0.02, shape).astype(np.float32)
    fan_in, fan_out = int(np.prod(shape[:-1])), int(shape[-1])
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, shape).astype(np.float32)


def initialise(layer: keras.layers.Layer, seed: int, index: int) -> None:
    """Glorot-uniform kernels, zero biases, unit gains: drawn from (seed, index, variable)."""
    for j, variable in enumerate(layer.weights):
        rng = np.random.default_rng([seed, index, j])
        variable.assign(_initial_value(variable.name, tuple(variable.shape), rng))


def element_name(index: int) -> str:
    """Stable element names give stable weight names (layerNN/...) under every strategy."""
    return f"layer{index:02d}"


class FlatDense(keras.layers.Layer):
    """Flatten then Dense, as one element, because a bare Flatten owns no weights."""

    def __init__(self, units: int, activation: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.units, self.activation = units, keras.activations.get(activation)

    def build(self, input_shape):
        features = int(np.prod(input_shape[1:]))
        self.kernel = self.add_weight(name="kernel", shape=(features, self.units))
        self.bias = self.add_weight(name="bias", shape=(self.units,), initializer="zeros")

    def call(self, x):
        x = tf.reshape(x, (tf.shape(x)[0], -1))
        return self.activation(tf.matmul(x, self.kernel) + self.bias)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.units)


class TokenEmbedding(keras.layers.Layer):
    """Rows of an image become tokens: (H, W, C) -> (H, d) plus a learned position embedding."""

    def __init__(self, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim

    def build(self, input_shape):
        tokens, features = int(input_shape[1]), int(np.prod(input_shape[2:]))
        self.kernel = self.add_weight(name="kernel", shape=(features, self.dim))
        self.bias = self.add_weight(name="bias", shape=(self.dim,), initializer="zeros")
        self.position = self.add_weight(name="position", shape=(tokens, self.dim))

    def call(self, x):
        x = tf.reshape(x, (tf.shape(x)[0], x.shape[1], -1))
        return tf.matmul(x, self.kernel) + self.bias + self.position

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[1], self.dim)


class EncoderBlock(keras.layers.Layer):
    """Pre-norm Transformer encoder block (attention + MLP, both residual) as one element.

    The key projection has no bias: softmax ignores a per-query shift, so that bias would only
    receive rounding noise as gradient, which Adam amplifies into strategy-dependent updates.
    """

    def __init__(self, heads: int, hidden: int, **kwargs):
        super().__init__(**kwargs)
        self.heads, self.hidden = heads, hidden

    def build(self, input_shape):
        dim = int(input_shape[-1])
        self.norm1 = keras.layers.LayerNormalization(name="norm1")
        self.norm2 = keras.layers.LayerNormalization(name="norm2")
        self.norm1.build(input_shape)
        self.norm2.build(input_shape)
        weight = self.add_weight
        self.wq, self.q_bias = (
            weight(name="wq", shape=(dim, dim)),
            weight(name="q_bias", shape=(dim,)),
        )
        self.wk = weight(name="wk", shape=(dim, dim))
        self.wv, self.v_bias = (
            weight(name="wv", shape=(dim, dim)),
            weight(name="v_bias", shape=(dim,)),
        )
        self.wo, self.o_bias = (
            weight(name="wo", shape=(dim, dim)),
            weight(name="o_bias", shape=(dim,)),
        )
        self.w1 = weight(name="ffn1_kernel", shape=(dim, self.hidden))
        self.b1 = weight(name="ffn1_bias", shape=(self.hidden,))
        self.w2 = weight(name="ffn2_kernel", shape=(self.hidden, dim))
        self.b2 = weight(name="ffn2_bias", shape=(dim,))

    def _split_heads(self, x):
        batch, tokens, dim = tf.shape(x)[0], x.shape[1], x.shape[2]
        x = tf.reshape(x, (batch, tokens, self.heads, dim // self.heads))
        return tf.transpose(x, (0, 2, 1, 3))

    def call(self, x):
        h = self.norm1(x)
        q = self._split_heads(tf.matmul(h, self.wq) + self.q_bias)
        k = self._split_heads(tf.matmul(h, self.wk))
        v = self._split_heads(tf.matmul(h, self.wv) + self.v_bias)
        scores = tf.matmul(q, k, transpose_b=True) / math.sqrt(q.shape[-1])
        mixed = tf.transpose(tf.matmul(tf.nn.softmax(scores), v), (0, 2, 1, 3))
        mixed = tf.reshape(mixed, tf.shape(x))
        x = x + tf.matmul(mixed, self.wo) + self.o_bias
        h = tf.nn.gelu(tf.matmul(self.norm2(x), self.w1) + self.b1)
        return x + tf.matmul(h, self.w2) + self.b2

    def compute_output_shape(self, input_shape):
        return input_shape


class MeanPoolDense(keras.layers.Layer):
    """Average the tokens, then classify: the transformer's head."""

    def __init__(self, units: int, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = self.add_weight(name="kernel", shape=(int(input_shape[-1]), self.units))
        self.bias = self.add_weight(name="bias", shape=(self.units,), initializer="zeros")

    def call(self, x):
        return tf.matmul(tf.reduce_mean(x, axis=1), self.kernel) + self.bias

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.units)


def _named(
    factories: list[Callable[[str], keras.layers.Layer]],
) -> list[Callable[[], keras.layers.Layer]]:
    return [lambda f=f, i=i: f(element_name(i)) for i, f in enumerate(factories)]


def mlp(
    input_shape: tuple[int, ...], n_classes: int, widths: Sequence[int] = (128, 128, 64)
) -> ModelSpec:
    """Dense elements (four by default): small enough to test on 4 stages, deep enough to
    split; wider ones make a model whose gradients outweigh its compute."""
    first, *rest = widths
    return ModelSpec(
        input_shape,
        _named(
            [
                lambda n: FlatDense(first, "relu", name=n),
                *(lambda n, w=w: keras.layers.Dense(w, "relu", name=n) for w in rest),
                lambda n: keras.layers.Dense(n_classes, name=n),
            ]
        ),
    )


def cnn(input_shape: tuple[int, ...], n_classes: int) -> ModelSpec:
    """Two convolutions, then two dense elements."""
    return ModelSpec(
        input_shape,
        _named(
            [
                lambda n: keras.layers.Conv2D(16, 3, padding="same", activation="relu", name=n),
                lambda n: keras.layers.Conv2D(
                    32, 3, strides=2, padding="same", activation="relu", name=n
                ),
                lambda n: FlatDense(64, "relu", name=n),
                lambda n: keras.layers.Dense(n_classes, name=n),
            ]
        ),
    )


def transformer(
    input_shape: tuple[int, ...], n_classes: int, dim: int = 32, blocks: int = 2
) -> ModelSpec:
    """Image rows as tokens, a few encoder blocks, a mean-pool classifier."""
    blocks_list = [lambda n: EncoderBlock(heads=4, hidden=2 * dim, name=n)] * blocks
    return ModelSpec(
        input_shape,
        _named(
            [
                lambda n: TokenEmbedding(dim, name=n),
                *blocks_list,
                lambda n: MeanPoolDense(n_classes, name=n),
            ]
        ),
    )


BUILTIN = {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def forward(elements: Sequence[keras.layers.Layer], x: tf.Tensor) -> tf.Tensor:
    """Apply elements in order: a whole model or one pipeline stage."""
    for element in elements:
        x = element(x)
    return x


def trainable_variables(elements: Sequence[keras.layers.Layer]) -> list:
    return [v for element in elements for v in element.trainable_weights]


def loss_fn(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Mean cross-entropy over the examples given."""
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.cast(labels, tf.int32), logits=logits
        )
    )
