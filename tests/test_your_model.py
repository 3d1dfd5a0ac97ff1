"""Your own Keras model: `ringtrain train --model F.py:build` and `ringtrain.fit` train the user's
compiled model exactly as Keras's own `fit` does on one process (tests/reference.py, which
imports nothing from ringtrain), under every strategy that takes one so far; and every bad
model, model file or flag combination is refused in one line."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from conftest import BIN, ENV, ROOT, run
from reference import keras_fit_updates, saved_model_updates
from test_bad_input import said_once

from ringtrain.errors import EXIT_USAGE

USER_MODELS = ROOT / "tests" / "user_models.py"
BATCH, STEPS, SEED = 64, 5, 7  # 300 examples: the fifth batch is partial, as Keras's fit has it


def train(
    *args: str, optimizer: str = "adam", launcher: list[str] | None = None, timeout: float = 300
):
    """`ringtrain train` on the residual CNN of tests/user_models.py, compiled with `optimizer`,
    as a user would run it."""
    cmd = [*(launcher or []), str(BIN / "ringtrain"), "train"]
    cmd += ["--model", f"{USER_MODELS}:residual_cnn", "--model-arg", f"optimizer={optimizer!r}"]
    cmd += ["--data", f"{USER_MODELS}:digits_split", "--no-shuffle"]
    cmd += ["--batch-size", str(BATCH), "--steps", str(STEPS)]
    return run([*cmd, "--seed", str(SEED), *args], timeout=timeout)


@pytest.fixture(scope="module")
def references():
    """Keras's own fit of the same model on the same examples, in order, in one process: once
    per optimizer asked for."""
    sys.path.insert(0, str(USER_MODELS.parent))
    import user_models

    (x, y), _ = user_models.digits_split()

    @functools.cache
    def fit(optimizer: str):
        build = user_models.residual_cnn
        return keras_fit_updates(build, x, y, BATCH, STEPS, seed=SEED, optimizer=optimizer)

    return fit


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


class Launch(NamedTuple):
    """How the CLI is launched, its flags, and what the residual CNN is compiled with."""

    launcher: list[str]
    flags: list[str]
    optimizer: str = "adam"


MPIRUN_2 = ["mpirun", "--oversubscribe", "-np", "2"]
LAUNCHES = {
    # SGD with Nesterov momentum: the unbroken run the resume test below matches too
    "single": Launch([], ["--strategy", "single"], "nesterov"),
    "data-horovodrun": Launch(  # with the CLI's accumulation and bucket flags, which keep it exact
        ["horovodrun", "-np", "2", "-H", "localhost:2"],
        ["--strategy", "data", "--accumulate", "2", "--bucket-mb", "1"],
    ),
    "data-mpirun-fit": Launch(  # the user's own model.fit on each rank, gradients allreduced
        MPIRUN_2, ["--strategy", "data", "--loop", "fit"]
    ),
    "pipeline-mpirun": Launch(
        MPIRUN_2, ["--strategy", "pipeline", "--schedule", "1f1b", "--microbatches", "4"]
    ),
}


class Launched(NamedTuple):
    """A launch that ran, and the files it wrote."""

    done: subprocess.CompletedProcess
    saved: Path  # --save
    metrics: Path  # --metrics-out
    weights: Path  # --weights-out


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Each of LAUNCHES run once, whichever tests read it."""
    runs: dict[str, Launched] = {}

    def launch(name: str) -> Launched:
        if name not in runs:
            out = tmp_path_factory.mktemp(name)
            saved, metrics, weights = out / "trained.keras", out / "metrics.json", out / "w.npz"
            launcher, flags, optimizer = LAUNCHES[name]
            outputs = ["--save", str(saved), "--metrics-out", str(metrics)]
            outputs += ["--weights-out", str(weights)]
            done = train(*flags, *outputs, optimizer=optimizer, launcher=launcher)
            runs[name] = Launched(done, saved, metrics, weights)
        return runs[name]

    return launch


@pytest.mark.parametrize("launch", LAUNCHES)
def test_the_cli_trains_a_users_model_as_keras_fit_does(launch, launched, references):
    """Per tensor within the exactness bound of Keras's fit, as the saved .keras file holds
    it; the metrics file reports the run's steps (and the flags that reached it)."""
    ran = launched(launch)
    done = ran.done
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "held-out accuracy" in done.stdout and "Traceback" not in done.stderr
    comparison = saved_model_updates(ran.saved, references(LAUNCHES[launch].optimizer))
    assert comparison.ok, comparison.describe()
    reported = json.loads(ran.metrics.read_text())
    assert reported["steps"] == STEPS and reported["epochs"] == 1
    if "--accumulate" in LAUNCHES[launch].flags:  # the flags reached the run
        assert reported["config"]["accumulate"] == 2 and reported["config"]["bucket_mb"] == 1


FRESH_EVALUATION = """
import json, sys
sys.path.insert(0, {tests!r})
import keras, user_models
_, (x, y) = user_models.digits_split()
for path in sys.argv[1:]:
    model = keras.models.load_model(path)
    print(json.dumps(model.evaluate(x, y, batch_size=512, verbose=0, return_dict=True)))
"""


def test_every_saved_model_loads_in_a_fresh_process_and_scores_as_its_run_reported(launched):
    """Each launch's .keras file loads in a process that imports nothing from ringtrain (one
    for them all) and gives the held-out loss and accuracy its run reported."""
    runs = [launched(name) for name in LAUNCHES]
    for r in runs:
        assert r.done.returncode == 0, r.done.stderr[-2000:]
    script = FRESH_EVALUATION.format(tests=str(USER_MODELS.parent))
    fresh = subprocess.run(
        [sys.executable, "-c", script, *(str(r.saved) for r in runs)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    evaluated = [json.loads(line) for line in fresh.stdout.splitlines() if line.startswith("{")]
    assert len(evaluated) == len(runs)
    for r, scores in zip(runs, evaluated, strict=True):
        reported = json.loads(r.metrics.read_text())["held_out"]
        for name in ("loss", "accuracy"):
            assert scores[name] == pytest.approx(reported[name], rel=1e-5, abs=1e-6), r.saved


BAD_MODELS = """
import keras

def not_a_model():
    return "a model"

def uncompiled():
    inputs = keras.Input((8, 8, 1))
    return keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(inputs)))

def shared_at_both_ends():
    inputs = keras.Input((8, 8, 1))
    shared = keras.layers.Dense(1, name="shared")
    hidden = keras.layers.Dense(1, name="middle")(shared(inputs))
    model = keras.Model(inputs, shared(hidden))
    model.compile(optimizer="adam", loss="mse")
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
    """In process (the check needs no MPI): what `ringtrain train` says in its one line when
    it builds --model (the resume test below shows how such a line ends a run)."""
    from ringtrain.errors import UserError
    from ringtrain.keras_model.source import build_user_model

    with pytest.raises(UserError, match=re.escape(needle)) as refused:
        build_user_model(f"{bad_models}:{function}", [], SEED)
    assert refused.value.exit_code == EXIT_USAGE and "\n" not in str(refused.value)


REFUSED = {  # tests/user_models.py's, asked on 2 ranks what they cannot train as (mpi_checks)
    "subclassed": "is subclassed (no layer graph)",
    "bn_cnn_synchronized": "synchronized=True",
    "residual_cnn": "--loop fit needs every global batch to divide among the 2 ranks",
}


def test_a_model_that_cannot_train_as_asked_is_refused_in_one_line_on_every_rank(grid_checks):
    """In tests/mpi_checks.py's 2-rank launch, ringtrain.train as `ringtrain train` calls it:
    every rank raises the one-line refusal (exit code EXIT_USAGE) together, before the run
    starts, and leaves saying it to rank 0; the CLI says such a refusal once under mpirun
    (tests/test_bad_input.py, and for a user's model tests/test_your_data.py)."""
    lines = grid_checks._lines(2)  # every line of the launch: it has no accessor for these
    refusals = [r for r in lines if r.get("check") == "keras-refusal"]
    assert sorted(r["config"]["model"] for r in refusals) == sorted(REFUSED)
    for r in refusals:
        needle = REFUSED[r["config"]["model"]]
        assert len(r["ranks"]) == 2, r
        for rank, said in enumerate(r["ranks"]):
            assert said is not None, r  # that rank trained
            assert needle in said["message"] and "\n" not in said["message"], said
            assert said["exit_code"] == EXIT_USAGE and said["together"], said
            assert said["quiet"] == (rank != 0), said


@pytest.mark.parametrize(
    "function,split_at,needle",
    [
        ("shared_at_both_ends", None, "too few for 2 stages; the largest that cannot be cut"),
        ("residual_cnn", ["no_such_layer"], "--split-at no_such_layer: no such layer"),
        ("residual_cnn", ["block_conv2"], "lies inside the block block_conv1"),
    ],
)
def test_a_cut_that_cannot_be_made_is_refused_in_one_line(function, split_at, needle, bad_models):
    """The graph's own refusals, in process: the refusals above show how such a line ends a
    run on every rank."""
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


def test_a_users_model_stops_and_resumes_to_the_same_weights_as_an_unbroken_run(tmp_path, launched):
    """--stop-after checkpoints the compiled optimizer's state (SGD with Nesterov momentum) on
    2 data-parallel ranks; --resume on one process finishes the run: the same weights as the
    unbroken single launch of LAUNCHES, as the replicas are identical. A checkpoint of another
    model is refused."""
    resumed, flags = tmp_path / "resumed.npz", ["--checkpoint-dir", str(tmp_path / "ckpt")]
    nesterov = functools.partial(train, optimizer="nesterov")
    stopped = nesterov("--strategy", "data", *flags, "--stop-after", "2", launcher=MPIRUN_2)
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    done = nesterov("--strategy", "single", *flags, "--resume", "--weights-out", str(resumed))
    assert done.returncode == 0 and "resumed from" in done.stdout, done.stderr[-2000:]
    other = [str(BIN / "ringtrain"), "train", "--model", f"{USER_MODELS}:bn_cnn", "--resume"]
    other += [*flags, "--strategy", "single", "--steps", "3"]
    said_once(run(other), EXIT_USAGE, "checkpoint")
    whole = launched("single")
    assert whole.done.returncode == 0, whole.done.stderr[-2000:]
    a, b = np.load(whole.weights), np.load(resumed)
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


@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer")  # weights alone
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
    sys.path.insert(0, str(USER_MODELS.parent))
    import user_models

    model = user_models.residual_cnn("nesterov")
    model.load_weights(checkpoint)
    final = reports[0]["final"]
    assert sorted(final) == sorted(v.path for v in model.weights)
    for v in model.weights:
        np.testing.assert_array_equal(v.numpy(), np.array(final[v.path]), v.path)
