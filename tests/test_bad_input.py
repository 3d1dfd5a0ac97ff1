"""The README's error contract: every bad input on every subcommand ends with its exit code from
the table, exactly one `ringtrain <command>: error: ...` line on stderr and no traceback; a bad
input that needs no model (flags, datasets, checkpoints) is refused before TensorFlow loads;
under mpirun a problem every rank sees is said once, by rank 0; a diverging run stops on every
rank without saving the damage; the aborts (watchdog, silent peer) end the job with their codes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from conftest import BIN, ENV, OPEN_MPI_TEARDOWN, ROOT, ringtrain, run

from ringtrain.checkpoint import latest
from ringtrain.errors import (
    EXIT_CHECKPOINTED,
    EXIT_NON_FINITE,
    EXIT_PROBLEMS,
    EXIT_SILENT_PEER,
    EXIT_USAGE,
    EXIT_WATCHDOG,
)


def said_once(done: subprocess.CompletedProcess, code: int, needle: str, command="train"):
    """Exactly this exit code, one stderr line `ringtrain <command>: error: ...` naming the
    problem, and no traceback anywhere."""
    assert "Traceback" not in done.stderr + done.stdout
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == code, (done.returncode, lines[-5:])
    assert len(lines) == 1, lines
    assert lines[0].startswith(" ".join(["ringtrain", command]).strip() + ": error: "), lines
    assert needle in lines[0], lines


def mpirun(*argv: str, ranks: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """`mpirun -q`: Open MPI keeps its own banner about a failed job to itself, so stderr holds
    exactly what the ranks said."""
    return run(["mpirun", "-q", "--oversubscribe", "-np", str(ranks), *argv], timeout=timeout)


def train_under_mpirun(*args: str, ranks: int = 2, timeout: float = 300):
    train = (*OPEN_MPI_TEARDOWN, str(BIN / "ringtrain"), "train", *args)
    return mpirun(*train, ranks=ranks, timeout=timeout)


# ---- flags --------------------------------------------------------------------------------

BAD_TRAIN_FLAGS = [
    (["--model", "resnet9000"], "unknown model 'resnet9000'"),
    (["--optimizer", "lamb"], "unknown optimizer 'lamb'"),
    (["--strategy", "magic"], "unknown strategy 'magic'"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--lr", "-0.1"], "--lr must be positive"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--clip-norm", "inf"], "--clip-norm must be a finite number"),
    (["--warmup-epochs", "nan"], "--warmup-epochs must be a finite number"),
    (["--comm-timeout", "inf"], "--comm-timeout must be a finite number"),
    (["--seed", "-1"], "--seed must be a whole number from 0 to 4294967295, got -1"),
    (["--seed", str(2**32)], "--seed must be a whole number from 0 to 4294967295"),
    (["--steps", "many"], "expected a whole number"),
    (["--epochs", "1", "--steps", "2"], "not allowed with argument"),
    (["--metrics-out", "/nonexistent-dir/m.json"], "does not exist"),
    (["--metrics-out", "/proc/m.json"], "not writable"),
    (["--weights-out", "/tmp"], "--weights-out /tmp is a folder"),
    (["--initial-weights-out", "/tmp"], "--initial-weights-out /tmp is a folder"),
    (["--gantt", "/tmp/run.jpg"], "name it *.png"),
    (["--dataset", "npz:/nonexistent.npz"], "does not exist"),
    (["--dataset", "imagenet"], "unknown dataset"),
    (["--synthetic-size", "0"], "--synthetic-size must be at least 1"),
    (["--strategy", "pipeline", "--microbatches", "0"], "--microbatches must be at least 1"),
    (
        ["--strategy", "pipeline", "--microbatches", "65", "--batch-size", "64"],
        "global batch 64 is smaller than the 65 shares it is cut into",
    ),
    (["--strategy", "pipeline", "--schedule", "zigzag"], "unknown schedule 'zigzag'"),
    (["--mpi-progress", "sometimes"], "unknown mpi-progress 'sometimes'"),
    (["--strategy", "pipeline", "--partition", "random"], "unknown partition 'random'"),
    (["--strategy", "pipeline", "--virtual-stages", "0"], "--virtual-stages must be at least 1"),
    (
        ["--strategy", "pipeline", "--virtual-stages", "2"],
        "--virtual-stages 2 needs --schedule interleaved, not 1f1b",
    ),
    (
        ["--strategy", "pipeline", "--schedule", "interleaved", "--virtual-stages", "5"],
        "model 'mlp' has 4 block(s) between valid cuts, too few for 5 stages",
    ),
    (["--strategy", "pipeline", "--schedule", "/nonexistent.json"], "cannot read the schedule"),
    (["--recompute"], "--recompute is for pipeline stages, not --strategy data"),
    (
        ["--strategy", "hybrid", "--pp-size", "1", "--recompute"],
        "--recompute is for pipeline stages, not --strategy hybrid --pp-size 1",
    ),
    (
        ["--schedule", "interleaved", "--virtual-stages", "2"],
        "--virtual-stages is for pipeline stages, not --strategy data",
    ),
    (["--strategy", "hybrid"], "needs --pp-size"),
    (["--loop", "fit", "--accumulate", "2"], "--accumulate needs --loop custom"),
    (["--synthetic-shape", "3x3"], "--synthetic-shape"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--checkpoint-dir", "/proc/ringtrain-ckpt"], "not writable"),
    (["--checkpoint-dir", "/etc/hostname"], "is a file, not a folder"),
    (["--checkpoint-dir", "/tmp/x", "--keep", "0"], "--keep must be at least 1"),
    (["--checkpoint-dir", "/tmp/x", "--loop", "fit"], "needs --loop custom"),
]


TOO_FEW_BLOCKS = "model 'mlp' has 4 block(s) between valid cuts, too few for 5 stages"
NEEDS_THE_MODEL = {TOO_FEW_BLOCKS}  # what the model's graph says


@pytest.mark.parametrize("args,needle", BAD_TRAIN_FLAGS)
def test_bad_train_flags_exit_2_with_one_line(args, needle, before_tensorflow):
    run_it = partial(ringtrain, timeout=120) if needle in NEEDS_THE_MODEL else before_tensorflow
    said_once(run_it("train", *args), EXIT_USAGE, needle)


@pytest.mark.parametrize(
    "argv,command,needle",
    [
        (["schedule", "--stages", "0"], "schedule", "stages must be >= 1"),
        (["schedule", "--kind", "zigzag"], "schedule", "invalid choice: 'zigzag'"),
        (["schedule", "--png", "/tmp/chart.svg"], "schedule", "name it *.png"),
        (["schedule", "--png", "/nonexistent-dir/c.png"], "schedule", "does not exist"),
        (["doctor", "--verbose"], "doctor", "unrecognized arguments: --verbose"),
        (["hostfile"], "hostfile", "the following arguments are required"),
        (["hostfile", "check", "/no-hostfile"], "hostfile check", "/no-hostfile: No such file"),
        (["hostfile", "check", "/etc"], "hostfile check", "/etc: Is a directory"),
        (
            ["hostfile", "convert", "node[1-", "--slots", "2", "--format", "mpirun"],
            "hostfile convert",
            "bad node list 'node[1-'",
        ),
        (
            ["hostfile", "convert", "node[1-2]", "--format", "mpirun"],
            "hostfile convert",
            "give --tasks-per-node",
        ),
        (
            ["slurm", "render", "--strategy", "data", "--nodes", "1"]
            + ["--ntasks-per-node", "2", "--time", "25:99"],
            "slurm render",
            "time '25:99'",
        ),
        (
            ["slurm", "render", "--strategy", "data", "--nodes", "1", "--ntasks-per-node", "2"]
            + ["--time", "10", "--output", "/nonexistent-dir/job.sbatch"],
            "slurm render",
            "No such file or directory",
        ),
        (["bench", "pipeline", "--rounds", "1"], "bench pipeline", "at least 3 rounds"),
        (["bench", "strategies", "--png", "/tmp/c.jpg"], "bench strategies", "name it *.png"),
        (["bench", "allreduce", "--out", "/proc/a.json"], "bench allreduce", "not writable"),
        (["cluster"], "cluster", "the following arguments are required"),
        ([], "", "the following arguments are required: command"),
        (["nosuch"], "", "invalid choice: 'nosuch'"),
    ],
)
def test_every_subcommand_says_bad_input_in_one_line_and_exits_2(argv, command, needle):
    said_once(ringtrain(*argv, timeout=120), EXIT_USAGE, needle, command)


def test_hostfile_check_exits_1_with_every_problem_on_stdout(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node01 slots=4\n%%% garbage\nnode02 slots=0\nnode01 slots=2\n")
    done = ringtrain("hostfile", "check", str(hostfile))
    assert done.returncode == EXIT_PROBLEMS and done.stderr == "", done.stderr
    assert all(f"line {n}:" in done.stdout for n in (2, 3, 4)), done.stdout


def test_mpi_not_found_is_said_in_one_line():
    done = subprocess.run(
        [str(BIN / "ringtrain"), "train", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**ENV, "PATH": str(BIN)},
    )
    said_once(done, EXIT_USAGE, "MPI not found: mpirun is not on PATH")


def test_bad_input_leaves_existing_outputs_untouched(tmp_path):
    metrics = tmp_path / "m.json"
    metrics.write_text("precious")
    said_once(ringtrain("train", "--lr", "0", "--metrics-out", str(metrics)), EXIT_USAGE, "--lr")
    assert metrics.read_text() == "precious"


def test_help_lists_every_subcommand_with_its_purpose():
    done = ringtrain("--help")
    assert done.returncode == 0
    for command in ("train", "schedule", "doctor", "hostfile", "slurm", "bench"):
        assert command in done.stdout


# ---- datasets -----------------------------------------------------------------------------


def _npz(folder: Path, name: str, **arrays) -> str:
    path = folder / f"{name}.npz"
    np.savez(path, **arrays)
    return f"npz:{path}"


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 8)).astype(np.float32), rng.integers(0, 4, 256)
    garbage = folder / "garbage.npz"
    garbage.write_bytes(b"this is not a zip file")
    return {
        "good": _npz(folder, "good", x=x, y=y),
        "nan": _npz(folder, "nan", x=np.full_like(x, np.nan), y=y),
        "beyond_float32": _npz(folder, "beyond", x=np.where(x > 2, 1e300, x.astype(float)), y=y),
        "test_without_labels": _npz(folder, "half", x=x, y=y, x_test=x[:10]),
        "text": _npz(folder, "text", x=np.array([["a"] * 8] * 256), y=y),
        "lacking": _npz(folder, "lacking", x=x),
        "garbage": f"npz:{garbage}",
        # finite, but so large that SGD overflows the weights within the first update
        "huge": _npz(folder, "huge", x=x * 1e6, y=y),
    }


@pytest.mark.parametrize(
    "name,needle",
    [
        ("nan", "x holds 2048 non-finite value(s) (NaN or beyond float32), the first in row 0"),
        ("beyond_float32", "non-finite value(s) (NaN or beyond float32)"),
        ("test_without_labels", "has x_test without its pair"),
        ("text", "x holds <U1, not real numbers"),
        ("lacking", "lacks array(s) y"),
        ("garbage", "not a readable .npz"),
    ],
)
def test_bad_npz_datasets_are_refused_at_load(datasets, name, needle, before_tensorflow):
    done = before_tensorflow("train", "--dataset", datasets[name], "--steps", "1")
    said_once(done, EXIT_USAGE, needle)


def test_a_model_that_cannot_take_the_rows_is_a_bad_input(datasets):
    done = ringtrain("train", "--model", "cnn", "--dataset", datasets["good"], "--steps", "1")
    said_once(done, EXIT_USAGE, "--model cnn does not fit rows of shape (8,)")


# ---- under mpirun: said once per job, the same code on every rank ---------------------------


@pytest.mark.mpi
@pytest.mark.parametrize(
    "args,needle",
    [
        (["--seed", "-1"], "--seed must be a whole number"),
        (["--strategy", "single"], "--strategy single runs on one rank, but 2 were launched"),
        (["--batch-size", "1"], "global batch 1 is smaller than the 2 shares it is cut into"),
        (["--metrics-out", "/nonexistent-dir/m.json"], "folder /nonexistent-dir does not exist"),
        (
            ["--strategy", "pipeline", "--schedule", "interleaved", "--microbatches", "3"],
            "needs --microbatches (3) to be a multiple of the 2 pipeline ranks",
        ),
    ],
)
def test_a_problem_every_rank_sees_is_said_once_by_rank_0(args, needle):
    said_once(train_under_mpirun(*args, "--steps", "1", timeout=120), EXIT_USAGE, needle)


@pytest.mark.mpi
def test_non_finite_features_are_said_once_under_mpirun(datasets):
    done = train_under_mpirun("--dataset", datasets["nan"], "--steps", "1", timeout=120)
    said_once(done, EXIT_USAGE, "x holds 2048 non-finite value(s)")


@pytest.mark.mpi
def test_a_schedule_error_is_said_once_under_mpirun():
    done = mpirun(str(BIN / "ringtrain"), "schedule", "--stages", "0", timeout=120)
    said_once(done, EXIT_USAGE, "stages must be >= 1", "schedule")


@pytest.mark.mpi
def test_a_file_only_one_rank_lacks_is_said_by_that_rank_and_stops_every_rank(tmp_path, datasets):
    shutil.copy(datasets["good"][4:], tmp_path / "rank0.npz")  # rank 1's file does not exist
    dataset = f"npz:{tmp_path}/rank$OMPI_COMM_WORLD_RANK.npz"  # expanded by each rank's shell
    done = mpirun("sh", "-c", f"exec {BIN / 'ringtrain'} train --dataset {dataset}", timeout=120)
    assert "Traceback" not in done.stderr and done.returncode == EXIT_USAGE, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [
        f"[rank 1] ringtrain train: error: dataset file {tmp_path}/rank1.npz does not exist"
    ]


# ---- checkpoints --------------------------------------------------------------------------

CHECKPOINT_RUN = ["--strategy", "single", "--model", "mlp", "--steps", "4"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real, complete checkpoint at step 2 of a 4-step single-process run."""
    folder = tmp_path_factory.mktemp("ckpt") / "run"
    done = ringtrain("train", *CHECKPOINT_RUN, "--checkpoint-dir", str(folder), "--stop-after", "2")
    assert done.returncode == EXIT_CHECKPOINTED, done.stderr[-2000:]
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
def test_damaged_checkpoints_are_refused_and_left_as_they_are(
    tmp_path, checkpoint, damage, needle, before_tensorflow
):
    folder = tmp_path / "run"
    shutil.copytree(checkpoint, folder)
    damage(folder / "step-00000002")
    before = _snapshot(folder)
    done = before_tensorflow("train", *CHECKPOINT_RUN, "--checkpoint-dir", str(folder), "--resume")
    said_once(done, EXIT_USAGE, needle)
    assert _snapshot(folder) == before


def test_a_checkpoint_from_another_model_is_refused(tmp_path, checkpoint, before_tensorflow):
    folder = tmp_path / "run"
    shutil.copytree(checkpoint, folder)
    done = before_tensorflow(
        "train",
        *CHECKPOINT_RUN[:-4],
        "--model",
        "transformer",
        "--steps",
        "4",
        "--checkpoint-dir",
        str(folder),
        "--resume",
    )
    said_once(done, EXIT_USAGE, "model is 'mlp' there and 'transformer' here")


@pytest.mark.mpi
def test_more_stages_than_layers_is_refused_once():
    done = train_under_mpirun("--strategy", "pipeline", "--steps", "1", ranks=5, timeout=180)
    said_once(done, EXIT_USAGE, TOO_FEW_BLOCKS)


@pytest.mark.mpi
def test_resuming_a_pipeline_checkpoint_with_another_world_size_is_refused_once(tmp_path):
    folder = tmp_path / "ckpt"
    run_args = ["--strategy", "pipeline", "--steps", "4", "--checkpoint-dir", str(folder)]
    first = train_under_mpirun(*run_args, "--stop-after", "2")
    assert first.returncode == EXIT_CHECKPOINTED, first.stderr[-2000:]
    before = _snapshot(folder)
    refused = train_under_mpirun(*run_args, "--resume", ranks=4)
    said_once(
        refused,
        EXIT_USAGE,
        "splits 4 model elements into 2 stages, but this run has 4 elements in 4 stages",
    )
    assert _snapshot(folder) == before


# ---- non-finite training ------------------------------------------------------------------


def _parts_are_finite(manifest: dict) -> bool:
    for part in manifest["parts"]:
        with np.load(Path(manifest["folder"]) / f"{part}.npz", allow_pickle=False) as stored:
            if not all(np.isfinite(stored[k]).all() for k in stored.files):
                return False
    return True


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["data", "pipeline"])
def test_a_diverging_loss_stops_every_rank_and_the_last_good_checkpoint_stays_latest(
    tmp_path, strategy
):
    folder = tmp_path / "ckpt"
    done = train_under_mpirun(
        *["--strategy", strategy, "--optimizer", "sgd", "--lr", "1e30", "--steps", "8"],
        *["--checkpoint-dir", str(folder), "--checkpoint-every", "1"],
    )
    # The loss or, on CPUs whose kernels round differently, the weights go first.
    said_once(done, EXIT_NON_FINITE, "became non-finite")
    step = int(re.search(r"at step (\d+);", done.stderr).group(1))
    assert f"no checkpoint was written for it (the newest is from step {step - 1})" in done.stderr
    newest = latest(str(folder))
    assert newest is not None and newest["step"] == step - 1 and _parts_are_finite(newest)
    assert not (folder / f"step-{step:08d}").exists()


def test_weights_that_overflow_while_the_loss_is_finite_are_never_checkpointed(tmp_path, datasets):
    folder = tmp_path / "ckpt"
    done = ringtrain(
        *["train", "--strategy", "single", "--dataset", datasets["huge"], "--optimizer", "sgd"],
        *["--lr", "1e36", "--steps", "4", "--checkpoint-dir", str(folder)],
        *["--checkpoint-every", "1"],
    )
    said_once(done, EXIT_NON_FINITE, "the weights or the optimizer's state became non-finite at")
    assert latest(str(folder)) is None


def test_a_diverging_loss_stops_model_fit_too():
    done = ringtrain(
        *["train", "--strategy", "single", "--loop", "fit", "--optimizer", "sgd"],
        *["--lr", "1e30", "--steps", "8"],
    )
    said_once(done, EXIT_NON_FINITE, "became non-finite")


# ---- the aborts ---------------------------------------------------------------------------

ABORTS = """
import sys, time
import numpy as np
from ringtrain import runtime
from ringtrain.comm import Link
from ringtrain.guard import Watchdog
comm = runtime.start_mpi(2)
if sys.argv[1] == "watchdog":  # every rank's watchdog fires at once
    Watchdog(1.0, comm.Get_rank(), "the test's sleep")
elif comm.Get_rank() == 1:  # rank 0 never sends
    Link(comm, 1.0).recv_buffer(np.empty(1), 0, 7, "a message rank 0 never sends")
time.sleep(60)
"""


@pytest.mark.mpi
@pytest.mark.parametrize(
    "kind,code,needle",
    [
        ("watchdog", EXIT_WATCHDOG, "no progress for 1 s during the test's sleep"),
        ("silent-peer", EXIT_SILENT_PEER, "rank 0 went silent: no progress for 1 s"),
    ],
)
def test_an_abort_ends_the_job_with_its_code(kind, code, needle):
    done = mpirun(sys.executable, "-c", ABORTS, kind, timeout=50)
    assert done.returncode == code, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and needle in done.stderr, done.stderr[-2000:]
