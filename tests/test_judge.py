"""The judge is shown to fail. A test that only ever sees the judge pass proves nothing, so
here the reference itself trains the mistakes a distributed run could make, with no hook in
ringtrain, and the judge (reference.compare_updates, at the bound every exactness test uses)
must reject each one and accept a faithful rerun. Like the reference, it imports nothing from
ringtrain: the initial weights come from one `ringtrain train --initial-weights-out` run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import ringtrain
from reference import (
    UPDATE_ATOL,
    UPDATE_RTOL,
    compare_updates,
    global_batches,
    load_digits,
    train_reference,
)

# Plain SGD, whose update scales with the gradient; 2 ranks of 24 examples, 4 microbatches of 12.
RUN = {"model": "mlp", "optimizer": "sgd", "lr": 0.1, "batch_size": 48, "steps": 4, "seed": 1}
RANKS, MICROBATCHES = 2, 4


@pytest.fixture(scope="module")
def initial(tmp_path_factory) -> Path:
    """The weights ringtrain starts this model from at this seed (one step is enough to say)."""
    path = tmp_path_factory.mktemp("judge") / "initial.npz"
    flags = ["--model", RUN["model"], "--seed", str(RUN["seed"]), "--steps", "1"]
    done = ringtrain("train", "--strategy", "single", *flags, "--initial-weights-out", str(path))
    assert done.returncode == 0, done.stderr[-2000:]
    return path


@pytest.fixture(scope="module")
def train(initial):
    """The reference from those weights, with RUN's settings changed by keyword."""
    return lambda **changes: train_reference(load_digits(), initial, **{**RUN, **changes})


@pytest.fixture(scope="module")
def right(train):
    return train()


def doubled_gradients(train):
    """Gradients summed over 2 ranks where they should be averaged: under SGD, twice the step."""
    return train(lr=2 * RUN["lr"]).final


def one_microbatch_dropped(train):
    """The last microbatch of every step never reaches the accumulated gradient, which is
    still divided by all M."""
    counted = np.ones(RUN["batch_size"], np.float32)
    counted[-RUN["batch_size"] // MICROBATCHES :] = 0.0
    return train(counted=counted).final


def one_shard_twice(train):
    """Rank 1 reads rank 0's shard: the global batch holds its first half twice."""
    half = RUN["batch_size"] // RANKS
    order = global_batches(len(load_digits().x), RUN["batch_size"], RUN["seed"], RUN["steps"])
    return train(batches=[np.concatenate([b[:half], b[:half]]) for b in order]).final


def one_stale_weight(train):
    """One tensor missed its last update, as a replica that kept its own copy would."""
    before_last = train(steps=RUN["steps"] - 1).final
    final = dict(train().final)
    stale = sorted(final)[0]
    final[stale] = before_last[stale]
    return final


@pytest.mark.parametrize(
    "wrong", [doubled_gradients, one_microbatch_dropped, one_shard_twice, one_stale_weight]
)
def test_the_judge_rejects_a_wrong_update(train, right, wrong):
    verdict = compare_updates(right.initial, wrong(train), right.final, UPDATE_RTOL, UPDATE_ATOL)
    assert not verdict.passed, verdict
    assert verdict.worst_ratio > 10, verdict  # far outside the bound, not at its edge


def test_the_judge_accepts_a_faithful_rerun(train, right):
    again = train()
    verdict = compare_updates(right.initial, again.final, right.final, UPDATE_RTOL, UPDATE_ATOL)
    assert verdict.passed, verdict
    assert again.losses == right.losses
