"""`ringtrain bench too-big`'s arithmetic and verdicts, without its 4-node cluster: the weight
count it reports for BERT-large is Keras's own count of the example's model at any shape, and
each claim it checks is read from what ran."""

from __future__ import annotations

import importlib.util

from conftest import ROOT

from ringtrain.bench.too_big import (
    BATCH,
    TOKENS,
    _predicted,
    _predicted_by_rank,
    checks,
    encoder_weights,
)


def test_the_encoder_s_weight_count_is_keras_s_count_of_the_example():
    spec = importlib.util.spec_from_file_location("bert", ROOT / "examples" / "bert_classifier.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    shape = {"layers": 3, "hidden": 32, "heads": 2, "intermediate": 48}
    model = example.build(**shape, vocabulary=500)
    assert example.TOKENS == TOKENS
    assert encoder_weights(shape, 500, TOKENS) == model.count_params()
    (x, y) = example.data(n=BATCH, vocabulary=500)
    assert len(y) == BATCH and x["token_ids"].max() < 500


def run_row(name: str, code: int, error: str | None = None, killed: bool = False, losses=None):
    return {"name": name, "exit_code": code, "error": error, "killed_by_cap": killed} | (
        {"losses": losses} if losses else {}
    )


def test_each_claim_is_read_from_what_ran():
    refused = "error: predicted 5.48 GiB per rank, over the 3.00 GiB limit"
    rows = [
        run_row("single", 2, refused),
        run_row("single, forced", 137, killed=True),
        run_row("data", 2, refused),
        run_row("data, forced", 137, killed=True),
        run_row("pipeline 1f1b", 0, losses=[0.8, 0.7, 0.5, 0.3]),
    ]
    assert all(checks(rows).values())
    rows[3] = run_row("data, forced", 1, "error: rank 2 stopped")  # failed, but not by the cap
    rows[4] = run_row("pipeline 1f1b", 0, losses=[0.7, 0.7, 0.8, 0.9])
    held = checks(rows)
    assert not held["single and data killed by the caps when forced"]
    assert not held["its loss falls"]
    assert held["single and data refused by the memory check"] and held["the pipeline trains"]


def test_the_predictions_are_read_from_what_rank_0_said():
    fits = (
        "memory: predicted 2.30 GiB per rank (by pipeline rank: 2.30 GiB, 2.24 GiB, 2.24 GiB, "
        "1.98 GiB), within its limit of 3.00 GiB (cgroup)"
    )
    assert _predicted(fits) == 2.30 * 2**30
    assert _predicted_by_rank(fits) == [g * 2**30 for g in (2.30, 2.24, 2.24, 1.98)]
    refused = "error: predicted 732.9 MiB per rank (largest: optimizer state 198.1 MiB) but"
    assert _predicted(refused) == 732.9 * 2**20 and _predicted_by_rank(refused) == []
