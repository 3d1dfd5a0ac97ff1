"""The judge is shown to fail. A test that only ever sees the judge pass proves nothing, so
here the reference itself trains the mistakes a distributed run could make, with no hook in
ringtrain, and the judge (reference.compare_updates, at the bound every exactness test uses)
must reject each one and accept a faithful rerun."""

from __future__ import annotations

import numpy as np
import pytest
from reference import UPDATE_ATOL, UPDATE_RTOL, compare_updates, global_batches, train_reference

from ringtrain.data import load_digits

# Plain SGD, whose update scales with the gradient; 2 ranks of 24 examples, 4 microbatches of 12.
RUN = {"model": "mlp", "optimizer": "sgd", "lr": 0.1, "batch_size": 48, "steps": 4, "seed": 1}
RANKS, MICROBATCHES = 2, 4


@pytest.fixture(scope="module")
def digits():
    return load_digits()


@pytest.fixture(scope="module")
def right(digits):
    return train_reference(digits, **RUN)


def order(digits) -> list[np.ndarray]:
    return global_batches(len(digits.x), RUN["batch_size"], RUN["seed"], RUN["steps"])


def doubled_gradients(digits):
    """Gradients summed over 2 ranks where they should be averaged: under SGD, twice the step."""
    return train_reference(digits, **{**RUN, "lr": 2 * RUN["lr"]}).final


def one_microbatch_dropped(digits):
    """The last microbatch of every step never reaches the accumulated gradient, which is
    still divided by all M."""
    counted = np.ones(RUN["batch_size"], np.float32)
    counted[-RUN["batch_size"] // MICROBATCHES :] = 0.0
    return train_reference(digits, **RUN, counted=counted).final


def one_shard_twice(digits):
    """Rank 1 reads rank 0's shard: the global batch holds its first half twice."""
    half = RUN["batch_size"] // RANKS
    twice = [np.concatenate([b[:half], b[:half]]) for b in order(digits)]
    return train_reference(digits, **RUN, batches=twice).final


def one_stale_weight(digits):
    """One tensor missed its last update, as a replica that kept its own copy would."""
    before_last = train_reference(digits, **{**RUN, "steps": RUN["steps"] - 1}).final
    final = dict(train_reference(digits, **RUN).final)
    stale = sorted(final)[0]
    final[stale] = before_last[stale]
    return final


@pytest.mark.parametrize(
    "wrong", [doubled_gradients, one_microbatch_dropped, one_shard_twice, one_stale_weight]
)
def test_the_judge_rejects_a_wrong_update(digits, right, wrong):
    verdict = compare_updates(right.initial, wrong(digits), right.final, UPDATE_RTOL, UPDATE_ATOL)
    assert not verdict.passed, verdict
    assert verdict.worst_ratio > 10, verdict  # far outside the bound, not at its edge


def test_the_judge_accepts_a_faithful_rerun(digits, right):
    again = train_reference(digits, **RUN)
    verdict = compare_updates(right.initial, again.final, right.final, UPDATE_RTOL, UPDATE_ATOL)
    assert verdict.passed, verdict
    assert again.losses == right.losses
