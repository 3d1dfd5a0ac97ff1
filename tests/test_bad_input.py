"""Every bad input: one line naming the problem, a non-zero exit, no traceback, no hang."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import BIN, ENV, ROOT, one_line_error, ringtrain


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


CHECKPOINT_RUN = ["--strategy", "single", "--model", "mlp", "--steps", "4"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real, complete checkpoint at step 2 of a 4-step single-process run."""
    folder = tmp_path_factory.mktemp("ckpt") / "run"
    done = ringtrain("train", *CHECKPOINT_RUN, "--checkpoint-dir", str(folder), "--stop-after", "2")
    assert done.returncode == 75, done.stderr[-2000:]
    return folder


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _truncate(step: Path) -> None:
    part = step / "model.npz"
    part.write_bytes(part.read_bytes()[:100])


def _flip_bytes(step: Path) -> None:
    part = step / "model.npz"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))


def _drop_part(step: Path) -> None:
    (step / "model.npz").unlink()


def _garble_manifest(step: Path) -> None:
    (step / "manifest.json").write_text("{ not json")


@pytest.mark.parametrize(
    "damage,needle",
    [
        (_truncate, "part model is corrupted (checksum mismatch)"),
        (_flip_bytes, "part model is corrupted (checksum mismatch)"),
        (_drop_part, "manifest names part model, which is missing"),
        (_garble_manifest, "unreadable manifest"),
    ],
)
def test_damaged_checkpoints_are_refused_and_left_as_they_are(tmp_path, checkpoint, damage, needle):
    folder = tmp_path / "run"
    shutil.copytree(checkpoint, folder)
    damage(folder / "step-00000002")
    before = _snapshot(folder)
    done = ringtrain("train", *CHECKPOINT_RUN, "--checkpoint-dir", str(folder), "--resume")
    one_line_error(done, needle)
    assert _snapshot(folder) == before


def test_a_checkpoint_from_another_model_is_refused(tmp_path, checkpoint):
    folder = tmp_path / "run"
    shutil.copytree(checkpoint, folder)
    done = ringtrain(
        "train",
        *CHECKPOINT_RUN[:-4],
        "--model",
        "cnn",
        "--steps",
        "4",
        "--checkpoint-dir",
        str(folder),
        "--resume",
    )
    one_line_error(done, "model is 'mlp' there and 'cnn' here")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--checkpoint-dir", "/proc/ringtrain-ckpt"], "not writable"),
        (["--checkpoint-dir", "/etc/hostname"], "is a file, not a folder"),
        (["--checkpoint-dir", "/tmp/x", "--keep", "0"], "--keep must be at least 1"),
        (["--checkpoint-dir", "/tmp/x", "--loop", "fit"], "needs --loop custom"),
    ],
)
def test_bad_checkpoint_flags(args, needle):
    one_line_error(ringtrain("train", *args, timeout=120), needle)


def test_a_hostfile_with_garbage_names_every_bad_line(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node01 slots=4\n%%% garbage\nnode02 slots=0\nnode01 slots=2\n")
    done = ringtrain("hostfile", "check", str(hostfile))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "line 2:" in done.stdout and "line 3:" in done.stdout and "line 4:" in done.stdout


def test_mpi_not_found_is_said_in_one_line():
    done = subprocess.run(
        [str(BIN / "ringtrain"), "train", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**ENV, "PATH": str(BIN)},
    )
    one_line_error(done, "MPI not found: mpirun is not on PATH")


@pytest.mark.mpi
def test_more_stages_than_layers_is_refused_on_every_rank():
    done = ringtrain("train", "--strategy", "pipeline", "--steps", "1", ranks=5, timeout=120)
    one_line_error(done, "5 pipeline stages but model 'mlp' has only 4 layers")


@pytest.mark.mpi
def test_resuming_a_pipeline_checkpoint_with_another_world_size_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    first = ringtrain(
        "train",
        "--strategy",
        "pipeline",
        "--steps",
        "4",
        "--stop-after",
        "2",
        "--checkpoint-dir",
        str(folder),
        ranks=2,
    )
    assert first.returncode == 75, first.stderr[-2000:]
    before = _snapshot(folder)
    refused = ringtrain(
        "train",
        "--strategy",
        "pipeline",
        "--steps",
        "4",
        "--resume",
        "--checkpoint-dir",
        str(folder),
        ranks=4,
    )
    one_line_error(refused, "does not fit this run: stages is 2 there and 4 here")
    assert _snapshot(folder) == before


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
