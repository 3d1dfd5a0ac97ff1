"""Models and data as a user brings them: `ringtrain train --model tests/user_models.py:NAME
--data tests/user_models.py:DATA`, or `ringtrain.fit(NAME(), *DATA())`. Plain Keras 3, nothing
from ringtrain.

Each model function returns a compiled model and draws nothing random beyond its layers'
initialisers: whoever calls it seeds first (`keras.utils.set_random_seed`). Every layer is
named, so a weight's path (`conv/kernel`) is the same in every process whatever else that
process built before: the reference (tests/reference.py) matches a run's weights to its own by
path. Its keyword arguments are what `--model-arg KEY=VALUE` sets.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import keras
import numpy as np

DIGITS_TRAIN, DIGITS_HELD_OUT = 300, 200
DIGITS_SHAPE, DIGITS_CLASSES = (8, 8, 1), 10
BERT_TOKENS = 16  # the example's sequences are 32: its position embeddings fit both
REGRESSION_FEATURES = 16


def _classification(model: keras.Model, optimizer: keras.optimizers.Optimizer) -> keras.Model:
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _optimizer(name: str) -> keras.optimizers.Optimizer:
    """Adam, or SGD with Nesterov momentum: the two ways of keeping per-weight state."""
    if name == "adam":
        return keras.optimizers.Adam(1e-3)
    if name == "nesterov":
        return keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True)
    raise ValueError(f"optimizer {name!r}: choose adam or nesterov")


def residual_cnn(optimizer: str = "adam") -> keras.Model:
    """A functional graph with a skip connection: the stem's output feeds two layers."""
    pixels = keras.Input(DIGITS_SHAPE, name="pixels")
    stem = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="stem")(pixels)
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="block_conv1")(stem)
    x = keras.layers.Conv2D(16, 3, padding="same", name="block_conv2")(x)
    x = keras.layers.Add(name="block_skip")([x, stem])
    x = keras.layers.Activation("relu", name="block_relu")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    logits = keras.layers.Dense(DIGITS_CLASSES, name="logits")(x)
    return _classification(keras.Model(pixels, logits, name="residual_cnn"), _optimizer(optimizer))


def residual_cnn_nesterov() -> keras.Model:
    """The residual CNN under SGD with Nesterov momentum."""
    return residual_cnn("nesterov")


def two_heads() -> keras.Model:
    """Two outputs, each with its own loss, weighted by loss_weights (and a metric on one)."""
    pixels = keras.Input(DIGITS_SHAPE, name="pixels")
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv")(pixels)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    digit = keras.layers.Dense(DIGITS_CLASSES, name="digit")(x)
    parity = keras.layers.Dense(2, name="parity")(x)
    model = keras.Model(pixels, {"digit": digit, "parity": parity}, name="two_heads")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss={"digit": loss, "parity": loss},
        loss_weights={"digit": 1.0, "parity": 0.3},
        metrics={"digit": ["accuracy"]},
    )
    return model


def bn_cnn(synchronized: bool = False) -> keras.Model:
    """BatchNormalization: its batch statistics depend on how many examples share a forward
    pass, and its moving averages are weights that no gradient updates. `synchronized`: the
    statistics of the whole global batch (Keras's synchronized=True), which ringtrain refuses
    on more than one rank."""
    norm = functools.partial(keras.layers.BatchNormalization, synchronized=synchronized)
    model = keras.Sequential(
        [
            keras.Input(DIGITS_SHAPE, name="pixels"),
            keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="conv1"),
            norm(name="norm1"),
            keras.layers.Activation("relu", name="relu1"),
            keras.layers.Conv2D(16, 3, strides=2, padding="same", use_bias=False, name="conv2"),
            norm(name="norm2"),
            keras.layers.Activation("relu", name="relu2"),
            keras.layers.GlobalAveragePooling2D(name="pool"),
            keras.layers.Dense(DIGITS_CLASSES, name="logits"),
        ],
        name="bn_cnn",
    )
    return _classification(model, keras.optimizers.Adam(1e-3))


def bn_cnn_synchronized() -> keras.Model:
    """The BatchNormalization CNN with synchronized statistics."""
    return bn_cnn(synchronized=True)


def frozen_finetune() -> keras.Model:
    """A frozen feature extractor (a nested model) under a head that trains."""
    extractor = keras.Sequential(
        [
            keras.Input(DIGITS_SHAPE, name="pixels"),
            keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="frozen_conv"),
            keras.layers.Flatten(name="flatten"),
            keras.layers.Dense(32, activation="relu", name="frozen_dense"),
        ],
        name="extractor",
    )
    extractor.trainable = False
    pixels = keras.Input(DIGITS_SHAPE, name="pixels")
    x = keras.layers.Dense(32, activation="relu", name="tuned_dense")(extractor(pixels))
    logits = keras.layers.Dense(DIGITS_CLASSES, name="logits")(x)
    model = keras.Model(pixels, logits, name="frozen_finetune")
    return _classification(model, keras.optimizers.SGD(0.1, momentum=0.9))


def regression_mlp() -> keras.Model:
    """Mean squared error; AdamW on a cosine schedule with global-norm clipping: an optimizer
    whose step depends on the step count and on every gradient at once."""
    model = keras.Sequential(
        [
            keras.Input((REGRESSION_FEATURES,), name="features"),
            keras.layers.Dense(32, activation="relu", name="hidden1"),
            keras.layers.Dense(32, activation="relu", name="hidden2"),
            keras.layers.Dense(1, name="value"),
        ],
        name="regression_mlp",
    )
    schedule = keras.optimizers.schedules.CosineDecay(1e-2, decay_steps=50)
    model.compile(
        optimizer=keras.optimizers.AdamW(schedule, weight_decay=1e-2, global_clipnorm=1.0),
        loss=keras.losses.MeanSquaredError(),
        metrics=["mae"],
    )
    return model


class _Subclassed(keras.Model):
    """Layers called from Python, not a graph of them."""

    def __init__(self):
        super().__init__(name="subclassed")
        self.flat = keras.layers.Flatten(name="flatten")
        self.logits = keras.layers.Dense(DIGITS_CLASSES, name="logits")

    def call(self, pixels):
        return self.logits(self.flat(pixels))


def subclassed() -> keras.Model:
    """A subclassed keras.Model: no layer graph, so no pipeline can cut it into stages."""
    model = _Subclassed()
    model(keras.ops.zeros((1, *DIGITS_SHAPE)))
    return _classification(model, _optimizer("adam"))


def tall_mlp(
    depth: int = 96,
    width: int = 1024,
    fine_tuned: bool = False,
    learning_rate: float = 0.01,
    adam: bool = False,
) -> keras.Model:
    """Many equal Dense layers (381 MiB of weights by default), so a pipeline stage's share of
    the weights stands out of a rank's memory. `fine_tuned`: the first hidden layer's and the
    output layer's weights (one on each end of the model) are set from values the function
    makes, as weights loaded from a file would be. `adam`: Adam instead of SGD, two slots per
    weight, which one process holds all of and each stage its share."""
    layers = [keras.Input(DIGITS_SHAPE, name="pixels"), keras.layers.Flatten(name="flat")]
    layers += [
        keras.layers.Dense(width, activation="relu", name=f"hidden{i}") for i in range(depth)
    ]
    logits = keras.layers.Dense(DIGITS_CLASSES, name="logits")
    model = keras.Sequential([*layers, logits], name="tall_mlp")  # in every weight's path
    if fine_tuned:
        for name in ("hidden0", "logits"):
            layer = model.get_layer(name)
            layer.set_weights([np.full(tuple(w.shape), 0.01, np.float32) for w in layer.weights])
    optimizer = keras.optimizers.Adam if adam else keras.optimizers.SGD
    return _classification(model, optimizer(learning_rate))


def bert_classifier() -> keras.Model:
    """The BERT-shaped example, examples/bert_classifier.py: a two-layer keras-hub BERT with a
    two-class head on its pooled [CLS] output; three named inputs."""
    return _example("bert_classifier").build()


def digits(n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits in their stored order: pixels / 16 as float32 (N, 8, 8, 1),
    labels as int32; the first n."""
    from sklearn.datasets import load_digits

    found = load_digits()
    x = (found.data / 16.0).astype(np.float32).reshape(-1, *DIGITS_SHAPE)
    return x[:n], found.target.astype(np.int32)[:n]


def digits_and_parity(n: int | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The digits with two targets: the digit, and whether it is odd."""
    x, y = digits(n)
    return x, {"digit": y, "parity": y % 2}


def digits_split() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The first 300 digits to train on and the next 200 held out."""
    x, y = digits(DIGITS_TRAIN + DIGITS_HELD_OUT)
    return (x[:DIGITS_TRAIN], y[:DIGITS_TRAIN]), (x[DIGITS_TRAIN:], y[DIGITS_TRAIN:])


def regression_data(n: int = 512, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A noisy linear target of normal features, y of shape (n, 1)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, REGRESSION_FEATURES)).astype(np.float32)
    weights = rng.normal(size=(REGRESSION_FEATURES, 1))
    y = x @ weights + 0.1 * rng.normal(size=(n, 1))
    return x, y.astype(np.float32)


def bert_data(n: int = 256, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The example's tokens, shorter: every fourth sequence padded (token 0, mask 0) after a
    random length; two segments; label 1 where the mean real token id is above the middle."""
    return _example("bert_classifier").data(n, seed, tokens=BERT_TOKENS)


def _example(name: str):
    """examples/NAME.py, loaded from its file as `--model PATH.py:FUNCTION` loads one."""
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
