"""The memory check: a rank's limit read from --memory-per-rank, its memory cgroup or Slurm;
its peak predicted with plan's arithmetic from the model `train` builds; a run predicted not
to fit refused in one line, once, naming its largest consumer and a configuration that fits,
before the kernel's limit kills it; --ignore-memory-check runs it anyway."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import BIN, load_npz, ringtrain, run
from test_bad_input import said_once, train_under_mpirun
from test_plan import _calibration_file

from ringtrain.config import TrainConfig
from ringtrain.errors import EXIT_USAGE
from ringtrain.memory_check import (
    BASELINE_BYTES,
    STEP_GRAPH_BYTES,
    ModelFacts,
    Unit,
    fitting,
    rank_peak,
    rank_peaks,
)
from ringtrain.memory_limit import Limit, cgroup_limit, memory_group, rank_limit, slurm_limit
from ringtrain.plan.costmodel import model_bytes

MIB = 2**20
# An MLP whose Adam state outweighs its activations: about 26M weights (99 MiB). Predicted
# 733 MiB in one process, and 634 MiB per rank as a 2-stage pipeline.
WIDE_MODEL = """
import keras


def wide(units: int = 3584):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8, 8, 1)), keras.layers.Flatten()]
        + [keras.layers.Dense(units, activation="relu") for _ in range(3)]
        + [keras.layers.Dense(10)]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer="adam", loss=loss)
    return model
"""
LIMIT = "700M"


@pytest.fixture
def wide(tmp_path) -> list[str]:
    path = tmp_path / "wide.py"
    path.write_text(WIDE_MODEL)
    return ["--model", f"{path}:wide", "--steps", "2", "--progress", "none"]


# ---- where the limit comes from -------------------------------------------------------------


V1, V2 = "memory.limit_in_bytes", "memory.max"


def _group(folder: Path, name: str, limit: str) -> Path:
    """A fake cgroup folder with its limit file."""
    folder.mkdir(parents=True)
    (folder / "cgroup.procs").write_text("")
    (folder / name).write_text(limit)
    return folder


def test_a_v1_cgroup_limit_is_the_tightest_of_the_group_and_those_above_it(tmp_path):
    _group(tmp_path / "memory", V1, "9223372036854771712")  # v1's "no limit"
    _group(tmp_path / "memory" / "job", V1, str(3 * 2**30))
    _group(tmp_path / "memory" / "job" / "step", V1, "9223372036854771712")
    text = "5:cpu:/\n4:memory:/job/step\n0::/\n"
    group, version = memory_group(text, tmp_path)
    assert (group, version) == (tmp_path / "memory" / "job" / "step", "v1")
    assert cgroup_limit(group, version, tmp_path) == 3 * 2**30


def test_a_v2_cgroup_says_max_for_no_limit(tmp_path):
    _group(tmp_path / "user", V2, str(2 * 2**30))
    _group(tmp_path / "user" / "app", V2, "max")
    _group(tmp_path / "other", V2, "max")
    group, version = memory_group("0::/user/app\n", tmp_path)
    assert (group, version) == (tmp_path / "user" / "app", "v2")
    assert cgroup_limit(group, version, tmp_path) == 2 * 2**30
    assert cgroup_limit(tmp_path / "other", "v2", tmp_path) is None


def test_no_memory_controller_no_limit(tmp_path):
    assert memory_group("4:memory:/gone\n0::/gone\n", tmp_path) is None


def test_slurm_memory_is_shared_among_the_node_tasks_or_given_per_cpu():
    assert slurm_limit({"SLURM_MEM_PER_NODE": "4096"}, 2) == 2048 * MIB
    per_cpu = {"SLURM_MEM_PER_CPU": "1000", "SLURM_CPUS_PER_TASK": "2"}
    assert slurm_limit(per_cpu, 4) == 2000 * MIB
    assert slurm_limit({"SLURM_JOB_ID": "7"}, 1) is None


def test_the_flag_comes_before_what_the_machine_says():
    env = {"SLURM_MEM_PER_NODE": "4096"}
    assert rank_limit(5 * MIB, 2, env) == Limit(5 * MIB, "--memory-per-rank")


# ---- the arithmetic -------------------------------------------------------------------------

# Two units of 1M words each, 100 words per example made in each, 10 crossing into each.
FACTS = ModelFacts(
    weights=2e6,
    trainable=2e6,
    largest=1e6,
    variables=2,
    slots=2.0,
    activations=10 + 200,
    units=[Unit(1e6, 1e6, 1e6, 1, 10, 100), Unit(1e6, 1e6, 1e6, 1, 10, 100)],
    split=None,
    input_bytes=1000,
)


def test_the_shared_arithmetic_counts_each_consumer_and_shards_optimizer_state():
    assert model_bytes(100, 50, 2, 30) == {
        "weights": 400,
        "gradients": 200,
        "optimizer state": 400,
        "activations in flight": 120,
    }
    # a quarter of the 2 slots: the variables the rank updates
    assert model_bytes(100, 50, 2, 30, shards=4)["optimizer state"] == 100


def test_one_process_holds_the_whole_model_and_its_batch():
    cfg = TrainConfig(strategy="single", batch_size=64)
    need = rank_peak(FACTS, cfg, 1)
    assert need["weights"] == need["gradients"] == 8e6 and need["optimizer state"] == 16e6
    assert need["activations in flight"] == 210 * 4 * 64
    assert need["weights gathered at the end"] == 8e6 and need["gradient averaging"] == 0
    # two of the largest weight, and the compiled step's graph for Adam's 2 variables
    assert need["step temporaries"] == 8e6 + 2 * STEP_GRAPH_BYTES * 5
    assert need["baseline"] == BASELINE_BYTES and need["input buffers"] == 1000


def test_replicas_average_and_may_shard_the_optimizer_state():
    plain = rank_peak(FACTS, TrainConfig(strategy="data", batch_size=64), 2)
    assert plain["activations in flight"] == 210 * 4 * 32
    # Horovod's outputs and the averaged step's (2.5 copies, as measured) and fusion buffer
    assert plain["gradient averaging"] == 2.5 * 8e6 + 64 * MIB
    sharded = rank_peak(FACTS, TrainConfig(strategy="data", shard_optimizer=True), 2)
    assert sharded["optimizer state"] == plain["optimizer state"] / 2


def test_a_pipeline_stage_holds_its_share_and_its_microbatches_in_flight():
    cfg = TrainConfig(strategy="pipeline", schedule="1f1b", microbatches=4, batch_size=64)
    need = rank_peak(FACTS, cfg, 2)  # rank 0: stage 0, with 2 of 16 examples in flight
    assert need["weights"] == 4e6 and need["optimizer state"] == 8e6
    assert need["activations in flight"] == 1.5 * 110 * 4 * 16 * 2  # the executor's tape
    assert need["weights gathered at the end"] == 8e6  # rank 0 gathers every stage's
    # two of its largest weight, 1 + slots/2 copies of its weights, its variable's step graph
    assert need["step temporaries"] == 2 * 4e6 + (1 + 2 / 2) * 4e6 + STEP_GRAPH_BYTES * 5
    recomputed = rank_peak(FACTS, TrainConfig(**{**cfg.__dict__, "recompute": True}), 2)
    assert recomputed["activations in flight"] == 1.5 * (10 * 2 + 100) * 4 * 16
    # each pipeline rank is predicted (what a run that fits lists), the fullest is checked
    first, last = rank_peaks(FACTS, cfg, 2)
    assert first == need and last["weights gathered at the end"] == 0
    # in hybrid 2x2 with --shard-optimizer, a stage's two replicas share its slots
    grid = dict(strategy="hybrid", pp_size=2, shard_optimizer=True)
    shared = rank_peak(FACTS, TrainConfig(**{**cfg.__dict__, **grid}), 4)
    assert shared["optimizer state"] == need["optimizer state"] / 2
    assert last["activations in flight"] == 1.5 * 110 * 4 * 16  # one microbatch in flight


def test_what_fits_is_named_from_the_same_arithmetic():
    one = sum(rank_peak(FACTS, TrainConfig(strategy="single"), 1).values())
    pipeline = TrainConfig(strategy="pipeline", schedule="1f1b", microbatches=8)
    two = sum(rank_peak(FACTS, pipeline, 2).values())
    said = fitting(FACTS, TrainConfig(strategy="single"), 1, Limit(two, "cgroup"))
    assert said.startswith("fits: `--strategy pipeline --schedule 1f1b --microbatches 8` on 2")
    assert two < one
    said = fitting(FACTS, TrainConfig(strategy="single"), 1, Limit(BASELINE_BYTES, "cgroup"))
    assert said.startswith("a rank's baseline and input buffers alone take")


def test_a_graph_with_keras_ops_is_read_layer_by_layer():
    """keras-hub's BERT reads its pooled output by key: a GetItem op in the graph, which holds
    no weights and is skipped; every weight is counted once."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "examples"))
    import bert_classifier

    from ringtrain.data import Examples, UserData
    from ringtrain.memory_check import model_facts

    model = bert_classifier.build()
    facts = model_facts(model, UserData(Examples(*bert_classifier.data(n=64))), 8)
    words = sum(v.numpy().size for v in model.weights)
    assert facts.weights == sum(u.weights for u in facts.units) == words


# ---- real runs ------------------------------------------------------------------------------


def test_a_run_predicted_over_its_memory_is_refused_in_one_line_and_forced_it_trains(wide):
    refused = ringtrain("train", "--strategy", "single", *wide, "--memory-per-rank", LIMIT)
    said_once(refused, EXIT_USAGE, "(largest: optimizer state ")
    line = refused.stderr.strip()
    assert "but the limit is 700.0 MiB (--memory-per-rank)" in line
    assert "fits: `--strategy pipeline --schedule 1f1b --microbatches " in line
    assert "--ignore-memory-check runs it anyway" in line
    small = ["--model-arg", "units=64"]  # forced, it trains: a narrow one, to be quick
    flags = ["--strategy", "single", *wide, *small, "--memory-per-rank", "1M"]
    forced = ringtrain("train", *flags, "--ignore-memory-check")
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert "--ignore-memory-check: memory per rank is not checked" in forced.stderr + forced.stdout


@pytest.mark.parametrize("strategy, ranks", [("single", None), ("data", 2)])
def test_a_run_the_check_lets_through_trains_as_without_a_limit(wide, tmp_path, strategy, ranks):
    """Under a limit the model is built without its weights' values and checked first, then
    made whole: its initial and trained weights are those of a run with no limit, bit for
    bit (a user's model with Adam, whose optimizer's variables wait for their values too)."""
    weights = {}
    for limited in (False, True):
        flags = ["--strategy", strategy, *wide, "--model-arg", "units=64"]
        flags += ["--memory-per-rank", "20G"] if limited else []
        out, initial = tmp_path / f"{limited}.npz", tmp_path / f"{limited}-initial.npz"
        paths = ["--weights-out", str(out), "--initial-weights-out", str(initial)]
        done = ringtrain("train", *flags, *paths, ranks=ranks)
        assert done.returncode == 0, done.stderr[-2000:]
        assert ("within its limit of 20.00 GiB" in done.stdout + done.stderr) == limited
        weights[limited] = (load_npz(initial), load_npz(out))
    for unlimited, limited in zip(weights[False], weights[True], strict=True):
        assert unlimited.keys() == limited.keys()
        for name, value in unlimited.items():
            np.testing.assert_array_equal(limited[name], value, err_msg=name)


def test_every_rank_refuses_alike_and_rank_0_says_it_once(wide):
    done = train_under_mpirun("--strategy", "data", *wide, "--memory-per-rank", LIMIT)
    said_once(done, EXIT_USAGE, "(largest: optimizer state ")
    assert "fits: `--strategy pipeline --schedule 1f1b --microbatches " in done.stderr


def test_a_memory_cgroup_limit_refuses_without_the_flag_and_plan_reads_it_alike(wide, tmp_path):
    """The process runs inside a child memory cgroup capped at LIMIT, as a Slurm job or a
    rehearsal node of `cluster up --mem-per-node` would: the check reads the cap itself, and
    `plan` shares it among --ranks-per-node."""
    from ringtrain.cluster.memory import join, memory_parent, remove, set_limit

    folder = memory_parent("this test")[0] / f"ringtrain-memory-check-{os.getpid()}"
    folder.mkdir()
    try:
        group = folder / "node"
        group.mkdir()
        set_limit(group, 700 * MIB)
        cli = [str(BIN / "ringtrain"), "train", "--strategy", "single", *wide]
        done = run([*join(group), *cli])
        # Its weights alone (539 MiB) do not fit beside a rank's baseline: built whole before
        # the check, the cap killed it (exit 137); it is refused before its weights are made.
        bigger = run([*join(group), *cli, "--model-arg", "units=8192"])
        calibration = ["--calibration", str(_calibration_file(tmp_path)), "--optimizer", "sgd"]
        cli = [str(BIN / "ringtrain"), "plan", *calibration, "--ranks-per-node", "2"]
        planned = run([*join(group), *cli])
    finally:
        remove(folder)
    said_once(done, EXIT_USAGE, "but the limit is 700.0 MiB (cgroup)")
    said_once(bigger, EXIT_USAGE, "but the limit is 700.0 MiB (cgroup)")
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "memory per rank: 350 MiB (cgroup)" in planned.stdout


def test_a_rank_the_memory_limit_kills_is_named_in_one_line(wide):
    """Two data-parallel ranks forced past their memory cgroup's cap (--ignore-memory-check):
    the kernel kills one with SIGKILL, which no handler sees, and its supervising parent names
    it, its host and the cap in one line; the job ends with it."""
    from ringtrain.cluster.memory import create, join, memory_parent, remove

    folder = memory_parent("this test")[0] / f"ringtrain-memory-kill-{os.getpid()}"
    folder.mkdir()
    try:
        create([folder / "node"], KILLING_CAP_MIB * MIB)
        flags = ["--strategy", "data", *wide, "--ignore-memory-check"]
        mpirun = ["mpirun", "--oversubscribe", "-np", "2", str(BIN / "ringtrain"), "train"]
        done = run([*join(folder / "node"), *mpirun, *flags], timeout=300)
    finally:
        remove(folder)
    print(done.stderr[-3000:])
    assert done.returncode != 0 and "Traceback" not in done.stderr
    killed = rf"rank [01] on \S+ was killed by the node's memory limit \({KILLING_CAP_MIB} MiB\)"
    assert len(re.findall(killed, done.stderr)) == 1, done.stderr[-3000:]


KILLING_CAP_MIB = 1400  # two ranks' baselines fit; their Adam states, gradients and weights not
