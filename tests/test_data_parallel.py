"""Data parallelism on Horovod equals a plain TensorFlow loop on the same global batch."""

from __future__ import annotations

import json
import re

import pytest
from conftest import (
    assert_exact_resume,
    assert_matches_reference,
    one_line_error,
    ringtrain,
    run,
    train_matches_reference,
)

pytestmark = pytest.mark.mpi


def test_single_process_engine_matches_the_independent_reference(grid_checks):
    results = grid_checks.results(1, "single")
    assert_matches_reference(results)
    assert {(r["config"]["model"], r["config"]["optimizer"]) for r in results} == {
        (m, o) for m in ("mlp", "cnn", "transformer") for o in ("sgd", "adam")
    }


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_data_parallel_matches_the_independent_reference_for_every_configuration(
    ranks, grid_checks
):
    results = grid_checks.results(ranks, "data")
    assert_matches_reference(results)
    for r in results:
        assert len(r["replica_checksums"]) == ranks
        assert len(set(r["replica_checksums"])) == 1, r  # every rank holds the same weights
    if ranks == 2:
        configs = [r["config"] for r in results]
        assert {(c["model"], c["optimizer"]) for c in configs if c["loop"] == "custom"} == {
            (m, o) for m in ("mlp", "cnn", "transformer") for o in ("sgd", "adam")
        }
        families = {(c["loop"], c["accumulate"] > 1, c["fp16_allreduce"]) for c in configs}
        assert families >= {
            ("custom", False, False),
            ("custom", True, False),
            ("custom", False, True),
            ("fit", False, False),
        }
        assert any(c["clip_norm"] for c in configs)


def test_data_parallel_resume_is_bit_for_bit(grid_checks):
    checks = grid_checks.resumes(2, "data")
    assert_exact_resume(checks)
    assert {c["config"]["model"] for c in checks} == {"mlp", "transformer"}


# One launch carries the built-in's data-parallel CLI flags that no user-model run does:
# model.fit with --fp16-allreduce, held to fp16's bound (grid_checks holds the numerics flag by
# flag above; --accumulate and --bucket-mb go through the CLI in test_your_model.py).
def test_cli_data_parallel_matches_the_independent_reference(tmp_path, cli_reference):
    _, report = train_matches_reference(
        cli_reference,
        tmp_path,
        "--strategy",
        "data",
        "--loop",
        "fit",
        "--fp16-allreduce",
        ranks=2,
        fp16=True,
    )
    for key in (
        "strategy",
        "world_size",
        "steps",
        "losses",
        "final_loss",
        "test_accuracy",
        "samples_per_sec",
        "seconds",
    ):
        assert key in report
    assert report["world_size"] == 2 and report["steps"] == 5 and len(report["losses"]) == 5
    passed = {"loop": "fit", "fp16_allreduce": True}
    assert {k: report["config"][k] for k in passed} == passed  # the flags reached the run


def test_default_run_under_horovodrun_reaches_95_percent_and_loads_into_single_model(tmp_path):
    weights, metrics, saved = tmp_path / "w.npz", tmp_path / "m.json", tmp_path / "mlp.keras"
    done = run(
        [
            "horovodrun",
            "-np",
            "2",
            "-H",
            "localhost:2",
            "ringtrain",
            "train",
            "--weights-out",
            str(weights),
            "--metrics-out",
            str(metrics),
            "--save",
            str(saved),
        ]
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(metrics.read_text())
    assert report["strategy"] == "data" and report["world_size"] == 2
    assert report["test_accuracy"] >= 0.95
    assert "held-out accuracy" in done.stdout
    # The documented one call loads the file into the single-process model.
    import numpy as np

    import ringtrain

    data = ringtrain.load_digits()
    model = ringtrain.mlp(data.input_shape, data.n_classes)
    ringtrain.load_weights(model, str(weights))
    predicted = np.argmax(model.predict(data.x_test, verbose=0), axis=-1)
    # Keras's accuracy metric reports its count's ratio in float32
    assert abs(float(np.mean(predicted == data.y_test)) - report["test_accuracy"]) < 1e-6
    # The built-in is an ordinary Keras model: --save's file loads back, compiled, as it ran.
    import keras

    scores = keras.models.load_model(saved).evaluate(
        data.x_test, data.y_test, verbose=0, return_dict=True
    )
    assert scores == pytest.approx(report["held_out"], rel=1e-5)


def test_data_strategy_without_a_launcher_runs_as_one_rank(tmp_path, cli_reference):
    train_matches_reference(cli_reference, tmp_path, "--strategy", "data")


def test_batch_smaller_than_the_ranks_fails_on_every_rank_without_hanging():
    done = ringtrain(
        "train", "--strategy", "data", "--batch-size", "1", "--steps", "1", ranks=2, timeout=120
    )
    one_line_error(done, "global batch 1 is smaller than the 2 shares it is cut into")
    assert "[rank 1]" not in done.stderr  # every rank found it, so rank 0 alone says it


def test_keras_fit_example_runs_under_horovodrun():
    done = run(["horovodrun", "-np", "2", "-H", "localhost:2", "python", "examples/keras_fit.py"])
    assert done.returncode == 0, done.stderr[-2000:]
    # horovodrun tags every chunk of output ([1,0]<stdout>:), so read the number by pattern
    accuracy = float(re.search(r"held-out accuracy (\d+\.\d+)", done.stdout).group(1))
    assert accuracy > 0.9


def test_user_arrays_train_through_npz(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    np.savez(tmp_path / "mine.npz", x=x, y=y)
    metrics = tmp_path / "m.json"
    done = ringtrain(
        "train",
        "--strategy",
        "data",
        "--dataset",
        f"npz:{tmp_path / 'mine.npz'}",
        "--batch-size",
        "20",
        "--epochs",
        "3",
        "--metrics-out",
        str(metrics),
        ranks=2,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(metrics.read_text())["world_size"] == 2


@pytest.mark.parametrize(
    "launcher",
    [
        ["horovodrun", "-np", "2", "--hostfile", "hostfiles/localhost.horovod"],
        ["mpirun", "-np", "2", "--hostfile", "hostfiles/localhost.mpirun"],
    ],
)
def test_the_example_hostfiles_launch_a_2_rank_training(launcher):
    done = run([*launcher, "ringtrain", "train", "--steps", "3", "--batch-size", "32"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ringtrain: strategy data, 2 rank(s)" in done.stdout
