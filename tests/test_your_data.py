"""Your own data in `.npy` shards (`--data-files`): read through memory maps, in the order the
same examples in memory would take, exact against Keras's own fit, shuffled file by file within
a buffer, with a rank's memory bounded by a few shards, and every bad file refused in one
line. A tf.data.Dataset from --data: read in its own order, exact against Keras's fit, and one
that is batched, endless or read differently by the ranks refused in one line."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import BIN, ROOT, run
from reference import keras_fit_updates, saved_model_updates
from test_bad_input import said_once, train_under_mpirun

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


DATASETS = """
import sys

sys.path.insert(0, {folder!r})
import tensorflow as tf
import user_models


def digits():
    (x, y), _ = user_models.digits_split()
    return tf.data.Dataset.from_tensor_slices((x, y))


def with_held_out():  # (train, validation), both unbatched
    _, (x_val, y_val) = user_models.digits_split()
    return digits(), tf.data.Dataset.from_tensor_slices((x_val, y_val))


def batched():
    return digits().batch(8)


def unseeded():  # each rank draws its own order
    return digits().shuffle(300)


def endless():
    return digits().repeat()
"""


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> str:
    """A --data file whose functions return tf.data.Datasets of the 300 training digits."""
    path = tmp_path_factory.mktemp("datasets") / "datasets.py"
    path.write_text(DATASETS.format(folder=str(USER_MODELS.parent)))
    return str(path)


PIPELINE = ["--strategy", "pipeline", "--schedule", "1f1b", "--microbatches", "4"]


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", [["--strategy", "data"], PIPELINE], ids=["data", "pipeline"])
@pytest.mark.parametrize("source", ["npy", "dataset"])
def test_files_and_datasets_train_as_keras_fit_on_the_same_examples(
    source, strategy, digits_shards, datasets, tmp_path
):
    """.npy shards with --no-shuffle: global batch t is rows [tB, (t+1)B) of the shards in
    name order, across shard boundaries. A tf.data.Dataset: its elements [tB, (t+1)B), in its
    own order though --shuffle is on (the default), as Keras's fit does. Either way per tensor
    within the bound of Keras's fit on the arrays; the held-out part is scored."""
    train, held_out, reference = digits_shards
    saved, metrics = tmp_path / "trained.keras", tmp_path / "metrics.json"
    inputs = {
        "npy": ["--data-files", train, "--validation-files", held_out, "--no-shuffle"],
        "dataset": ["--data", f"{datasets}:with_held_out"],
    }[source]
    done = run(
        [
            *["mpirun", "--oversubscribe", "-np", "2", str(BIN / "ringtrain"), "train"],
            *["--model", f"{USER_MODELS}:residual_cnn", *inputs, "--batch-size", str(BATCH)],
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


def test_a_dataset_is_read_a_global_batch_at_a_time_in_its_own_order():
    """Positions read as the arrays' rows would be: within a global batch, from the next one,
    back at the start (a new epoch), ahead by many (a resume), across several (--loop fit);
    with a dict of features, and a length the dataset does not know until counted."""
    from ringtrain.streamed import streamed
    from ringtrain.tensorflow_loader import tf

    x = np.arange(150, dtype=np.float32).reshape(50, 3)
    y = np.arange(50)
    unknown_length = tf.data.Dataset.from_tensor_slices(({"a": x}, y)).filter(lambda *_: True)
    examples = streamed(unknown_length, 8, "--data")
    assert len(examples) == 50
    reads = [np.arange(8, 12), np.arange(12, 16), np.arange(16, 24), np.arange(0, 3)]
    reads += [np.arange(48, 50), np.arange(3, 30), np.array([], int), np.arange(40, 44)]
    for indices in reads:
        features, labels = examples.take(indices)
        np.testing.assert_array_equal(features["a"], x[indices])
        np.testing.assert_array_equal(labels, y[indices])


@pytest.mark.parametrize(
    "function,ranks,needle",
    [
        ("batched", 1, "the dataset is already batched"),
        ("endless", 1, "the dataset is infinite (repeat())"),
        ("unseeded", 2, "the dataset's first global batch differs between ranks"),
    ],
)
def test_a_dataset_that_cannot_be_read_alike_is_refused_in_one_line(
    function, ranks, needle, datasets
):
    args = ["--model", f"{USER_MODELS}:residual_cnn", "--data", f"{datasets}:{function}"]
    said_once(train_under_mpirun(*args, "--steps", "1", ranks=ranks), EXIT_USAGE, needle)


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
