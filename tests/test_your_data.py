"""Your own data. Files from --data-files, `.npy` shards (memory maps) or TFRecord shards
(read by record index, parsed by the --data function, read ahead): in the order the same
examples in memory would take, exact against Keras's own fit under data, pipeline and hybrid,
shuffled file by file within a buffer, resumed mid-epoch on another rank count, with a rank's
memory bounded, and every bad file or record refused in one line. A tf.data.Dataset from
--data: read in its own order, exact against Keras's fit, and one that is batched, endless or
read differently by the ranks refused in one line. --shard-policy data, file, auto and off;
--validation-data; `ringtrain data make-synthetic`."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import BIN, ROOT, run
from reference import keras_fit_updates, saved_model_updates
from test_bad_input import said_once, train_under_mpirun

from ringtrain.data import Examples
from ringtrain.errors import EXIT_USAGE, UserError
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


def write_records(folder, x: np.ndarray, y: np.ndarray, sizes: list[int]) -> str:
    """TFRecord files of the given record counts, each record a tf.train.Example of the row's
    float32 bytes and its label (what DATASETS' parse_digit reads); the GLOB that finds them."""
    from ringtrain.tensorflow_loader import tf

    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for i, size in enumerate(sizes):
        with tf.io.TFRecordWriter(str(folder / f"part-{i}.tfrecord")) as writer:
            for row, label in zip(x[start : start + size], y[start : start + size], strict=True):
                feature = {
                    "x": tf.train.Feature(bytes_list=tf.train.BytesList(value=[row.tobytes()])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
                }
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                writer.write(example.SerializeToString())
        start += size
    assert start == len(x)
    return str(folder / "*.tfrecord")


@pytest.fixture(scope="module")
def digits_shards(tmp_path_factory):
    """tests/user_models.py's 300 training digits in 3 uneven shards, its 200 held out in 2,
    as .npy pairs and as TFRecord files; and Keras's own fit of the residual CNN on the same
    examples in order."""
    sys.path.insert(0, str(USER_MODELS.parent))
    import user_models

    (x, y), (x_val, y_val) = user_models.digits_split()
    root = tmp_path_factory.mktemp("shards")
    files = {
        kind: (
            write(root / kind / "train", x, y, [100, 130, 70]),
            write(root / kind / "held_out", x_val, y_val, [150, 50]),
        )
        for kind, write in (("npy", write_shards), ("tfrecord", write_records))
    }
    reference = keras_fit_updates(user_models.residual_cnn, x, y, BATCH, STEPS, seed=SEED)
    return files, reference


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


def unseeded():  # each rank draws its own order
    return digits().shuffle(300)


def parse_digit(serialized):  # one record of write_records: 8x8x1 float32 bytes, a label
    found = tf.io.parse_single_example(
        serialized,
        {{"x": tf.io.FixedLenFeature([], tf.string), "y": tf.io.FixedLenFeature([], tf.int64)}},
    )
    return tf.reshape(tf.io.decode_raw(found["x"], tf.float32), (8, 8, 1)), found["y"]


def parse_digit_shifted(serialized):  # labels 10..19, beyond a 10-class model
    image, label = parse_digit(serialized)
    return image, label + 10


def fails():
    raise ValueError("no data today")


def held_out():  # a Dataset for --validation-data
    return with_held_out()[1]


def own_shard():  # Horovod's idiom: each rank its own interleaved share of the examples
    import os

    rank, size = (int(os.environ["OMPI_COMM_WORLD_" + k]) for k in ("RANK", "SIZE"))
    return digits().shard(size, rank)
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
@pytest.mark.parametrize("source", ["npy", "tfrecord", "dataset"])
def test_files_and_datasets_train_as_keras_fit_on_the_same_examples(
    source, strategy, digits_shards, datasets, tmp_path
):
    """.npy shards or TFRecord files with --no-shuffle: global batch t is rows [tB, (t+1)B)
    of the files in name order, across file boundaries. A tf.data.Dataset: its elements
    [tB, (t+1)B), in its own order though --shuffle is on (the default), as Keras's fit does.
    Either way per tensor within the bound of Keras's fit on the arrays; the held-out part is
    scored."""
    files, reference = digits_shards
    saved, metrics = tmp_path / "trained.keras", tmp_path / "metrics.json"
    if source == "dataset":
        inputs = ["--data", f"{datasets}:with_held_out"]
    else:
        train, held_out = files[source]
        inputs = ["--data-files", train, "--validation-files", held_out, "--no-shuffle"]
        inputs += ["--data", f"{datasets}:parse_digit"] if source == "tfrecord" else []
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


@pytest.mark.mpi
def test_tfrecord_input_under_hybrid_with_nesterov_sgd_updates_as_keras_fit_does(
    digits_shards, datasets, tmp_path
):
    """A 2x2 grid (2 replicas of 2 stages, 1F1B, M=4) reading TFRecord files: each replica's
    first stage reads its features and its last stage its labels; SGD with Nesterov momentum
    updates within the bound of Keras's fit on the same examples."""
    sys.path.insert(0, str(USER_MODELS.parent))
    import user_models

    (x, y), _ = user_models.digits_split()
    reference = keras_fit_updates(
        user_models.residual_cnn, x, y, BATCH, STEPS, seed=SEED, optimizer="nesterov"
    )
    train, _ = digits_shards[0]["tfrecord"]
    saved = tmp_path / "trained.keras"
    done = train_under_mpirun(
        *["--model", f"{USER_MODELS}:residual_cnn", "--model-arg", "optimizer='nesterov'"],
        *["--data-files", train, "--data", f"{datasets}:parse_digit", "--no-shuffle"],
        *["--batch-size", str(BATCH), "--steps", str(STEPS), "--seed", str(SEED)],
        *["--strategy", "hybrid", "--pp-size", "2", *PIPELINE[2:], "--save", str(saved)],
        ranks=4,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    comparison = saved_model_updates(saved, reference)
    assert comparison.ok, comparison.describe()


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
    "shaped,needle",
    [
        (lambda d: d.batch(8), "the dataset is already batched"),
        (lambda d: d.repeat(), "the dataset is infinite (repeat())"),
        (lambda d: d.take(0), "the dataset holds no examples"),
        (lambda d: d.map(lambda x, y: x), "elements must be (features, label) pairs"),
    ],
)
def test_a_dataset_that_cannot_be_read_as_examples_is_refused(shaped, needle):
    from ringtrain.streamed import streamed
    from ringtrain.tensorflow_loader import tf

    digits = tf.data.Dataset.from_tensor_slices((np.zeros((20, 3), np.float32), np.arange(20)))
    with pytest.raises(UserError) as said:
        streamed(shaped(digits), 8, "--data f")
    assert needle in str(said.value)


@pytest.mark.mpi
def test_a_dataset_read_differently_by_the_ranks_is_refused_in_one_line(datasets):
    """An unseeded shuffle: each rank's first global batch differs, which the ranks compare."""
    args = ["--model", f"{USER_MODELS}:residual_cnn", "--data", f"{datasets}:unseeded"]
    needle = "the dataset's first global batch differs between ranks"
    said_once(train_under_mpirun(*args, "--steps", "1", ranks=2), EXIT_USAGE, needle)


def test_an_epoch_line_shows_the_input_wait_above_a_tenth_of_its_steps():
    from ringtrain.loop import epoch_line

    assert epoch_line(0.5, {"accuracy": 0.9}, 0.05) == {"loss": 0.5, "held-out accuracy": 0.9}
    assert epoch_line(0.5, {}, 0.25) == {"loss": 0.5, "input wait": 0.25}


def train_a_layer_model(tmp_path, layers: str, *flags: str) -> dict:
    """`ringtrain train` on 2 ranks of a Sequential of `layers` (Python source) under SGD,
    with `flags`; its --metrics-out."""
    model = tmp_path / "layers.py"
    model.write_text(
        "import keras\n\n"
        "def build():\n"
        f"    model = keras.Sequential([{layers}])\n"
        "    model.compile(optimizer='sgd', loss=keras.losses.SparseCategoricalCrossentropy("
        "from_logits=True))\n"
        "    return model\n"
    )
    metrics = tmp_path / "metrics.json"
    done = run(
        [
            *["mpirun", "--oversubscribe", "-np", "2", str(BIN / "ringtrain"), "train"],
            *["--model", f"{model}:build", *flags, "--metrics-out", str(metrics)],
        ],
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(metrics.read_text())


@pytest.mark.mpi
def test_a_rank_holds_a_few_shards_not_the_dataset(tmp_path):
    """Shuffled epochs over 320 MB of shards: the fullest rank's resident memory grows by less
    than half the dataset (it holds a batch and at most two mapped shards, not every file)."""
    rows, features, shards = 20_000, 4096, 20
    x = np.random.default_rng(0).normal(size=(rows, features)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    files = write_shards(tmp_path / "big", x, y, [rows // shards] * shards)
    del x
    reported = train_a_layer_model(
        tmp_path,
        f"keras.Input(({features},)), keras.layers.Dense(2)",
        *["--data-files", files, "--batch-size", "1000", "--epochs", "2"],
        *["--shuffle-buffer", "2000"],
    )
    grown = reported["peak_resident_above_import_bytes"]
    assert grown < rows * features * 4 / 2, grown
    assert reported["input_wait_s"] > 0 and 0 < reported["input_wait_fraction"] < 1


MEMORY_BUDGET = 128 * 2**20  # what a rank may add while it trains, whatever the set's size


@pytest.mark.mpi
def test_a_rank_streams_a_tfrecord_set_larger_than_its_memory_budget(tmp_path):
    """An epoch over 540 MB of TFRecord files made by make-synthetic, shuffled, on 2 ranks: the
    fullest rank's VmHWM grows by less than MEMORY_BUDGET once training starts, a quarter of
    the set (it holds a batch and the one read ahead, not the files)."""
    folder = tmp_path / "images"
    made = run(
        [
            *[str(BIN / "ringtrain"), "data", "make-synthetic", str(folder)],
            *["--examples", "11000", "--shape", "128,128,3", "--shards", "8"],
        ],
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size >= 512 * 2**20
    reported = train_a_layer_model(
        tmp_path,
        "keras.Input((128, 128, 3)), keras.layers.Rescaling(1 / 255), "
        "keras.layers.AveragePooling2D(8), keras.layers.Flatten(), keras.layers.Dense(10)",
        *["--data-files", str(folder / "*.tfrecord"), "--batch-size", "100", "--epochs", "1"],
        *["--data", "ringtrain.synthetic_files:parse_image", "--shuffle-buffer", "1000"],
    )
    assert reported["steps"] == 110
    assert reported["peak_resident_above_start_bytes"] < MEMORY_BUDGET, reported


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
                *["--model", f"{USER_MODELS}:residual_cnn", "--data-files", "x-*.npy"],
                *["--data", f"{USER_MODELS}:digits_split"],
            ],
            "--data goes with TFRecord --data-files (it parses a record)",
        ),
        (["--shuffle-buffer", "0"], "--shuffle-buffer must be at least 1"),
    ],
)
def test_bad_data_file_flags_are_refused_before_tensorflow(args, needle, before_tensorflow):
    said_once(before_tensorflow("train", *args), EXIT_USAGE, needle)


def _parse_pair(serialized):
    """write_records' records as (features, label), as a user's parse function would."""
    from ringtrain.tensorflow_loader import tf

    found = tf.io.parse_single_example(
        serialized,
        {"x": tf.io.FixedLenFeature([], tf.string), "y": tf.io.FixedLenFeature([], tf.int64)},
    )
    return tf.io.decode_raw(found["x"], tf.float32), found["y"]


def test_tfrecord_files_read_by_position_as_the_arrays_would(tmp_path):
    """Records located by one pass over their lengths and read by global position, in any
    order, across files, with few files open; the file sizes drive --shuffle as .npy's do."""
    from ringtrain.records import OPEN_FILES, parsed_records

    rng = np.random.default_rng(1)
    x = rng.normal(size=(230, 5)).astype(np.float32)
    y = rng.integers(0, 7, size=230)
    sizes = [40, 1, 89, 30, 20, 50]
    records = parsed_records(write_records(tmp_path, x, y, sizes), _parse_pair, "--f")
    examples = records.examples()
    assert records.files.rows == sizes and len(examples) == 230 and examples.x.shape == (230, 5)
    for indices in (rng.permutation(230)[:64], np.arange(35, 135), np.array([229, 0, 40])):
        features, labels = examples.take(indices)
        np.testing.assert_array_equal(features, x[indices])
        np.testing.assert_array_equal(labels, y[indices])
    assert len(records.files._open) <= OPEN_FILES
    ahead = np.array([200, 3, 77, 150, 41])  # read ahead, then taken in parts, in any order
    records.read_ahead(ahead)
    for indices in (ahead[[2, 0]], ahead[[4]], ahead):
        features, labels = examples.take(indices)
        np.testing.assert_array_equal(features, x[indices])
        np.testing.assert_array_equal(labels, y[indices])


def test_bad_tfrecord_files_are_named_in_one_line(tmp_path):
    """A file cut short, one with no records, a record that does not parse (its file and its
    index in it), and records that parse to another shape than the first."""
    from ringtrain.records import parsed_records

    x = np.zeros((12, 4), np.float32)
    good = write_records(tmp_path / "good", x, np.arange(12) % 3, [6, 6])
    whole = (tmp_path / "good" / "part-0.tfrecord").read_bytes()
    (tmp_path / "cut.tfrecord").write_bytes(whole[: len(whole) - 9])
    (tmp_path / "empty.tfrecord").write_bytes(b"")

    def refused(pattern: str, parse, needle: str, read=None) -> None:
        with pytest.raises(UserError) as said:
            examples = parsed_records(pattern, parse, "--data-files").examples()
            examples.take(np.arange(12) if read is None else read)
        assert needle in str(said.value), str(said.value)

    refused(str(tmp_path / "cut.tfrecord"), _parse_pair, "(record 5 is cut short)")
    refused(str(tmp_path / "empty.tfrecord"), _parse_pair, "empty.tfrecord holds no records")
    refused(str(tmp_path / "none-*.tfrecord"), _parse_pair, "matches no file")

    def wrong_key(serialized):
        from ringtrain.tensorflow_loader import tf

        ids = tf.io.parse_single_example(serialized, {"z": tf.io.FixedLenFeature([], tf.int64)})
        return ids["z"], 0

    refused(good, wrong_key, "record 0 of ")
    refused(good, wrong_key, "Feature: z (data type: int64) is required")

    def longer_for_label_two(serialized):
        from ringtrain.tensorflow_loader import tf

        features, label = _parse_pair(serialized)
        return tf.cond(label == 2, lambda: tf.concat([features, [1.0]], 0), lambda: features), label

    refused(good, longer_for_label_two, "do not batch", np.arange(6))
    refused(good, longer_for_label_two, "element part features is (5,) float32", np.array([2]))


def test_a_failing_data_function_and_labels_beyond_the_model_are_said_in_one_line(
    digits_shards, datasets
):
    args = [str(BIN / "ringtrain"), "train", "--model", f"{USER_MODELS}:residual_cnn"]
    args += ["--steps", "1", "--strategy", "single"]
    failing = run([*args, "--data", f"{datasets}:fails"])
    said_once(failing, EXIT_USAGE, "failed: ValueError: no data today")
    train, _ = digits_shards[0]["tfrecord"]
    shifted = run([*args, "--data-files", train, "--data", f"{datasets}:parse_digit_shifted"])
    said_once(shifted, EXIT_USAGE, "labels out of range: the data holds label 1")


def test_make_synthetic_writes_the_same_examples_as_tfrecord_and_npy(tmp_path):
    """`ringtrain data make-synthetic` in both formats from one seed: the shipped parse function
    reads the TFRecord files to the .npy shards' arrays, in a shuffled order too, whether the
    reader asks for whole chunks (few readers) or reads record by record (many); a folder that
    holds shards is kept."""
    from ringtrain.records import parsed_records
    from ringtrain.synthetic_files import parse_image

    flags = ["--examples", "700", "--shape", "5,4,3", "--classes", "4", "--shards", "3"]
    for fmt in ("tfrecord", "npy"):
        done = run([str(BIN / "ringtrain"), "data", "make-synthetic", str(tmp_path / fmt),
                    "--format", fmt, *flags])  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "--data-files" in done.stdout.splitlines()[-1]
    records = parsed_records(str(tmp_path / "tfrecord" / "*"), parse_image, "--f")
    x, y = npy_shards(str(tmp_path / "npy" / "*.npy"), "--f")
    assert records.files.rows == x.rows == [234, 233, 233]
    images, labels = records.examples().take(np.arange(700))
    assert images.dtype == np.uint8 and images.shape == (700, 5, 4, 3)
    np.testing.assert_array_equal(images, x[np.arange(700)])
    np.testing.assert_array_equal(labels, y[np.arange(700)])
    assert set(labels) == {0, 1, 2, 3}
    shuffled = np.random.default_rng(0).permutation(700)[:300]
    for readers, chunked in ((2, True), (8, False)):
        records.files.shared_by(readers)
        assert records.files.chunked is chunked
        images, labels = records.examples().take(shuffled)
        np.testing.assert_array_equal(images, x[shuffled])
        np.testing.assert_array_equal(labels, y[shuffled])
    again = run([str(BIN / "ringtrain"), "data", "make-synthetic", str(tmp_path / "npy"), *flags])
    said_once(again, EXIT_USAGE, "already holds shards (x-00000.npy)", "data make-synthetic")


@pytest.mark.parametrize("shuffle", [False, True])
def test_file_sharding_deals_each_reader_its_own_files_and_every_record_once(shuffle):
    """--shard-policy file on 2 readers: across an epoch the shares every reader took are the
    dataset, each record once, each reader's from its own files only, none empty; `auto` picks
    it with at least as many files as readers, as TF's AutoShardPolicy does."""
    from ringtrain.data import UserData, uneven_shard

    rows, readers, batch = [100, 130, 70, 50, 90], 2, 64
    offsets = np.cumsum([0, *rows])
    data = UserData(Examples(np.zeros((440, 1)), np.zeros(440)), None, rows, shuffle_buffer=40)
    assert data.choose_policy("auto", 6) == "data" and data.policy == "data"
    assert data.choose_policy("auto", readers) == "file" and data.readers == readers
    for epoch in (0, 1):
        batches = data.epoch_order(batch, SEED, epoch, shuffle)
        assert len(batches) == 7  # ceil(440 / 64), as with data sharding
        read = [np.concatenate([uneven_shard(b, r, readers) for b in batches]) for r in (0, 1)]
        assert all(len(uneven_shard(b, r, readers)) for b in batches for r in (0, 1))
        assert sorted(np.concatenate(read)) == list(range(440))
        files = [set(np.searchsorted(offsets, mine, side="right") - 1) for mine in read]
        assert not files[0] & files[1] and files[0] | files[1] == set(range(5))


def test_file_and_off_sharding_are_refused_where_they_cannot_apply():
    from ringtrain.data import UserData

    arrays = UserData(Examples(np.zeros((40, 1)), np.zeros(40)))
    with pytest.raises(UserError, match="--shard-policy file needs --data-files"):
        arrays.choose_policy("file", 2)
    with pytest.raises(UserError, match="off is for a tf.data.Dataset that shards itself"):
        arrays.choose_policy("off", 2)
    few = UserData(Examples(np.zeros((40, 1)), np.zeros(40)), None, [20, 20])
    with pytest.raises(UserError, match="2 file\\(s\\) for 3 readers"):
        few.choose_policy("file", 3)
    assert few.choose_policy("auto", 3) == "data"


@pytest.mark.mpi
def test_the_cli_trains_each_rank_on_its_own_files(digits_shards, datasets):
    train, held_out = digits_shards[0]["tfrecord"]
    done = train_under_mpirun(
        *["--model", f"{USER_MODELS}:residual_cnn", "--data-files", train],
        *["--validation-files", held_out, "--data", f"{datasets}:parse_digit"],
        *["--shard-policy", "file", "--epochs", "2", "--batch-size", str(BATCH)],
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--shard-policy file: 3 files dealt to 2 readers" in done.stdout


@pytest.mark.mpi
def test_tfrecord_input_stopped_mid_epoch_resumes_on_one_rank_to_the_unbroken_weights(
    digits_shards, datasets, tmp_path
):
    """Shuffled TFRecord input, 2 epochs: stopped in the second epoch on 2 ranks, resumed on 1,
    the same weights as one unbroken process: the input position is the step, whatever the
    rank count."""
    train, _ = digits_shards[0]["tfrecord"]
    flags = ["--model", f"{USER_MODELS}:residual_cnn", "--data-files", train]
    flags += ["--data", f"{datasets}:parse_digit", "--shuffle-buffer", "50", "--epochs", "2"]
    flags += ["--batch-size", str(BATCH), "--checkpoint-dir"]
    whole, resumed = tmp_path / "whole.npz", tmp_path / "resumed.npz"
    ringtrain = [str(BIN / "ringtrain"), "train", *flags]
    done = run([*ringtrain, str(tmp_path / "a"), "--weights-out", str(whole)], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    stopped = train_under_mpirun(*flags, str(tmp_path / "b"), "--stop-after", "7")
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    done = run([*ringtrain, str(tmp_path / "b"), "--resume", "--weights-out", str(resumed)])
    assert done.returncode == 0 and "resumed from" in done.stdout, done.stderr[-2000:]
    a, b = np.load(whole), np.load(resumed)
    assert sorted(a.files) == sorted(b.files)
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files) < 1e-5


@pytest.mark.mpi
def test_a_dataset_that_shards_itself_trains_under_shard_policy_off(datasets, tmp_path):
    """--shard-policy off: each rank's Dataset (dataset.shard(2, rank)) is its share; global
    batch t is each rank's elements [t*b, (t+1)*b) side by side, per tensor within the bound
    of Keras's fit on those batches."""
    sys.path.insert(0, str(USER_MODELS.parent))
    import user_models

    (x, y), _ = user_models.digits_split()
    batch, steps, share = 60, 5, 30  # 150 examples a rank: 5 shares of 30
    order = [
        rank + 2 * p
        for t in range(steps)
        for rank in (0, 1)
        for p in range(t * share, (t + 1) * share)
    ]
    reference = keras_fit_updates(user_models.residual_cnn, x[order], y[order], batch, steps, SEED)
    saved = tmp_path / "trained.keras"
    done = train_under_mpirun(
        *["--model", f"{USER_MODELS}:residual_cnn", "--data", f"{datasets}:own_shard"],
        *["--shard-policy", "off", "--batch-size", str(batch), "--epochs", "1"],
        *["--seed", str(SEED), "--save", str(saved)],
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    comparison = saved_model_updates(saved, reference)
    assert comparison.ok, comparison.describe()


def test_validation_data_from_its_own_function_is_scored_each_epoch(datasets, tmp_path):
    """--validation-data FUNCTION: a Dataset of held-out examples beside --data's training
    Dataset, scored at each epoch's end; given twice, refused in one line."""
    metrics = tmp_path / "metrics.json"
    base = [str(BIN / "ringtrain"), "train", "--model", f"{USER_MODELS}:residual_cnn"]
    base += ["--validation-data", f"{datasets}:held_out", "--strategy", "single"]
    done = run([*base, "--data", f"{datasets}:digits", "--epochs", "2", "--batch-size", "100",
                "--metrics-out", str(metrics)])  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    history = json.loads(metrics.read_text())["history"]
    assert len(history["val_loss"]) == 2 and len(history["val_accuracy"]) == 2
    twice = run([*base, "--data", f"{datasets}:with_held_out", "--steps", "1"])
    said_once(twice, EXIT_USAGE, "held-out examples given twice")


def test_a_checkpoint_refuses_a_resume_that_would_read_another_order():
    from ringtrain.checkpoint import check_identity, flag_identity
    from ringtrain.config import TrainConfig

    written = {"folder": "ckpt/step-00000007", "identity": flag_identity(TrainConfig())}
    for changed, needle in (
        ({"shuffle_buffer": 60}, "shuffle_buffer is 10000 there and 60 here"),
        ({"shard_policy": "file"}, "shard_policy is 'data' there and 'file' here"),
        ({"shuffle": False}, "shuffle is True there and False here"),
    ):
        with pytest.raises(UserError, match=needle):
            check_identity(written, flag_identity(TrainConfig(**changed)))
