"""The independent reference: a plain TensorFlow/Keras training loop written from the documented
contract (docs/tutorial/why-distribute.md). It imports nothing from ringtrain, so a mistake in
ringtrain's code cannot hide by being made the same way here:

- the models are declared here again as plain Keras layers (`MODELS`): the one intended
  duplication of ringtrain's code, as the reference must not share the code it checks;
- the initial weights are the ones the run itself wrote with --initial-weights-out, matched to
  this model's weights by their names (layerNN/...), so no initialiser is written twice;
- the digits are scikit-learn's, split as documented (`load_digits`);
- the order of examples in epoch e is `np.random.default_rng([seed, e]).permutation(n)`;
- step t takes the next `batch_size` examples of that order; the last partial batch is dropped;
- the loss is the mean sparse categorical cross-entropy over the global batch;
- `--clip-norm C` scales the gradients by C / max(global norm, C);
- `--optimizer sgd|adam --lr LR` is Keras' SGD or Adam at that learning rate, all else default;
- the judge (`compare_updates`) compares the tensors itself.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

# Per-step losses (about 2.3 at the start) must agree to float rounding. Under
# --fp16-allreduce the reported loss itself is averaged in half precision (it rides in the
# gradient allreduce), where the spacing of numbers near 2.3 is 2e-3: its own bound.
LOSS_ATOL, FP16_LOSS_ATOL = 1e-5, 1e-2

UPDATE_RTOL, UPDATE_ATOL = 1e-4, 1e-7
# --fp16-allreduce rounds every averaged gradient to half precision (11 significant bits) on
# purpose, so its updates are held to their own, measured bound instead of UPDATE_RTOL.
FP16_ALLREDUCE_RTOL = 1e-2

DIGITS_HELD_OUT, DIGITS_SPLIT_SEED = 0.2, 1234


@dataclass(frozen=True)
class Digits:
    """The training rows (x as float32 (8, 8, 1), y as int32 labels 0-9) and the held-out rows."""

    x: np.ndarray
    y: np.ndarray
    held_out_x: np.ndarray
    held_out_y: np.ndarray


@functools.cache
def load_digits() -> Digits:
    """scikit-learn's 8x8 digits as `--dataset digits` promises them: pixels / 16 in float32,
    shape (8, 8, 1); `default_rng(1234).permutation(n)` holds out its first round(0.2 n)
    examples and trains on the rest, in that order."""
    from sklearn import datasets  # a second of import, paid only where a reference is trained

    digits = datasets.load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(x))
    held_out, train = np.split(order, [round(DIGITS_HELD_OUT * len(x))])
    return Digits(x[train], y[train], x[held_out], y[held_out])


# ---- the built-in models, declared again ---------------------------------------------------
#
# The one intended duplication: ringtrain/models.py's mlp, cnn and transformer, written here as
# plain Keras with the same math (and, where it matters for float rounding, the same order of
# operations). Each weight is named as ringtrain names it (layerNN/...), which is how the run's
# initial weights find their tensor here.


class DenseWithPositions(keras.layers.Dense):
    """Dense on each token, plus a learned embedding per token position (TokenEmbedding)."""

    def build(self, input_shape):
        super().build(input_shape)
        self.position = self.add_weight(name="position", shape=(input_shape[1], self.units))

    def call(self, inputs):
        return super().call(inputs) + self.position


class PreNormEncoderBlock(keras.layers.Layer):
    """x + attention(norm1(x)), then + feed-forward(norm2(x)). As in ringtrain, the key
    projection has no bias."""

    def __init__(self, heads: int, hidden: int, **kwargs):
        super().__init__(**kwargs)
        self.heads, self.hidden = heads, hidden

    def build(self, input_shape):
        width = int(input_shape[-1])
        self.norm1, self.norm2 = (
            keras.layers.LayerNormalization(name=n) for n in ("norm1", "norm2")
        )
        for norm in (self.norm1, self.norm2):
            norm.build(input_shape)
        shapes = {
            "wq": (width, width),
            "q_bias": (width,),
            "wk": (width, width),
            "wv": (width, width),
            "v_bias": (width,),
            "wo": (width, width),
            "o_bias": (width,),
            "ffn1_kernel": (width, self.hidden),
            "ffn1_bias": (self.hidden,),
            "ffn2_kernel": (self.hidden, width),
            "ffn2_bias": (width,),
        }
        self.w = {name: self.add_weight(name=name, shape=shape) for name, shape in shapes.items()}

    def _by_head(self, t):
        """(batch, tokens, width) -> (batch, heads, tokens, width / heads)."""
        split = tf.reshape(t, (tf.shape(t)[0], t.shape[1], self.heads, t.shape[2] // self.heads))
        return tf.transpose(split, (0, 2, 1, 3))

    def call(self, x):
        w = self.w
        normed = self.norm1(x)
        query = self._by_head(tf.matmul(normed, w["wq"]) + w["q_bias"])
        key = self._by_head(tf.matmul(normed, w["wk"]))
        value = self._by_head(tf.matmul(normed, w["wv"]) + w["v_bias"])
        scale = math.sqrt(query.shape[-1])
        attention = tf.nn.softmax(tf.matmul(query, key, transpose_b=True) / scale)
        per_token = tf.transpose(tf.matmul(attention, value), (0, 2, 1, 3))
        x = x + tf.matmul(tf.reshape(per_token, tf.shape(x)), w["wo"]) + w["o_bias"]
        hidden = keras.activations.gelu(
            tf.matmul(self.norm2(x), w["ffn1_kernel"]) + w["ffn1_bias"], approximate=False
        )
        return x + tf.matmul(hidden, w["ffn2_kernel"]) + w["ffn2_bias"]


def mlp(n_classes: int) -> list[keras.layers.Layer]:
    return [
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(128, "relu", name="layer00"),
        keras.layers.Dense(128, "relu", name="layer01"),
        keras.layers.Dense(64, "relu", name="layer02"),
        keras.layers.Dense(n_classes, name="layer03"),
    ]


def cnn(n_classes: int) -> list[keras.layers.Layer]:
    return [
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="layer00"),
        keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu", name="layer01"),
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(64, "relu", name="layer02"),
        keras.layers.Dense(n_classes, name="layer03"),
    ]


def transformer(n_classes: int, width: int = 32) -> list[keras.layers.Layer]:
    """Image rows as tokens, two encoder blocks of 4 heads, mean over tokens, classify."""
    return [
        keras.layers.TimeDistributed(keras.layers.Flatten(), name="rows_as_tokens"),
        DenseWithPositions(width, name="layer00"),
        PreNormEncoderBlock(4, 2 * width, name="layer01"),
        PreNormEncoderBlock(4, 2 * width, name="layer02"),
        keras.layers.GlobalAveragePooling1D(name="mean_over_tokens"),
        keras.layers.Dense(n_classes, name="layer03"),
    ]


MODELS: dict[str, Callable[[int], list[keras.layers.Layer]]] = {
    "mlp": mlp,
    "cnn": cnn,
    "transformer": transformer,
}


def apply(layers: list[keras.layers.Layer], x) -> tf.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def start_from(layers: list[keras.layers.Layer], initial: str | os.PathLike) -> list:
    """The model's trainable variables, set to the run's --initial-weights-out file by name.
    Every tensor must be there with its shape: a file of another model is refused."""
    variables = [v for layer in layers for v in layer.trainable_weights]
    with np.load(initial, allow_pickle=False) as stored:
        ours, theirs = {v.path for v in variables}, set(stored.files)
        assert ours == theirs, (
            f"{initial} does not hold this model's weights: missing {sorted(ours - theirs)}, "
            f"unknown {sorted(theirs - ours)}"
        )
        for v in variables:
            value = stored[v.path]
            assert value.shape == tuple(v.shape), (
                f"{initial}: {v.path} has shape {value.shape}, the model's is {tuple(v.shape)}"
            )
            v.assign(value)
    return variables


def weights_digest(path: str | os.PathLike) -> str:
    """A weight file's tensors (names, dtypes, shapes, values) as one hash. The .npz's own bytes
    would not do: its zip entries carry the time they were written."""
    digest = hashlib.sha256()
    with np.load(path, allow_pickle=False) as stored:
        for name in sorted(stored.files):
            value = stored[name]
            digest.update(f"{name} {value.dtype} {value.shape}\n".encode())
            digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


# ---- training and the judge ----------------------------------------------------------------


@dataclass(frozen=True)
class UpdateComparison:
    """How far one run's weight update is from a reference update, tensor by tensor.

    `worst_tensor` used the largest share of its allowance: `worst_ratio` is that tensor's
    ||dw_run - dw_ref|| over rtol * ||dw_ref|| + atol (at most 1 passes), `worst_relative` its
    ||dw_run - dw_ref|| / ||dw_ref||.
    """

    worst_tensor: str
    worst_ratio: float
    worst_relative: float
    passed: bool


def compare_updates(
    initial: dict[str, np.ndarray],
    run: dict[str, np.ndarray],
    reference: dict[str, np.ndarray],
    rtol: float = UPDATE_RTOL,
    atol: float = UPDATE_ATOL,
) -> UpdateComparison:
    """Compare updates (final minus initial weights), not weights: the unchanged initial
    weights would otherwise dominate the scale and hide a wrong update. The absolute term keeps
    tensors that barely move (a dead unit's bias) from failing on rounding alone."""
    if not initial.keys() == run.keys() == reference.keys():
        names = (initial.keys() | run.keys() | reference.keys()) - (
            initial.keys() & run.keys() & reference.keys()
        )
        raise ValueError(f"different weight names: {sorted(names)}")
    rows = []
    for name in sorted(reference):
        start = initial[name].astype(np.float64)
        ref_update = reference[name].astype(np.float64) - start
        miss = float(np.linalg.norm(run[name].astype(np.float64) - start - ref_update))
        scale = float(np.linalg.norm(ref_update))
        relative = miss / scale if scale > 0 else (0.0 if miss == 0 else float("inf"))
        rows.append((miss / (rtol * scale + atol), relative, name))
    ratio, relative, name = max(rows)
    return UpdateComparison(name, ratio, relative, ratio <= 1.0)


@dataclass
class ReferenceRun:
    """Weights under the --weights-out names (layerNN/...), before and after; loss per step."""

    initial: dict[str, np.ndarray]
    final: dict[str, np.ndarray]
    losses: list[float]


def global_batches(n_examples: int, batch_size: int, seed: int, steps: int) -> list[np.ndarray]:
    """Example indices of each step, straight from the documented data-order contract."""
    per_epoch = n_examples // batch_size
    batches = []
    for step in range(steps):
        epoch, i = divmod(step, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(n_examples)
        batches.append(order[i * batch_size : (i + 1) * batch_size])
    return batches


def _weights(variables) -> dict[str, np.ndarray]:
    return {v.path: np.array(v.numpy()) for v in variables}


def train_reference(
    data: Digits,
    initial: str | os.PathLike,
    model: str,
    optimizer: str,
    lr: float,
    batch_size: int,
    steps: int,
    seed: int,
    clip_norm: float | None = None,
    batches: list[np.ndarray] | None = None,
    counted: np.ndarray | None = None,
) -> ReferenceRun:
    """Train one process, one global batch per step, with a plain tape and Keras optimizer,
    from the initial weights a run wrote to the file `initial` (--initial-weights-out).

    The judge's own tests build wrong runs here: `batches` replaces the example indices of each
    step, and `counted` weighs each example of a global batch in the mean loss (0 drops it)."""
    layers = MODELS[model](int(data.y.max()) + 1)  # every digit is among the training rows
    apply(layers, data.x[:1])  # builds every layer for the data's rows
    variables = start_from(layers, initial)
    before = _weights(variables)
    # Named, so it takes no automatic name ("sgd_1") that would shift the optimizer names, and
    # so the Horovod tensor names, of engines later built in this process on one rank only.
    kind = keras.optimizers.SGD if optimizer == "sgd" else keras.optimizers.Adam
    opt = kind(learning_rate=lr, name=f"reference_{optimizer}")
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses = []
    for idx in batches or global_batches(len(data.x), batch_size, seed, steps):
        with tf.GradientTape() as tape:
            logits = apply(layers, tf.constant(data.x[idx]))
            loss = cross_entropy(tf.constant(data.y[idx]), logits, sample_weight=counted)
        grads = tape.gradient(loss, variables)
        if clip_norm is not None:
            norm = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads]))
            grads = [g * (clip_norm / tf.maximum(norm, clip_norm)) for g in grads]
        opt.apply_gradients(zip(grads, variables, strict=True))
        losses.append(float(loss))
    return ReferenceRun(before, _weights(variables), losses)


def compare_with(ref: ReferenceRun, weights: dict, losses: list[float], fp16: bool) -> dict:
    """A run against the reference: the worst tensor's update difference and the largest loss
    difference, each against the bound the run is held to (--fp16-allreduce: its own)."""
    rtol, loss_atol = (FP16_ALLREDUCE_RTOL, FP16_LOSS_ATOL) if fp16 else (UPDATE_RTOL, LOSS_ATOL)
    update = compare_updates(ref.initial, weights, ref.final, rtol, UPDATE_ATOL)
    loss_diff = float(np.max(np.abs(np.array(losses) - np.array(ref.losses))))
    return {
        "update": {**vars(update), "rtol": rtol, "atol": UPDATE_ATOL},
        "loss_diff": loss_diff,
        "loss_atol": loss_atol,
        "losses_passed": len(losses) == len(ref.losses) and loss_diff <= loss_atol,
    }


# ---- a user's own compiled model: Keras's own fit is the reference ------------------------
#
# `ringtrain train --model F.py:build` and `ringtrain.fit(model, ...)` promise the updates of
# `model.fit(x[:S*B], y[:S*B], batch_size=B, shuffle=False, epochs=1)` in one process. Weights
# are matched by path (`v.path`), which needs a model whose layers are named (tests/user_models.py).


@dataclass(frozen=True)
class KerasFit:
    """A model's weights by path before and after Keras's own fit, and the trained model."""

    initial: dict[str, np.ndarray]
    final: dict[str, np.ndarray]
    model: keras.Model


def weights_by_path(model: keras.Model) -> dict[str, np.ndarray]:
    """Every weight (trainable or not: BatchNormalization's moving averages too) by its path.
    Two weights on one path would make the match ambiguous, so that is refused."""
    found = _weights(model.weights)
    if len(found) != len(model.weights):
        paths = [v.path for v in model.weights]
        shared = sorted({p for p in paths if paths.count(p) > 1})
        raise ValueError(f"model {model.name}: several weights share the path(s) {shared}")
    return found


def first_examples(data, n: int):
    """The first n rows of an array, or of every array of a dict of named inputs."""
    return {k: v[:n] for k, v in data.items()} if isinstance(data, dict) else data[:n]


def keras_fit_updates(
    build: Callable[..., keras.Model],
    x,
    y,
    batch_size: int,
    steps: int,
    seed: int = 0,
    microbatches: int = 1,
    **build_args,
) -> KerasFit:
    """Keras's fit, one epoch over the first steps * batch_size examples in order, of the
    model `build(**build_args)` makes right after `keras.utils.set_random_seed(seed)` (as
    ringtrain's CLI builds it). Fewer examples than that make a last, partial batch, as fit has.

    `microbatches` M > 1 is the reference of a pipeline that splits each batch into M: fit on
    batches of batch_size / M, the optimizer stepping once per M of them on their mean gradient
    (Keras's gradient_accumulation_steps). It differs from M = 1 only where a forward pass's
    batch matters (BatchNormalization). Keras's learning-rate schedules, though, count the
    microbatch steps: hold it to models with a constant learning rate."""
    if microbatches < 1 or batch_size % microbatches:
        raise ValueError(f"batch size {batch_size} does not split into {microbatches} microbatches")
    keras.utils.set_random_seed(seed)
    model = build(**build_args)
    if microbatches > 1:
        optimizer = model.optimizer
        if optimizer.built:
            raise ValueError(f"{build.__name__} returned a model whose optimizer already stepped")
        optimizer.gradient_accumulation_steps = microbatches
    initial = weights_by_path(model)
    n = steps * batch_size
    model.fit(
        first_examples(x, n),
        first_examples(y, n),
        batch_size=batch_size // microbatches,
        shuffle=False,
        epochs=1,
        verbose=0,
    )
    return KerasFit(initial, weights_by_path(model), model)


@dataclass(frozen=True)
class SavedModelCheck:
    """A run's saved .keras file against Keras's fit: `problem` says why the weights could not
    be matched (names or shapes), else `update` is the judge's verdict tensor by tensor."""

    path: str
    problem: str | None
    update: UpdateComparison | None

    @property
    def ok(self) -> bool:
        return self.problem is None and self.update.passed

    def describe(self) -> str:
        if self.problem is not None:
            return f"{self.path}: {self.problem}"
        u = self.update
        verdict = "within" if u.passed else "beyond"
        return (
            f"{self.path}: worst tensor {u.worst_tensor} used {u.worst_ratio:.3g} of its "
            f"allowance ({verdict} it; ||dw - dw_ref|| / ||dw_ref|| = {u.worst_relative:.3g})"
        )


def saved_model_updates(
    path: str | os.PathLike, reference: KerasFit, custom_objects: dict | None = None
) -> SavedModelCheck:
    """Load a run's --save file (weights only: its optimizer and loss are not needed) and judge
    its update per tensor against the reference's. A model with custom layers that are not
    registered with Keras names them in `custom_objects`."""
    saved = keras.models.load_model(path, custom_objects=custom_objects, compile=False)
    run = weights_by_path(saved)
    expected = reference.initial
    if run.keys() != expected.keys():
        missing, unknown = expected.keys() - run.keys(), run.keys() - expected.keys()
        problem = f"missing weights {sorted(missing)}, unknown {sorted(unknown)}"
        return SavedModelCheck(str(path), problem, None)
    shapes = [n for n in sorted(run) if run[n].shape != expected[n].shape]
    if shapes:
        wrong = ", ".join(f"{n} {run[n].shape} (not {expected[n].shape})" for n in shapes)
        return SavedModelCheck(str(path), f"weights of other shapes: {wrong}", None)
    return SavedModelCheck(str(path), None, compare_updates(expected, run, reference.final))
