"""--shard-optimizer (ZeRO stage 1): each data-parallel replica keeps the optimizer's slots for
1/N of the weights, and the updates are still Keras's own, per tensor within the bound of its
`fit` on one process; a sharded checkpoint resumes exactly, and on one rank without the flag;
one replica changes nothing; what it cannot do exactly is refused in one line."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
from conftest import BIN, MPIRUN, ROOT, assert_exact_resume, compare_weight_files, run
from test_bad_input import said_once, train_under_mpirun

from ringtrain.errors import EXIT_CHECKPOINTED, EXIT_USAGE

USER_MODELS = ROOT / "tests" / "user_models.py"


def shard_checks(ranks: int, resume_dir) -> list[dict]:
    """tests/mpi_checks.py --shard on this many ranks: rank 0's JSON lines."""
    script = [sys.executable, str(ROOT / "tests" / "mpi_checks.py"), "--shard", str(resume_dir)]
    done = run([*MPIRUN, str(ranks), *script], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,count", [(2, 8), (4, 4)])
def test_sharded_updates_match_keras_fit_and_every_replica_agrees(ranks, count, tmp_path):
    """On 2 ranks the zoo's CNN under Adam (a partial, uneven last batch), SGD + Nesterov
    momentum, SGD + momentum under a frozen extractor, AdamW with a cosine schedule and
    global_clipnorm, Adam with per-variable clipnorm, RMSprop with clipvalue, two outputs under
    --accumulate 2: each per tensor within the bound of Keras's own fit; the built-in MLP under
    SGD and --fp16-allreduce within the independent reference's. On 4 ranks the CNN under Adam
    and under SGD + Nesterov momentum, data parallel and hybrid 2x2. Every data-parallel replica
    ends with rank 0's weights, bit for bit. On 2 ranks a sharded run stopped half way resumes
    to the same weights, bit for bit."""
    results = shard_checks(ranks, tmp_path)
    resumes = [r for r in results if r.get("check") == "resume"]
    updates = [r for r in results if r.get("check") != "resume"]
    assert len(updates) == count
    for r in updates:
        c, u = r["config"], r["update"]
        print(f"{ranks} ranks, {c['model']}: {u['worst_tensor']} {u['worst_ratio']:.3f} of bound")
    for r in updates:
        assert r["config"]["shard_optimizer"] and r["update"]["passed"], r
        if r.get("check") == "keras-shard" and r["config"]["strategy"] == "hybrid":
            assert r["steps"] == 3 and r["replicas_max_abs_diff"] is None, r
        elif r.get("check") == "keras-shard":
            assert r["steps"] == 3 and r["replicas_max_abs_diff"] == 0.0, r
        else:
            assert r["losses_passed"] and len(set(r["replica_checksums"])) == 1, r
    if ranks == 2:
        assert_exact_resume(resumes)


def train(*args: str, ranks: int | None = None):
    """`ringtrain train` on the residual CNN (Adam) of tests/user_models.py, 4 steps."""
    cmd = [str(BIN / "ringtrain"), "train", "--model", f"{USER_MODELS}:residual_cnn"]
    cmd += ["--data", f"{USER_MODELS}:digits_split", "--no-shuffle", "--batch-size", "64"]
    cmd += ["--steps", "4", "--seed", "7", *args]
    return run(cmd if ranks is None else [*MPIRUN, str(ranks), *cmd])


@pytest.mark.mpi
def test_a_sharded_checkpoint_resumes_on_other_ranks_and_without_the_flag(tmp_path):
    """Four sharded data-parallel ranks stop after step 2, each writing its shard of Adam's
    moments (kept in chunks, written whole); two sharded ranks resume from them, and so does
    one rank without --shard-optimizer (the shards laid out as one optimizer's). A hybrid 2x2
    grid, each stage's slots shared by its two replicas, stops too and resumes without the
    flag. Each ends within the bound of an unbroken run on one process, per tensor."""
    whole, start = tmp_path / "whole.npz", tmp_path / "start.npz"
    done = train("--weights-out", str(whole), "--initial-weights-out", str(start))
    assert done.returncode == 0, done.stderr[-2000:]
    chunked = ["--shard-optimizer", "--bucket-mb", "0.05"]  # each slot in several variables
    hybrid = ["--strategy", "hybrid", "--pp-size", "2", "--microbatches", "4"]
    for name, grid, resumes in (
        ("data", [], ((2, chunked), (None, []))),
        ("hybrid", hybrid, ((4, hybrid),)),
    ):
        ckpt = tmp_path / name
        flags = [*chunked, *grid, "--checkpoint-dir", str(ckpt), "--stop-after", "2"]
        stopped = train(*flags, ranks=4)
        assert stopped.returncode == EXIT_CHECKPOINTED, stopped.stderr[-2000:]
        manifest = json.loads((ckpt / "step-00000002" / "manifest.json").read_text())
        groups = manifest["optimizer_shards"]
        assert sorted(manifest["parts"]) == sorted(p for g in groups.values() for p in g)
        expected = {"model": 4} if name == "data" else {"stage0": 2, "stage1": 2}
        assert {read: len(parts) for read, parts in groups.items()} == expected
        for ranks, resume_flags in resumes:
            copy = tmp_path / f"{name}-{ranks}"
            shutil.copytree(ckpt, copy)
            resumed = tmp_path / f"{name}-{ranks}.npz"
            args = [*resume_flags, "--checkpoint-dir", str(copy), "--resume"]
            done = train(*args, "--weights-out", str(resumed), ranks=ranks)
            assert done.returncode == 0 and "resumed from" in done.stdout, done.stderr[-2000:]
            update = compare_weight_files(resumed, whole, start)
            print(name, "on", ranks or 1, "rank(s):", update)
            assert update.passed, update


def test_one_replica_with_the_flag_trains_bit_for_bit_as_without_it():
    """Nothing to divide: the same engine, the same weights."""
    import keras

    sys.path.insert(0, str(USER_MODELS.parent))
    import user_models

    from ringtrain.api import engine_for
    from ringtrain.config import TrainConfig
    from ringtrain.data import Examples, UserData
    from ringtrain.runtime import World

    (x, y), _ = user_models.digits_split()
    world = World(rank=0, size=1, local_rank=0, local_size=1, comm=None)
    trained = []
    for flag in (True, False):
        keras.utils.set_random_seed(7)
        model = user_models.residual_cnn()
        cfg = TrainConfig(strategy="single", batch_size=64, steps=2, shard_optimizer=flag)
        engine, _ = engine_for(model, UserData(Examples(x, y)), cfg, 1)(world)
        for step in range(2):
            engine.step(np.arange(64 * step, 64 * (step + 1)))
        trained.append([v.numpy() for v in model.weights])
    assert all(np.array_equal(a, b) for a, b in zip(*trained, strict=True))


def test_flags_that_do_not_go_with_a_sharded_optimizer_are_refused_before_tensorflow(
    before_tensorflow,
):
    for args, needle in [
        (["--loop", "fit"], "--shard-optimizer needs --loop custom"),
    ]:
        said_once(before_tensorflow("train", "--shard-optimizer", *args), EXIT_USAGE, needle)


def test_what_a_slice_cannot_compute_as_keras_does_is_refused():
    """The compiled optimizer's options that need a variable's identity or more than its
    elements, a non-elementwise optimizer and weights outside float32, in one line each."""
    import keras

    from ringtrain.dataparallel.sharded import check_shardable
    from ringtrain.errors import UserError

    weights = [keras.Variable(np.zeros(3, np.float32), name="w")]
    decayed = keras.optimizers.AdamW(weight_decay=0.1)
    decayed.exclude_from_weight_decay(var_names=["bias"])
    for optimizer, needle in [
        (decayed, "AdamW's exclude_from_weight_decay"),
        (keras.optimizers.SGD(use_ema=True), "SGD's use_ema"),
        (keras.optimizers.Adam(gradient_accumulation_steps=2), "gradient_accumulation_steps"),
        (keras.optimizers.Lamb(), "the compiled Lamb is not one of them"),
        (keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), "LossScaleOptimizer"),
    ]:
        with pytest.raises(UserError, match=needle):
            check_shardable(optimizer, weights)
    half = [keras.Variable(np.zeros(3, np.float16), name="h")]
    with pytest.raises(UserError, match="float32 weights"):
        check_shardable(keras.optimizers.SGD(), half)


@pytest.mark.parametrize(
    "name", ["SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Nadam", "Lion"]
)
def test_each_optimizer_updates_a_run_of_the_variables_as_it_updates_them_all(name):
    """The premise, per optimizer --shard-optimizer takes: its clone over a rank's run of the
    variables makes the updates it makes to them among all of them, and each of the clone's
    slots is the one OptimizerLayout places in the whole optimizer (a checkpoint's layout)."""
    import keras

    from ringtrain.dataparallel.sharded import ELEMENTWISE, OptimizerLayout, clone_optimizer

    assert name in {kind.__name__ for kind in ELEMENTWISE}
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (5,), (2, 1, 2)]
    start = [rng.normal(size=shape).astype(np.float32) for shape in shapes]
    compiled = getattr(keras.optimizers, name)(learning_rate=0.01)
    variables = [keras.Variable(x) for x in start]
    run = [keras.Variable(x) for x in start[1:]]  # a second rank's run
    clone = clone_optimizer(compiled)
    for _ in range(3):
        grads = [rng.normal(size=shape).astype(np.float32) for shape in shapes]
        compiled.apply_gradients(zip(grads, variables, strict=True))
        clone.apply_gradients(zip(grads[1:], run, strict=True))
    for mine, whole in zip(run, variables[1:], strict=True):
        np.testing.assert_allclose(mine.numpy(), whole.numpy(), rtol=1e-6, atol=1e-7)
    whole_layout, run_layout = OptimizerLayout(compiled, 3), OptimizerLayout(clone, 2)
    placed = {where[1:]: p for p, where in enumerate(whole_layout.positions) if where[0] == "slot"}
    for position, where in enumerate(run_layout.positions):
        if where[0] == "slot":
            _, kind, i = where
            kept = compiled.variables[placed[(kind, i + 1)]].numpy()
            np.testing.assert_allclose(clone.variables[position].numpy(), kept, rtol=1e-6)


def test_ranks_own_runs_of_whole_variables_of_about_equal_size():
    """Every variable is one rank's, in the model's order; every rank has one while there are
    enough; a collective's share of every slice is padded to the longest."""
    from ringtrain.dataparallel.sharded import FlatLayout

    layout = FlatLayout([(64, 128), (128,), (128, 128), (128,), (128, 64), (64,), (64, 10)], 2)
    assert [list(layout.owned(r)) for r in range(2)] == [[0, 1, 2], [3, 4, 5, 6]]
    assert layout.shard == 8192 + 128 + 128 * 128
    seen = []
    for r in range(2):
        for lo, hi in layout.chunks(3000):
            pieces = layout.pieces(r, lo, hi)
            assert sum(b - a for _, a, b in pieces) + layout.padding(r, lo, hi) == hi - lo
            seen += [(i, a, b) for i, a, b in pieces]
    for i, size in enumerate(layout.sizes):
        mine = sorted((a, b) for j, a, b in seen if j == i)
        assert mine[0][0] == 0 and mine[-1][1] == size
        assert all(b == a2 for (_, b), (a2, _) in zip(mine, mine[1:], strict=False))
    many = FlatLayout([(1000,), (1,), (1,), (1,)], 4)
    assert [len(many.owned(r)) for r in range(4)] == [1, 1, 1, 1]
    few = FlatLayout([(10,), (10,)], 3)
    assert sorted(len(few.owned(r)) for r in range(3)) == [0, 1, 1]


EMBEDDED = """
import keras

def build():
    model = keras.Sequential([
        keras.Input((4,), dtype="int32"),
        keras.layers.Embedding(10, 3, name="embed"),
        keras.layers.Flatten(),
        keras.layers.Dense(2, name="head"),
    ])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model

def data():
    import numpy as np
    return np.arange(64 * 4).reshape(64, 4) % 10, np.arange(64) % 2
"""


@pytest.mark.mpi
def test_an_embeddings_sparse_gradient_is_refused_in_one_line_on_two_ranks(tmp_path):
    """Keras's optimizers update an embedding's looked-up rows from its sparse gradient, which
    the same gradient made dense does not reproduce (BERT's embeddings moved otherwise)."""
    model = tmp_path / "embedded.py"
    model.write_text(EMBEDDED)
    done = train_under_mpirun(
        "--model", f"{model}:build", "--data", f"{model}:data", "--steps", "1", "--shard-optimizer"
    )
    said_once(done, EXIT_USAGE, "embed/embeddings gets sparse ones")


WIDE = """
import keras
import numpy as np

WIDTH, LAYERS = 2048, 8  # 8 kernels of 16 MiB: Adam's slots are 256 MiB


def build():
    model = keras.Sequential(
        [keras.Input((WIDTH,))]
        + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(LAYERS)]
        + [keras.layers.Dense(10)]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss=loss)
    return model


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, WIDTH)).astype(np.float32), rng.integers(0, 10, 64)
"""


@pytest.mark.mpi
def test_two_replicas_each_save_most_of_half_of_adams_slots(tmp_path):
    """Adam's slots for 33.6M weights (256 MiB) on 2 ranks: with --shard-optimizer the fullest
    rank's VmHWM is lower by at least 80% of the half of them it no longer keeps."""
    model = tmp_path / "wide.py"
    model.write_text(WIDE)
    peaks = {}
    for flags in ([], ["--shard-optimizer"]):
        metrics = tmp_path / f"metrics{len(flags)}.json"
        cmd = [str(BIN / "ringtrain"), "train", "--model", f"{model}:build", "--strategy", "data"]
        cmd += ["--data", f"{model}:data", "--batch-size", "8", "--steps", "3"]
        done = run([*MPIRUN, "2", *cmd, *flags, "--metrics-out", str(metrics)], timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        peaks[bool(flags)] = json.loads(metrics.read_text())["peak_resident_bytes"]
    slot_bytes = 2 * 4 * (8 * (2048 * 2048 + 2048) + 2048 * 10 + 10)
    saved = peaks[False] - peaks[True]
    print(f"VmHWM {peaks[False] / 2**20:.1f} -> {peaks[True] / 2**20:.1f} MiB")
    assert saved >= 0.8 * (1 - 1 / 2) * slot_bytes, (saved, slot_bytes)
