"""What a user sees: no TensorFlow start-up noise, one whole line per epoch under a launcher, a
live bar on a terminal, and TensorBoard scalars whose step axis a resumed run continues."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN, ENV, MPIRUN, ROOT, one_line_error, ringtrain

from ringtrain.log import progress_style

# TensorFlow's start-up notices and absl's line prefix (I1130 12:00:00.000000  123 file.cc:45]).
NOISE = re.compile(
    r"absl::InitializeLog|oneDNN|cpu_feature_guard|TF_ENABLE_ONEDNN_OPTS"
    r"|[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]"
)
EPOCH_LINE = re.compile(r"epoch (\d+)/(\d+): loss \S+  held-out loss \S+  held-out accuracy \S+ \(")
# ringtrain alone must keep TensorFlow quiet: no help from the caller's environment.
UNTUNED = {k: v for k, v in ENV.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
# Digits at a global batch of 256: 5 steps an epoch.
PIPELINE = ["--strategy", "pipeline", "--microbatches", "2", "--batch-size", "256"]
PER_EPOCH = 5


def launch(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False
    )


def train_cmd(*flags: str, ranks: int = 2) -> list[str]:
    return [*MPIRUN, str(ranks), str(BIN / "ringtrain"), "train", *PIPELINE, *flags]


def assert_clean(done: subprocess.CompletedProcess) -> None:
    noise = [line for line in done.stderr.splitlines() if NOISE.search(line)]
    assert noise == [], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "\r" not in done.stdout


def epochs_shown(stdout: str) -> list[int]:
    return [int(m.group(1)) for m in EPOCH_LINE.finditer(stdout)]


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the folder's event files, as TensorBoard reads them: tag -> (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    events = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    events.Reload()
    return {
        tag: [(e.step, float(make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]
        for tag in events.Tags()["tensors"]
    }


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory) -> dict:
    """3 epochs of 5 steps: horovodrun stops after step 12 (exit 75), mpirun resumes to 15.
    Both write TensorBoard scalars into one folder."""
    tmp = tmp_path_factory.mktemp("output")
    board, checkpoints, metrics = tmp / "board", tmp / "ckpt", tmp / "metrics.json"
    common = ["--epochs", "3", "--tensorboard", str(board), "--checkpoint-dir", str(checkpoints)]
    # horovodrun checks its own build by importing TensorFlow before it starts any rank, in a
    # process ringtrain never runs in: the README's set-up exports TF_CPP_MIN_LOG_LEVEL for it.
    # PYTHONUNBUFFERED=1 makes print() write a line's text and its newline apart, which is how
    # lines came out glued to the next rank tag.
    horovodrun = ["horovodrun", "-np", "2", "-H", "localhost:2", str(BIN / "ringtrain"), "train"]
    stopped = launch(
        [*horovodrun, *PIPELINE, *common, "--stop-after", "12"],
        {**ENV, "PYTHONUNBUFFERED": "1"},
    )
    resumed = launch(
        train_cmd(*common, "--resume", "--progress", "none", "--metrics-out", str(metrics)),
        UNTUNED,
    )
    return {
        "stopped": stopped,
        "resumed": resumed,
        "board": board,
        "losses": json.loads(metrics.read_text())["losses"] if metrics.exists() else None,
    }


def test_horovodrun_prints_each_epoch_once_in_whole_lines_without_tensorflow_noise(pipeline_runs):
    done = pipeline_runs["stopped"]
    assert done.returncode == 75, done.stderr[-2000:]
    assert_clean(done)
    lines = done.stdout.splitlines()
    assert lines and all(line.startswith("[1,0]<stdout>:") for line in lines), lines
    assert all(line.count("<stdout>:") == 1 for line in lines), lines  # no line glued to a tag
    assert epochs_shown(done.stdout) == [1, 2]  # `auto` under a launcher: lines
    assert "stopped after step 12 of 15" in lines[-1]


def test_progress_none_prints_no_epoch_line_and_tensorflow_stays_quiet_unasked(pipeline_runs):
    done = pipeline_runs["resumed"]
    assert done.returncode == 0, done.stderr[-2000:]
    assert_clean(done)
    assert epochs_shown(done.stdout) == []
    assert "resumed from" in done.stdout and "final loss" in done.stdout


def test_tensorboard_has_every_scalar_at_its_step_and_a_resume_continues_the_axis(pipeline_runs):
    assert pipeline_runs["resumed"].returncode == 0, pipeline_runs["resumed"].stderr[-2000:]
    found = scalars(pipeline_runs["board"])
    steps, epoch_ends = list(range(1, 16)), [5, 10, 15]
    for tag in ("loss", "learning_rate", "samples_per_sec", "input_wait_fraction"):
        assert [step for step, _ in found[tag]] == steps, tag  # each step once, in order
    for tag in ("held_out_accuracy", "bubble_measured"):
        assert [step for step, _ in found[tag]] == epoch_ends, tag
    # The losses are the run's own, the stopped and resumed parts included.
    assert [v for _, v in found["loss"]] == pytest.approx(pipeline_runs["losses"], rel=1e-6)
    assert all(v == pytest.approx(0.003) for _, v in found["learning_rate"])
    assert all(v > 0 for _, v in found["samples_per_sec"])
    assert all(0 <= v < 1 for _, v in found["input_wait_fraction"])
    assert all(0 < v <= 1 for _, v in found["held_out_accuracy"])
    assert all(0 < v < 1 for _, v in found["bubble_measured"])


def on_a_terminal(cmd: list[str], env: dict[str, str], timeout: float = 300) -> str:
    """Run cmd with a pseudo-terminal as stdin, stdout and stderr; return what it showed."""
    main, child = os.openpty()
    shown, deadline = b"", time.monotonic() + timeout
    with subprocess.Popen(cmd, stdin=child, stdout=child, stderr=child, env=env, cwd=ROOT) as p:
        os.close(child)
        try:
            while select.select([main], [], [], max(0.0, deadline - time.monotonic()))[0]:
                shown += os.read(main, 4096)
        except OSError:  # the terminal closed: the command is done
            pass
        if p.poll() is None and time.monotonic() >= deadline:
            p.kill()
        assert p.wait(timeout=30) == 0, shown[-2000:]
    os.close(main)
    return shown.decode(errors="replace")


def test_progress_auto_is_a_live_keras_bar_on_a_terminal_of_ones_own():
    """No launcher, stdout a terminal: the bar redraws in place; the results end each epoch."""
    launcher = ("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_")
    alone = {k: v for k, v in UNTUNED.items() if not k.startswith(launcher)}
    cmd = [str(BIN / "ringtrain"), "train", "--strategy", "single", "--batch-size", "256"]
    text = on_a_terminal([*cmd, "--steps", str(PER_EPOCH + 2)], alone)
    assert [line for line in text.splitlines() if NOISE.search(line)] == []
    assert "\r" in text.replace("\r\n", "\n")  # redrawn in place
    assert f"{PER_EPOCH}/{PER_EPOCH}" in text and "2/2" in text  # both epochs ran to the end
    assert text.count("held-out accuracy: ") == 2
    assert "epoch 1/2\r\n" in text and "epoch 2/2\r\n" in text


@pytest.mark.parametrize(
    ("launcher", "environ", "expected"),
    [
        ("open-mpi", {}, "lines"),  # mpirun, and horovodrun through it
        ("slurm", {}, "lines"),  # srun
        ("pmix", {}, "lines"),
        ("mpi4py", {}, "lines"),  # MPI already running in a script
        ("single", {"SLURM_JOB_ID": "7"}, "lines"),  # a Slurm batch script itself
        ("single", {}, "lines"),  # stdout is capsys's buffer, not a terminal
    ],
)
def test_progress_auto_picks_lines_under_any_launcher_or_off_a_terminal(
    launcher, environ, expected, capsys
):
    assert progress_style("auto", launcher, environ) == expected
    for chosen in ("bar", "lines", "none"):
        assert progress_style(chosen, launcher, environ) == chosen


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--progress", "fancy"], "unknown progress 'fancy'; choose one of auto, bar, lines, none"),
        (["--tensorboard", "README.md"], "--tensorboard README.md is a file, not a folder"),
        (["--tensorboard", "no/such/parent/tb"], "does not exist"),
        (["--tensorboard", "tb", "--loop", "fit"], "--tensorboard needs --loop custom"),
    ],
)
def test_bad_output_flags_cost_one_line_before_any_training(flags, needle):
    done = ringtrain("train", *flags)
    one_line_error(done, needle)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
