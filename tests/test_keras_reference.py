"""The Keras `fit` reference (tests/reference.py) on the user-model zoo (tests/user_models.py),
in one process: it is deterministic, its judge tells a wrong run from a right one, a saved
.keras file is matched to it by weight path, and its microbatch variant means what it says."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import user_models
from reference import KerasFit, compare_updates, keras_fit_updates, saved_model_updates

BATCH, STEPS, SEED = 32, 3, 11

ZOO = {
    "residual_cnn": (user_models.residual_cnn, user_models.digits, {}),
    "residual_cnn_nesterov": (
        user_models.residual_cnn,
        user_models.digits,
        {"optimizer": "nesterov"},
    ),
    "bn_cnn": (user_models.bn_cnn, user_models.digits, {}),
    "frozen_finetune": (user_models.frozen_finetune, user_models.digits, {}),
    "regression_mlp": (user_models.regression_mlp, user_models.regression_data, {}),
    "bert_classifier": (user_models.bert_classifier, user_models.bert_data, {}),
}


def fit(name: str, steps: int = STEPS, microbatches: int = 1) -> KerasFit:
    if name == "bert_classifier":
        pytest.importorskip("keras_hub")  # installed by scripts/setup.sh (requirements-nodeps.txt)
    build, data, build_args = ZOO[name]
    x, y = data()
    return keras_fit_updates(build, x, y, BATCH, steps, SEED, microbatches, **build_args)


fitted = functools.cache(fit)  # one run per configuration, shared by the tests below


def moved(run: KerasFit) -> set[str]:
    return {p for p in run.initial if not np.array_equal(run.initial[p], run.final[p])}


@pytest.mark.parametrize("name", ZOO)
def test_a_reference_run_is_deterministic(name):
    """Same seed, same weights to the bit, before and after; and every trainable weight moved
    (a frozen one did not)."""
    first, second = fitted(name), fit(name)
    assert first.final.keys() == second.final.keys()
    for path in first.final:
        assert np.array_equal(first.initial[path], second.initial[path]), path
        assert np.array_equal(first.final[path], second.final[path]), path
    trainable = {v.path for v in first.model.trainable_weights}
    assert trainable and trainable <= moved(first)
    if name == "frozen_finetune":
        frozen = {v.path for v in first.model.non_trainable_weights}
        assert frozen and not frozen & moved(first)


def test_the_judge_rejects_a_run_one_step_short():
    reference, short = fitted("residual_cnn"), fitted("residual_cnn", STEPS - 1)
    assert compare_updates(reference.initial, reference.final, reference.final).worst_ratio == 0
    verdict = compare_updates(reference.initial, short.final, reference.final)
    assert not verdict.passed and verdict.worst_ratio > 100


def test_a_saved_model_is_matched_by_path_and_judged(tmp_path):
    saved = tmp_path / "run.keras"
    fitted("residual_cnn").model.save(saved)
    right = saved_model_updates(saved, fitted("residual_cnn"))
    assert right.ok and right.update.worst_ratio == 0, right.describe()
    wrong = saved_model_updates(saved, fitted("residual_cnn", STEPS - 1))
    assert not wrong.ok and "beyond" in wrong.describe()
    other = saved_model_updates(saved, fitted("bn_cnn"))
    assert not other.ok and "missing weights" in other.describe()


def test_microbatches_change_only_what_sees_the_batch():
    """Keras's gradient accumulation over 2 half batches steps as one batch does (float
    rounding aside), except where a forward pass's batch shows: BatchNormalization."""
    plain = fitted("residual_cnn")
    halves = fitted("residual_cnn", microbatches=2)
    verdict = compare_updates(plain.initial, halves.final, plain.final)
    assert verdict.passed, verdict
    bn, bn_halves = fitted("bn_cnn"), fitted("bn_cnn", microbatches=2)
    assert {v.path for v in bn_halves.model.trainable_weights} <= moved(bn_halves)
    assert not compare_updates(bn.initial, bn_halves.final, bn.final).passed


def test_a_microbatch_split_must_divide_the_batch():
    with pytest.raises(ValueError, match="does not split into 3"):
        fit("bn_cnn", microbatches=3)


def test_bert_classifier_trains_and_reloads_under_fit(tmp_path):
    run = fitted("bert_classifier")
    assert all(np.isfinite(w).all() for w in run.final.values())
    saved = tmp_path / "bert.keras"
    run.model.save(saved)
    check = saved_model_updates(saved, run)
    assert check.ok and check.update.worst_ratio == 0, check.describe()
