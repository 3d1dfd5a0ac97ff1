"""Your own data in `.npy` shards (`--data-files`): read through memory maps, in the order the
same examples in memory would take, exact against Keras's own fit, shuffled file by file within
a buffer, with a rank's memory bounded by a few shards, and every bad file refused in one
line."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import BIN, ROOT, run
from reference import keras_fit_updates, saved_model_updates
from test_bad_input import said_once

from ringtrain.errors import EXIT_USAGE
from ringtrain.shards import OPEN_SHARDS, npy_shards, shard_order

USER_MODELS = ROOT / "tests" / "user_models.py"
BATCH, STEPS, SEED = 64, 5, 7  # the last of the 5 steps is partial: 300 examples


def write_shards(folder, x: np.ndarray, y: np.ndarray, sizes: list[int]) -> str:
    """x-NNNNN.npy and y-NNNNN.npy of the given row counts; the GLOB that finds them."""
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for i, size in enumerate(sizes):
        np.save(folder / f"x-{i:05d}.npy", x[start : start + size])
        np.save(folder / f"y-{i:05d}.npy", y[start : start + size])
        start += size
    assert start == len(x)
    return str(folder / "*.npy")


@pytest.fixture(scope="module")
def digits_shards(tmp_path_factory):
    """tests/user_models.py's 300 training digits in 3 uneven shards, its 200 held out in 2;
    and Keras's own fit of the residual CNN on the same examples in order."""
    sys.path.insert(0, str(USER_MODELS.parent))
    import user_models

    (x, y), (x_val, y_val) = user_models.digits_split()
    root = tmp_path_factory.mktemp("shards")
    train = write_shards(root / "train", x, y, [100, 130, 70])
    held_out = write_shards(root / "held_out", x_val, y_val, [150, 50])
    reference = keras_fit_updates(user_models.residual_cnn, x, y, BATCH, STEPS, seed=SEED)
    return train, held_out, reference


def test_sharded_rows_read_as_the_array_would_with_few_maps_open(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 3, 2)).astype(np.float32)
    rows, _ = npy_shards(write_shards(tmp_path, x, np.arange(500), [90, 200, 10, 200]), "--f")
    assert rows.shape == x.shape and len(rows) == 500 and rows.dtype == np.float32
    for index in (rng.permutation(500)[:77], np.arange(85, 300), slice(480, None)):
        np.testing.assert_array_equal(rows[index], x[index])
        assert len(rows._maps) <= OPEN_SHARDS


def test_a_shuffled_epoch_reads_the_files_in_turn_within_a_buffer():
    """A permutation drawn from (seed, epoch) alone; a window of `buffer` rows comes from at
    most two files when every file holds at least a buffer."""
    sizes, buffer = [300, 500, 400, 300], 250
    offsets = np.cumsum([0, *sizes])
    order = shard_order(sizes, seed=3, epoch=1, buffer=buffer)
    assert sorted(order) == list(range(sum(sizes)))
    np.testing.assert_array_equal(order, shard_order(sizes, seed=3, epoch=1, buffer=buffer))
    assert not np.array_equal(order, shard_order(sizes, seed=3, epoch=2, buffer=buffer))
    files = np.searchsorted(offsets, order, side="right") - 1
    for start in range(0, len(order), buffer):
        assert len(set(files[start : start + buffer])) <= 2


@pytest.mark.mpi
@pytest.mark.parametrize(
    "strategy",
    [
        ["--strategy", "data"],
        ["--strategy", "pipeline", "--schedule", "1f1b", "--microbatches", "4"],
    ],
)
def test_shards_train_as_keras_fit_on_the_same_examples(strategy, digits_shards, tmp_path):
    """With --no-shuffle, global batch t is rows [tB, (t+1)B) of the shards in name order,
    across shard boundaries: per tensor within the bound of Keras's fit on the arrays; the
    held-out shards are scored."""
    train, held_out, reference = digits_shards
    saved, metrics = tmp_path / "trained.keras", tmp_path / "metrics.json"
    done = run(
        [
            *["mpirun", "--oversubscribe", "-np", "2", str(BIN / "ringtrain"), "train"],
            *["--model", f"{USER_MODELS}:residual_cnn", "--data-files", train],
            *["--validation-files", held_out, "--no-shuffle", "--batch-size", str(BATCH)],
            *["--steps", str(STEPS), "--seed", str(SEED), "--save", str(saved)],
            *["--metrics-out", str(metrics), *strategy],
        ],
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    comparison = saved_model_updates(saved, reference)
    assert comparison.ok, comparison.describe()
    reported = json.loads(metrics.read_text())
    assert set(reported["held_out"]) >= {"loss", "accuracy"}
    assert reported["input_wait_s"] > 0 and 0 < reported["input_wait_fraction"] < 1


def test_an_epoch_line_shows_the_input_wait_above_a_tenth_of_its_steps():
    from ringtrain.loop import epoch_line

    assert epoch_line(0.5, {"accuracy": 0.9}, 0.05) == {"loss": 0.5, "held-out accuracy": 0.9}
    assert epoch_line(0.5, {}, 0.25) == {"loss": 0.5, "input wait": 0.25}


@pytest.mark.mpi
def test_a_rank_holds_a_few_shards_not_the_dataset(tmp_path):
    """Shuffled epochs over 320 MB of shards: the fullest rank's resident memory grows by less
    than half the dataset (it holds a batch and at most two mapped shards, not every file)."""
    rows, features, shards = 20_000, 4096, 20
    x = np.random.default_rng(0).normal(size=(rows, features)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    files = write_shards(tmp_path / "big", x, y, [rows // shards] * shards)
    del x
    model = tmp_path / "wide.py"
    model.write_text(
        "import keras\n\n"
        "def build():\n"
        f"    model = keras.Sequential([keras.Input(({features},)), keras.layers.Dense(2)])\n"
        "    model.compile(optimizer='sgd', loss=keras.losses.SparseCategoricalCrossentropy("
        "from_logits=True))\n"
        "    return model\n"
    )
    metrics = tmp_path / "metrics.json"
    done = run(
        [
            *["mpirun", "--oversubscribe", "-np", "2", str(BIN / "ringtrain"), "train"],
            *["--model", f"{model}:build", "--data-files", files, "--batch-size", "1000"],
            *["--epochs", "2", "--shuffle-buffer", "2000", "--metrics-out", str(metrics)],
        ],
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    reported = json.loads(metrics.read_text())
    grown = reported["peak_resident_above_import_bytes"]
    assert grown < rows * features * 4 / 2, grown
    assert reported["input_wait_s"] > 0 and 0 < reported["input_wait_fraction"] < 1


BAD_FILES = {  # name -> (the files written, the flag's pattern, what the line says)
    "none": ({}, "*.npy", "matches no file"),
    "misnamed": ({"a.npy": np.zeros((2, 3))}, "*.npy", "is not named x-NNNNN.npy"),
    "unpaired": ({"x-00000.npy": np.zeros((2, 3))}, "*.npy", "has no y-00000.npy beside it"),
    "rows": (
        {"x-00000.npy": np.zeros((2, 3)), "y-00000.npy": np.zeros(3)},
        "*.npy",
        "x-00000.npy holds 2 rows but y-00000.npy 3",
    ),
    "shapes": (
        {
            "x-00000.npy": np.zeros((2, 3)),
            "y-00000.npy": np.zeros(2),
            "x-00001.npy": np.zeros((2, 4)),
            "y-00001.npy": np.zeros(2),
        },
        "*.npy",
        "holds rows of (4,) float64",
    ),
    "objects": (
        {"x-00000.npy": np.array([{}, {}], dtype=object), "y-00000.npy": np.zeros(2)},
        "*.npy",
        "holds Python objects",
    ),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_shards_are_refused_in_one_line_before_tensorflow(case, tmp_path, before_tensorflow):
    files, pattern, needle = BAD_FILES[case]
    for name, value in files.items():
        np.save(tmp_path / name, value, allow_pickle=True)
    args = ["--model", f"{USER_MODELS}:residual_cnn", "--data-files", str(tmp_path / pattern)]
    said_once(before_tensorflow("train", *args), EXIT_USAGE, needle)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--data-files", "x"], "--data-files needs --model PATH.py:FUNCTION"),
        (["--validation-files", "x"], "--validation-files goes with --data-files"),
        (
            [
                *["--model", f"{USER_MODELS}:residual_cnn", "--data-files", "x"],
                *["--data", f"{USER_MODELS}:digits_split"],
            ],
            "either --data or --data-files",
        ),
        (["--shuffle-buffer", "0"], "--shuffle-buffer must be at least 1"),
    ],
)
def test_bad_data_file_flags_are_refused_before_tensorflow(args, needle, before_tensorflow):
    said_once(before_tensorflow("train", *args), EXIT_USAGE, needle)
