"""A pipeline rank never holds the whole model: `train` builds the model without its weights'
values, and each rank makes its own stages' only. Those start from exactly the values one
process gives (`keras.utils.set_random_seed(seed); build()`), weights the model function set
(as a fine-tuning run loads them) are kept on the stage that holds them, and building its part
adds under 60% of the whole model's weight bytes to each of two stage ranks' peak memory.
Nothing gathers the whole model on rank 0 unless an output needs it, and the memory check
counts that gather only then."""

from __future__ import annotations

import json
import sys

import numpy as np
from conftest import ROOT
from test_bad_input import said_once, train_under_mpirun

from ringtrain.errors import EXIT_USAGE

USER_MODELS = ROOT / "tests" / "user_models.py"
SEED = 7
# tall_mlp's 381 MiB of weights on 2 stages: predicted under the limit per rank, and over it on
# rank 0 when it gathers the whole model
LIMIT = "1.1G"


def tall_mlp_pipeline(*flags: str):
    cli = ["--strategy", "pipeline", "--partition", "params"]
    cli += ["--model", f"{USER_MODELS}:tall_mlp", "--model-arg", "fine_tuned=True"]
    cli += ["--data", f"{USER_MODELS}:digits_split", "--no-shuffle", "--batch-size", "16"]
    cli += ["--steps", "1", "--microbatches", "2", "--seed", str(SEED), "--progress", "none"]
    return train_under_mpirun(*cli, "--memory-per-rank", LIMIT, *flags)


def test_each_stage_rank_makes_only_its_own_weights_and_they_are_one_processs(tmp_path):
    """At learning rate 0 the one step's checkpoint, written by each stage, holds the
    initial weights."""
    metrics, folder = tmp_path / "metrics.json", tmp_path / "checkpoints"
    done = tall_mlp_pipeline(
        "--model-arg", "learning_rate=0.0", "--metrics-out", str(metrics),
        "--checkpoint-dir", str(folder),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    sys.path.insert(0, str(USER_MODELS.parent))
    import keras
    import user_models

    keras.utils.set_random_seed(SEED)
    model = user_models.tall_mlp(fine_tuned=True)
    made = {}
    for part in sorted((folder / "step-00000001").glob("stage*.npz")):
        with np.load(part) as stage:
            made |= {k.removeprefix("weights/"): stage[k] for k in stage.files if "weights/" in k}
    assert sorted(made) == sorted(v.path for v in model.weights)
    for v in model.weights:  # bit for bit: the same initialisers, seeds and set values
        assert np.array_equal(made[v.path], v.numpy()), v.path
    for name in ("hidden0", "logits"):  # set by the function, on stage 0 and on stage 1
        assert all(np.all(made[w.path] == 0.01) for w in model.get_layer(name).weights)

    whole = sum(v.numpy().nbytes for v in model.weights)  # 381 MiB
    added = json.loads(metrics.read_text())["model_resident_bytes"]
    assert len(added) == 2
    for rank, grew in enumerate(added):
        print(f"rank {rank}: +{grew / 2**20:.0f} MiB building its stage, {grew / whole:.0%}")
        assert 0 < grew < 0.6 * whole, (rank, grew, whole)


def test_an_output_that_needs_the_whole_model_on_rank_0_is_refused_where_it_cannot_fit(tmp_path):
    done = tall_mlp_pipeline("--save", str(tmp_path / "trained.keras"))
    said_once(done, EXIT_USAGE, "gather the whole model's weights (380.7 MiB) on rank 0")
    assert not (tmp_path / "trained.keras").exists()
