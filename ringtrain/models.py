"""Built-in models: ordinary Keras Sequential models, trained on the same path as a user's own.

Each layer maps one tensor to one tensor (a residual block is one layer), so a pipeline may cut
between any two. Layers are named layerNN, so their weights keep stable names (layerNN/...)
under every strategy, and are drawn from (run seed, layer index, variable index) alone: the
same model in every process, whatever Keras's own random state.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np

from ringtrain.tensorflow_loader import tf  # before Keras: keeps scikit-learn out of it

# isort: split
import keras

from ringtrain.config import TrainConfig
from ringtrain.errors import UserError
from ringtrain.optim import make_optimizer


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


def _saved(cls):
    """Registered with Keras, so `--save`'s file loads back once ringtrain.models is imported."""
    return keras.saving.register_keras_serializable(package="ringtrain")(cls)


@_saved
class FlatDense(keras.layers.Layer):
    """Flatten then Dense, as one layer, because a bare Flatten owns no weights."""

    def __init__(self, units: int, activation: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.units, self.activation = units, keras.activations.get(activation)

    def get_config(self) -> dict:
        activation = keras.activations.serialize(self.activation)
        return {**super().get_config(), "units": self.units, "activation": activation}

    def build(self, input_shape):
        features = int(np.prod(input_shape[1:]))
        self.kernel = self.add_weight(name="kernel", shape=(features, self.units))
        self.bias = self.add_weight(name="bias", shape=(self.units,), initializer="zeros")

    def call(self, x):
        x = tf.reshape(x, (tf.shape(x)[0], -1))
        return self.activation(tf.matmul(x, self.kernel) + self.bias)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.units)


@_saved
class TokenEmbedding(keras.layers.Layer):
    """Rows of an image become tokens: (H, W, C) -> (H, d) plus a learned position embedding."""

    def __init__(self, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim

    def get_config(self) -> dict:
        return {**super().get_config(), "dim": self.dim}

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


@_saved
class EncoderBlock(keras.layers.Layer):
    """Pre-norm Transformer encoder block (attention + MLP, both residual) as one layer.

    The key projection has no bias: softmax ignores a per-query shift, so that bias would only
    receive rounding noise as gradient, which Adam amplifies into strategy-dependent updates.
    """

    def __init__(self, heads: int, hidden: int, **kwargs):
        super().__init__(**kwargs)
        self.heads, self.hidden = heads, hidden

    def get_config(self) -> dict:
        return {**super().get_config(), "heads": self.heads, "hidden": self.hidden}

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


@_saved
class MeanPoolDense(keras.layers.Layer):
    """Average the tokens, then classify: the transformer's head."""

    def __init__(self, units: int, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def get_config(self) -> dict:
        return {**super().get_config(), "units": self.units}

    def build(self, input_shape):
        self.kernel = self.add_weight(name="kernel", shape=(int(input_shape[-1]), self.units))
        self.bias = self.add_weight(name="bias", shape=(self.units,), initializer="zeros")

    def call(self, x):
        return tf.matmul(tf.reduce_mean(x, axis=1), self.kernel) + self.bias

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.units)


def sequential(
    name: str, input_shape: tuple[int, ...], layers: Sequence[keras.layers.Layer], seed: int
) -> keras.Sequential:
    """Layers in order as one model. Each is built and initialised alone first, so its weights
    are named layerNN/... rather than after the model."""
    shape = (None, *input_shape)
    for i, layer in enumerate(layers):
        layer.build(shape)
        initialise(layer, seed, i)
        shape = layer.compute_output_shape(shape)
    return keras.Sequential([keras.Input(input_shape), *layers], name=name)


def mlp(
    input_shape: tuple[int, ...],
    n_classes: int,
    widths: Sequence[int] = (128, 128, 64),
    seed: int = 0,
) -> keras.Sequential:
    """Dense layers (four by default): small enough to test on 4 stages, deep enough to
    split; wider ones make a model whose gradients outweigh its compute."""
    first, *rest = widths
    name = layer_names()
    layers = [
        FlatDense(first, "relu", name=next(name)),
        *(keras.layers.Dense(w, "relu", name=next(name)) for w in rest),
        keras.layers.Dense(n_classes, name=next(name)),
    ]
    return sequential("mlp", input_shape, layers, seed)


def cnn(input_shape: tuple[int, ...], n_classes: int, seed: int = 0) -> keras.Sequential:
    """Two convolutions, then two dense layers."""
    name = layer_names()
    layers = [
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", name=next(name)),
        keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu", name=next(name)),
        FlatDense(64, "relu", name=next(name)),
        keras.layers.Dense(n_classes, name=next(name)),
    ]
    return sequential("cnn", input_shape, layers, seed)


def transformer(
    input_shape: tuple[int, ...], n_classes: int, dim: int = 32, blocks: int = 2, seed: int = 0
) -> keras.Sequential:
    """Image rows as tokens, a few encoder blocks, a mean-pool classifier."""
    name = layer_names()
    layers = [
        TokenEmbedding(dim, name=next(name)),
        *(EncoderBlock(heads=4, hidden=2 * dim, name=next(name)) for _ in range(blocks)),
        MeanPoolDense(n_classes, name=next(name)),
    ]
    return sequential("transformer", input_shape, layers, seed)


def layer_names() -> Iterator[str]:
    """layer00, layer01, ...: stable layer names give stable weight names under every
    strategy."""
    return (f"layer{i:02d}" for i in itertools.count())


BUILTIN = {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def compile_classifier(
    model: keras.Model, optimizer: str = "sgd", lr: float = 0.05, clip_norm: float | None = None
) -> keras.Model:
    """Compile a built-in as a user would: mean cross-entropy on its logits, accuracy."""
    model.compile(
        optimizer=make_optimizer(optimizer, lr, clip_norm),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def builtin(
    cfg: TrainConfig, input_shape: tuple[int, ...], n_classes: int, weightless: bool = False
) -> keras.Model:
    """`--model NAME`: the built-in, compiled with --optimizer at --lr and --clip-norm (its
    variables left pending on a pipeline rank, as a user's model's are). A model that cannot
    take the data's rows (a cnn on flat features) is a bad input, not a crash."""
    from ringtrain.keras_model.source import built

    def build():
        try:
            model = BUILTIN[cfg.model](input_shape, n_classes, seed=cfg.seed)
        except ValueError as exc:
            problem = str(exc).strip().splitlines()[0]
            raise UserError(
                f"--model {cfg.model} does not fit rows of shape {input_shape}: {problem}"
            ) from None
        return compile_classifier(model, cfg.optimizer, cfg.lr, cfg.clip_norm)

    return built(build, weightless)
