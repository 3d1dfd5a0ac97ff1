"""Your own Keras model: `ringtrain train --model F.py:build` and `ringtrain.fit` train the user's
compiled model exactly as Keras's own `fit` does on one process (tests/reference.py, which
imports nothing from ringtrain), under every strategy that takes one so far; and every bad
model, model file or flag combination is refused in one line."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import BIN, ENV, ROOT, run
from reference import keras_fit_updates, saved_model_updates
from test_bad_input import said_once, train_under_mpirun

from ringtrain.errors import EXIT_USAGE

USER_MODELS = ROOT / "tests" / "user_models.py"
BATCH, STEPS, SEED = 64, 5, 7  # 300 examples: the fifth batch is partial, as Keras's fit has it


def train(*args: str, launcher: list[str] | None = None, timeout: float = 300):
    """`ringtrain train` on the residual CNN of tests/user_models.py, as a user would run it."""
    cmd = [*(launcher or []), str(BIN / "ringtrain"), "train"]
    cmd += ["--model", f"{USER_MODELS}:residual_cnn", "--data", f"{USER_MODELS}:digits_split"]
    cmd += ["--no-shuffle", "--batch-size", str(BATCH), "--steps", str(STEPS)]
    return run([*cmd, "--seed", str(SEED), *args], timeout=timeout)


@pytest.fixture(scope="module")
def reference():
    """Keras's own fit of the same model on the same examples, in order, in one process."""
    sys.path.insert(0, str(USER_MODELS.parent))
    import user_models

    (x, y), _ = user_models.digits_split()
    return keras_fit_updates(user_models.residual_cnn, x, y, BATCH, STEPS, seed=SEED)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_every_zoo_model_under_every_strategy_updates_as_keras_fit_does(ranks, grid_checks):
    """tests/mpi_checks.py's user-model grid: a residual CNN (with a partial, uneven last
    batch), a keras_hub BERT whose cut carries hidden states and the padding mask, a regression
    MLP with AdamW, a cosine schedule and global_clipnorm, a frozen feature extractor and a
    BatchNormalization CNN; single on 1 rank, data and pipeline (1F1B, ZB-H1, M=4) on 2,
    hybrid 2x2 on 4; on 2 ranks also the CNN with SGD + Nesterov momentum (data, 1F1B), a
    two-output model with loss_weights (data, 1F1B), the BERT in four interleaved stages (its
    padding mask passes through the middle ones), and --accumulate 2 under data (the CNN with
    --bucket-mb too, the BERT, the BatchNormalization CNN). The stages are cut by the default time
    partition. Each per tensor within the bound of Keras's own fit."""
    results = grid_checks.keras(ranks)
    assert len(results) == {1: 5, 2: 23, 4: 5}[ranks]
    for r in results:
        c, u = r["config"], r["update"]
        print(
            f"{c['strategy']} {c['schedule']} {c['model']}: {u['worst_tensor']} "
            f"{u['worst_ratio']:.3f} of its allowance ({r['compared']} tensors)"
        )
    for r in results:
        assert r["steps"] == 3 and r["update"]["passed"], r


LAUNCHES = {
    "single": ([], ["--strategy", "single"]),
    "data-horovodrun": (["horovodrun", "-np", "2", "-H", "localhost:2"], ["--strategy", "data"]),
    "data-mpirun": (  # with the CLI's accumulation and bucket flags, which keep it exact
        ["mpirun", "--oversubscribe", "-np", "2"],
        ["--strategy", "data", "--accumulate", "2", "--bucket-mb", "1"],
    ),
    "data-mpirun-fit": (  # the user's own model.fit on each rank, gradients allreduced
        ["mpirun", "--oversubscribe", "-np", "2"],
        ["--strategy", "data", "--loop", "fit"],
    ),
    "pipeline-mpirun": (
        ["mpirun", "--oversubscribe", "-np", "2"],
        ["--strategy", "pipeline", "--schedule", "1f1b", "--microbatches", "4"],
    ),
}


@pytest.mark.parametrize("launch", LAUNCHES)
def test_the_cli_trains_a_users_model_as_keras_fit_does(launch, reference, tmp_path):
    """Per tensor within the exactness bound of Keras's fit; the saved .keras file loads in a
    fresh process and gives the held-out loss and accuracy the run reported."""
    launcher, strategy = LAUNCHES[launch]
    saved, metrics = tmp_path / "trained.keras", tmp_path / "metrics.json"
    done = train(*strategy, "--save", str(saved), "--metrics-out", str(metrics), launcher=launcher)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "held-out accuracy" in done.stdout and "Traceback" not in done.stderr
    comparison = saved_model_updates(saved, reference)
    assert comparison.ok, comparison.describe()
    reported = json.loads(metrics.read_text())
    assert reported["steps"] == STEPS and reported["epochs"] == 1
    if "--accumulate" in strategy:  # the flags reached the run
        assert reported["config"]["accumulate"] == 2 and reported["config"]["bucket_mb"] == 1
    check = f"""
import json, sys
sys.path.insert(0, {str(USER_MODELS.parent)!r})
import keras, user_models
model = keras.models.load_model({str(saved)!r})
_, (x, y) = user_models.digits_split()
print(json.dumps(model.evaluate(x, y, batch_size=512, verbose=0, return_dict=True)))
"""
    fresh = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    evaluated = json.loads(fresh.stdout.splitlines()[-1])
    for name in ("loss", "accuracy"):
        assert evaluated[name] == pytest.approx(reported["held_out"][name], rel=1e-5, abs=1e-6)


BAD_MODELS = """
import keras

def not_a_model():
    return "a model"

def uncompiled():
    inputs = keras.Input((8, 8, 1))
    return keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(inputs)))

class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.flat, self.dense = keras.layers.Flatten(), keras.layers.Dense(10)

    def call(self, x):
        return self.dense(self.flat(x))

def subclassed():
    model = Subclassed()
    model(keras.ops.zeros((1, 8, 8, 1)))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model

def shared_at_both_ends():
    inputs = keras.Input((8, 8, 1))
    shared = keras.layers.Dense(1, name="shared")
    hidden = keras.layers.Dense(1, name="middle")(shared(inputs))
    model = keras.Model(inputs, shared(hidden))
    model.compile(optimizer="adam", loss="mse")
    return model

def synchronized_norm():
    inputs = keras.Input((8, 8, 1))
    hidden = keras.layers.BatchNormalization(synchronized=True)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(hidden)))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model

def per_example_loss():
    model = uncompiled()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    model.compile(optimizer="adam", loss=loss)
    return model
"""


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bad") / "bad_models.py"
    path.write_text(BAD_MODELS)
    return path


GOOD = f"{USER_MODELS}:residual_cnn"
BEFORE_TENSORFLOW = [
    (["--model", "/nonexistent/model.py:build"], "file /nonexistent/model.py does not exist"),
    (["--model", "model.py:"], "expected PATH.py:FUNCTION"),
    (["--model", GOOD, "--model-arg", "units"], "expected KEY=VALUE"),
    (["--model", GOOD, "--data", GOOD, "--dataset", "synthetic"], "either --data or --dataset"),
    (["--model", GOOD, "--optimizer", "adam"], "--optimizer does not apply to a compiled model"),
    (["--model", GOOD, "--lr", "0.1"], "--lr does not apply to a compiled model"),
    (["--model", GOOD, "--clip-norm", "1"], "--clip-norm does not apply to a compiled model"),
    (["--model", GOOD, "--split-at", "conv"], "--split-at cuts pipeline stages, not --strategy"),
    (["--model-arg", "units=3"], "--model-arg needs --model PATH.py:FUNCTION"),
    (["--model", GOOD, "--strategy", "single", "--bucket-mb", "1"], "--bucket-mb buckets"),
    (
        ["--model", GOOD, "--strategy", "pipeline", "--accumulate", "2"],
        "--accumulate slices a data-parallel share",
    ),
    (["--model", GOOD, "--save", "/tmp/out.h5"], "name it *.keras"),
    (["--model", GOOD, "--strategy", "pipeline", "--loop", "fit"], "--loop fit drives data"),
]


@pytest.mark.parametrize("args,needle", BEFORE_TENSORFLOW)
def test_bad_user_model_flags_are_refused_before_tensorflow(args, needle, before_tensorflow):
    said_once(before_tensorflow("train", *args), EXIT_USAGE, needle)


@pytest.mark.parametrize(
    "function,needle",
    [
        ("no_such_function", "defines no no_such_function"),
        ("not_a_model", "returned str, not a keras.Model"),
        ("uncompiled", "returned an uncompiled model"),
        ("per_example_loss", "has reduction=None"),
    ],
)
def test_a_bad_model_function_is_refused_in_one_line(function, needle, bad_models):
    args = ["--model", f"{bad_models}:{function}", "--steps", "1", "--strategy", "single"]
    said_once(run([str(BIN / "ringtrain"), "train", *args], timeout=120), EXIT_USAGE, needle)


PIPELINE = ["--strategy", "pipeline", "--steps", "1", "--batch-size", "32"]


@pytest.mark.parametrize(
    "model,args,needle",
    [
        ("subclassed", PIPELINE, "is subclassed (no layer graph)"),
        ("synchronized_norm", ["--strategy", "data", "--steps", "1"], "synchronized=True"),
        (
            GOOD,
            ["--strategy", "data", "--loop", "fit", "--steps", "1", "--batch-size", "63"],
            "--loop fit needs every global batch to divide among the 2 ranks",
        ),
    ],
)
def test_a_model_that_cannot_train_as_asked_is_refused_in_one_line_on_every_rank(
    model, args, needle, bad_models
):
    target = model if ":" in model else f"{bad_models}:{model}"
    said_once(train_under_mpirun("--model", target, *args), EXIT_USAGE, needle)


@pytest.mark.parametrize(
    "function,split_at,needle",
    [
        ("shared_at_both_ends", None, "too few for 2 stages; the largest that cannot be cut"),
        ("residual_cnn", ["no_such_layer"], "--split-at no_such_layer: no such layer"),
        ("residual_cnn", ["block_conv2"], "lies inside the block block_conv1"),
    ],
)
def test_a_cut_that_cannot_be_made_is_refused_in_one_line(function, split_at, needle, bad_models):
    """The graph's own refusals, in process: the runs above show how such a line ends a run."""
    from ringtrain.errors import UserError
    from ringtrain.keras_model.graph import split_graph

    sys.path.insert(0, str(USER_MODELS.parent))
    import user_models

    spec = importlib.util.spec_from_file_location("bad_models", bad_models)
    bad = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bad)
    model = getattr(user_models, function, None) or getattr(bad, function)
    (x, _), _ = user_models.digits_split()
    with pytest.raises(UserError, match=re.escape(needle)) as refused:
        split = split_graph(model(), x[:4])
        split.check(2)
        split.bounds_at(split_at, 2)
    assert "\n" not in str(refused.value)


def test_a_users_model_stops_and_resumes_to_the_same_weights_as_an_unbroken_run(tmp_path):
    """--stop-after checkpoints the compiled optimizer's state (SGD with Nesterov momentum) on
    2 data-parallel ranks; --resume on one process finishes the run: the same weights, as the
    replicas are identical. A checkpoint of another model is refused."""
    nesterov = ["--model-arg", "optimizer='nesterov'", "--strategy", "single"]
    whole, resumed, ckpt = tmp_path / "whole.npz", tmp_path / "resumed.npz", tmp_path / "ckpt"
    assert train(*nesterov, "--weights-out", str(whole)).returncode == 0
    launcher = ["mpirun", "--oversubscribe", "-np", "2"]
    stopped = train(
        "--model-arg",
        "optimizer='nesterov'",
        "--strategy",
        "data",
        "--checkpoint-dir",
        str(ckpt),
        "--stop-after",
        "2",
        launcher=launcher,
    )
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    done = train(
        *nesterov, "--checkpoint-dir", str(ckpt), "--resume", "--weights-out", str(resumed)
    )
    assert done.returncode == 0 and "resumed from" in done.stdout, done.stderr[-2000:]
    other = [str(BIN / "ringtrain"), "train", "--model", f"{USER_MODELS}:bn_cnn", "--resume"]
    other += ["--checkpoint-dir", str(ckpt), "--strategy", "single", "--steps", "3"]
    said_once(run(other), EXIT_USAGE, "checkpoint")
    a, b = np.load(whole), np.load(resumed)
    assert sorted(a.files) == sorted(b.files)
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files) < 1e-6


CALLBACKS_SCRIPT = """
import json, os, sys
sys.path.insert(0, {tests!r})
import keras, ringtrain, user_models
from ringtrain.errors import UserError

rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
seen = []

class Recorder(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        seen.append([epoch, sorted(logs)])

keras.utils.set_random_seed(3)
model = user_models.residual_cnn("nesterov")
(x, y), held_out = user_models.digits_split()
try:
    ringtrain.fit(model, x, y, batch_size=100, callbacks=[keras.callbacks.TensorBoard({out!r})])
except UserError as refused:
    print("refused:", refused)
callbacks = [
    Recorder(),
    keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 * 0.5**epoch),
    keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=1e9),
    keras.callbacks.ModelCheckpoint({checkpoint!r}, save_weights_only=True),
]
history = ringtrain.fit(
    model, x, y, strategy="pipeline", batch_size=100, epochs=5, shuffle=False,
    validation_data=held_out, callbacks=callbacks, microbatches=2,
)
final = {{v.path: v.numpy().tolist() for v in model.weights}} if rank == 0 else None
print("@" + json.dumps({{
    "rank": rank, "epochs": len(history.history["loss"]), "seen": seen,
    "lr": float(model.optimizer.learning_rate.numpy()), "final": final,
}}))
"""


def test_keras_callbacks_run_on_rank_0_at_epoch_ends_and_every_rank_follows_them(tmp_path):
    """Under a 2-stage pipeline: EarlyStopping stops every rank after its second epoch of five,
    LearningRateScheduler's rate reaches every rank, ModelCheckpoint on rank 0 saves the whole
    model (every stage's weights gathered first), the epoch logs carry loss and val_ metrics,
    nothing runs on rank 1; a per-batch callback (Keras's TensorBoard) is refused in one line."""
    checkpoint = tmp_path / "epoch.weights.h5"
    script = tmp_path / "fit_with_callbacks.py"
    script.write_text(
        CALLBACKS_SCRIPT.format(
            tests=str(USER_MODELS.parent), out=str(tmp_path / "tb"), checkpoint=str(checkpoint)
        )
    )
    done = run(["mpirun", "--oversubscribe", "-np", "2", sys.executable, str(script)])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # Each rank prints "@" and one JSON object; mpirun may glue another rank's line to it.
    decoder = json.JSONDecoder()
    reports = {
        r["rank"]: r
        for r in (
            decoder.raw_decode(done.stdout, at.end())[0]
            for at in re.finditer(r"@(?=\{)", done.stdout)
        )
    }
    assert sorted(reports) == [0, 1]
    assert done.stdout.count("refused: callbacks: TensorBoard uses") == 2  # once per rank
    keys = ["loss", "val_accuracy", "val_loss"]
    assert reports[0]["seen"] == [[0, keys], [1, keys]] and reports[1]["seen"] == []
    for report in reports.values():
        assert report["epochs"] == 2 and report["lr"] == pytest.approx(0.025)
    check = f"""
import json, sys
sys.path.insert(0, {str(USER_MODELS.parent)!r})
import keras, user_models
model = user_models.residual_cnn("nesterov")
model.load_weights({str(checkpoint)!r})
print(json.dumps({{v.path: v.numpy().tolist() for v in model.weights}}))
"""
    saved = run([sys.executable, "-c", check])
    assert saved.returncode == 0, saved.stderr[-2000:]
    final, at_epoch_end = reports[0]["final"], json.loads(saved.stdout.splitlines()[-1])
    assert sorted(final) == sorted(at_epoch_end)
    for name, value in final.items():
        np.testing.assert_array_equal(np.array(at_epoch_end[name]), np.array(value), name)
