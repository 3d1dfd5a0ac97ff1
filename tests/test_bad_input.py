"""Every bad input: one line naming the problem, a non-zero exit, no traceback, no hang."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import one_line_error, ringtrain


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "resnet9000"], "unknown model 'resnet9000'"),
        (["--optimizer", "lamb"], "unknown optimizer 'lamb'"),
        (["--strategy", "magic"], "unknown strategy 'magic'"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--lr", "-0.1"], "--lr must be positive"),
        (["--steps", "many"], "expected a whole number"),
        (["--epochs", "1", "--steps", "2"], "not allowed with argument"),
        (["--metrics-out", "/nonexistent-dir/m.json"], "does not exist"),
        (["--metrics-out", "/proc/m.json"], "not writable"),
        (["--dataset", "npz:/nonexistent.npz"], "does not exist"),
        (["--dataset", "imagenet"], "unknown dataset"),
        (["--strategy", "pipeline", "--microbatches", "0"], "--microbatches must be at least 1"),
        (
            ["--strategy", "pipeline", "--microbatches", "5", "--batch-size", "64"],
            "not divisible by --microbatches 5",
        ),
        (["--strategy", "pipeline", "--schedule", "zigzag"], "unknown schedule 'zigzag'"),
        (["--strategy", "pipeline", "--partition", "random"], "unknown partition 'random'"),
        (["--strategy", "hybrid"], "needs --pp-size"),
        (["--loop", "fit", "--accumulate", "2"], "--accumulate needs --loop custom"),
        (["--synthetic-shape", "3x3"], "--synthetic-shape"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_train_flags_exit_with_one_line(args, needle):
    one_line_error(ringtrain("train", *args, timeout=120), needle)


def test_malformed_npz_dataset_is_rejected(tmp_path):
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"this is not a zip file")
    one_line_error(
        ringtrain("train", "--dataset", f"npz:{garbage}", "--steps", "1"), "not a readable .npz"
    )
    lacking = tmp_path / "lacking.npz"
    np.savez(lacking, x=np.zeros((4, 2)))
    one_line_error(
        ringtrain("train", "--dataset", f"npz:{lacking}", "--steps", "1"), "lacks array(s) y"
    )


def test_bad_input_leaves_existing_outputs_untouched(tmp_path):
    metrics = tmp_path / "m.json"
    metrics.write_text("precious")
    one_line_error(ringtrain("train", "--lr", "0", "--metrics-out", str(metrics)), "--lr")
    assert metrics.read_text() == "precious"


def test_help_lists_every_subcommand_with_its_purpose():
    done = ringtrain("--help")
    assert done.returncode == 0
    for command in ("train", "schedule", "doctor", "hostfile", "slurm"):
        assert command in done.stdout
