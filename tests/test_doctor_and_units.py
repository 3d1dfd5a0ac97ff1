"""`ringtrain doctor`, and the pure pieces: partitioner, buckets and configuration checks."""

from __future__ import annotations

import subprocess

import pytest
from conftest import BIN, ENV, ROOT

from ringtrain import quiet, runtime
from ringtrain.config import TrainConfig
from ringtrain.errors import UserError
from ringtrain.pipeline import partition
from ringtrain.pipeline.schedule import build_schedule
from ringtrain.validation import validate


def doctor(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "ringtrain"), "doctor"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def test_doctor_passes_on_this_machine_without_tensorflow_noise():
    unasked = {k: v for k, v in ENV.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # ringtrain's job
    done = doctor(unasked)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    for needle in ("tensorflow", "mpi4py", "MPI library", "horovod", "allreduce over 2 ranks"):
        assert needle in done.stdout
    for noise in ("absl::InitializeLog", "oneDNN", "cpu_feature_guard"):
        assert noise not in done.stdout + done.stderr


def test_doctor_without_mpirun_on_path_names_the_problem_and_the_remedy():
    done = doctor({**ENV, "PATH": str(BIN)})  # the venv only: no mpirun
    assert done.returncode != 0
    assert "problem: mpirun is not on PATH: install openmpi-bin" in done.stderr


def test_uniform_partition_splits_by_count():
    assert partition.uniform(4, 2) == [(0, 2), (2, 4)]
    assert partition.uniform(5, 3) == [(0, 2), (2, 4), (4, 5)]


def test_balanced_partition_minimises_the_costliest_stage():
    assert partition.balanced([1, 1, 1, 10], 2) == [(0, 3), (3, 4)]
    assert partition.balanced([8, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]
    assert partition.balanced([1, 2, 3], 3) == [(0, 1), (1, 2), (2, 3)]


def test_an_interleaved_partition_is_the_split_whose_simulated_step_is_shortest():
    """P=2 ranks, V=2 stages each (stages 0 and 2 on rank 0). Five equal elements: balancing
    stages gives the last stage two, and 41 units a step against 37 for giving them to stage 2.
    A small embedding, four equal blocks and a small head: splitting the blocks 2/1/1 across
    stages 1-3 balances the ranks just as well as 1/1/1/1 but holds every microbatch up on the
    two-block stage; the simulation sees it."""
    interleaved = build_schedule("interleaved", 2, 4, 2)

    def elements(costs):
        return [{"F": c, "B": 2 * c, "BI": c, "BW": c} for c in costs]

    assert partition.balanced([3] * 5, 4) == [(0, 1), (1, 2), (2, 3), (3, 5)]
    assert partition.fastest(elements([1] * 5), interleaved) == [(0, 1), (1, 2), (2, 4), (4, 5)]
    blocks = elements([4, 20, 20, 20, 20, 2])
    assert partition.fastest(blocks, interleaved) == [(0, 2), (2, 3), (3, 4), (4, 6)]


@pytest.mark.parametrize(
    "changes,world,needle",
    [
        ({"strategy": "single"}, 2, "runs on one rank"),
        ({"strategy": "pipeline", "microbatches": 80}, 2, "smaller than the 80 shares"),
        ({"strategy": "hybrid", "pp_size": 3}, 4, "not divisible by --pp-size 3"),
        ({"strategy": "model", "microbatches": 2}, 2, "one microbatch"),
        ({"clip_norm": -1.0}, 1, "--clip-norm must be positive"),
        ({"bucket_mb": 0.0}, 2, "--bucket-mb must be positive"),
        ({"strategy": "pipeline", "bucket_mb": 1.0}, 2, "--bucket-mb buckets the allreduce"),
    ],
)
def test_validation_names_the_problem(changes, world, needle):
    cfg = TrainConfig(batch_size=64, **changes)
    with pytest.raises(UserError, match=needle):
        validate(cfg, world)


def test_buckets_follow_the_backward_and_hold_the_cap():
    from ringtrain.dataparallel.collectives import MiB, buckets

    sizes = [MiB // 2, MiB // 2, 3 * MiB, MiB // 4, MiB // 4]
    assert buckets(sizes, 1.0) == [[4, 3], [2], [1, 0]]  # last layer first; big alone
    assert buckets(sizes, 100.0) == [[4, 3, 2, 1, 0]]
    assert buckets([], 1.0) == []


def test_learning_rate_scales_by_replicas_after_a_linear_warmup():
    from ringtrain.optim import learning_rate

    plain = TrainConfig(lr=0.1)
    assert learning_rate(plain, 0.5, 4) == 0.1  # off by default: runs stay comparable
    scaled = TrainConfig(lr=0.1, scale_lr=True, warmup_epochs=2)
    assert learning_rate(scaled, 0.0, 4) == pytest.approx(0.1)
    assert learning_rate(scaled, 1.0, 4) == pytest.approx(0.25)
    assert learning_rate(scaled, 3.0, 4) == pytest.approx(0.4)
    # Without --scale-lr the warm-up still acts, as Horovod's does: from lr / replicas to lr.
    warm = TrainConfig(lr=0.1, warmup_epochs=2)
    assert learning_rate(warm, 0.0, 4) == pytest.approx(0.025)
    assert learning_rate(warm, 1.0, 4) == pytest.approx(0.0625)
    assert learning_rate(warm, 2.0, 4) == pytest.approx(0.1)


def test_quiet_holds_back_only_absl_notices_below_the_level():
    notices = (
        b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
        b"I0000 00:00:1796149691.797099    5957 port.cc:153] oneDNN custom operations are on.\n"
        b"W0000 00:00:1796149691.800000    5957 x.cc:9] a warning\n"
        b"E1130 12:00:00.000000  123 y.cc:45] an error\n"
        b"a line of one's own\n"
    )
    assert quiet.kept(notices, 0) == notices
    assert quiet.kept(notices, 2) == (
        b"E1130 12:00:00.000000  123 y.cc:45] an error\na line of one's own\n"
    )
    assert quiet.kept(notices, 3) == b"a line of one's own\n"


@pytest.mark.parametrize(
    "mask, local_size, threads, cycle, mpi_yields, horovod_nice",
    [
        ({0}, 1, 1, "1", "1", "19"),  # bound to one core (a one-core node): one thread, not two
        ({0, 1}, 1, 2, "0.1", None, "0"),  # unbound and alone: both cores, one to spare
        ({0, 1}, 2, 1, "1", "1", "0"),  # unbound, two ranks on the node: a core each, shared
    ],
)
def test_threads_cycle_and_yield_follow_the_cores_a_rank_may_run_on(
    monkeypatch, mask, local_size, threads, cycle, mpi_yields, horovod_nice
):
    for name in (
        "RINGTRAIN_THREADS",
        "SLURM_CPUS_PER_TASK",
        "HOROVOD_CYCLE_TIME",
        "OMPI_MCA_mpi_yield_when_idle",
        "RINGTRAIN_HOROVOD_NICE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: mask)
    assert runtime.default_threads(local_size) == threads
    runtime.tune_environment(local_size)
    assert runtime.os.environ["HOROVOD_CYCLE_TIME"] == cycle
    assert runtime.os.environ.get("OMPI_MCA_mpi_yield_when_idle") == mpi_yields
    assert runtime.os.environ["RINGTRAIN_HOROVOD_NICE"] == horovod_nice
    assert runtime.horovod_nice() == int(horovod_nice)


@pytest.mark.parametrize("value", ["high", "-5", "20"])
def test_a_bad_horovod_niceness_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("RINGTRAIN_HOROVOD_NICE", value)
    with pytest.raises(UserError, match="RINGTRAIN_HOROVOD_NICE"):
        runtime.horovod_nice()
