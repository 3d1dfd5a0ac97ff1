"""The benchmarks: the hand-written ring allreduce is right, and every `ringtrain bench` runs
in quick mode and fills its JSON with numbers for every contender. No speed is asserted: the
numbers depend on the machine and on whatever else runs on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BIN, ENV, MPIRUN, ROOT, one_line_error, ringtrain, run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_ring_allreduce_equals_mpi_allreduce(ranks):
    done = run([*MPIRUN, str(ranks), sys.executable, str(ROOT / "tests" / "ring_check.py")], 120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ranks"] == ranks
    assert result["checked"] == 56  # 11 sizes, 3 dtypes, random floats too, one 2-D array
    assert result["failures"] == []


RESULTS = ROOT / "benchmarks" / "results"


def figure_sources() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(RESULTS.iterdir())}


def quick_bench(name: str, tmp_path: Path) -> dict:
    """Run `ringtrain bench NAME --quick` in the checkout with no paths, as a developer would;
    check what every report holds; return the report. A quick run writes to the scratch folder
    ($TMPDIR/ringtrain-bench) and leaves benchmarks/results, the docs' figures, as they were."""
    out = tmp_path / "ringtrain-bench" / f"{name}-quick.json"
    png = out.with_suffix(".png")
    sources = figure_sources()
    done = subprocess.run(
        [str(BIN / "ringtrain"), "bench", name, "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**ENV, "TMPDIR": str(tmp_path)},
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert figure_sources() == sources
    assert png.read_bytes()[:8] == PNG_MAGIC
    report = json.loads(out.read_text())
    assert report["quick"] is True
    facts = report["machine"]
    assert facts["cpus"] >= 1
    assert all(facts[k] for k in ("python", "tensorflow", "keras", "mpi4py", "horovod", "mpi"))
    assert "cpu_model" in facts
    assert report["wall_seconds"] > 0
    return report


QUICK = [0, 1]  # a quick run's rounds, where its launches allow two (bench/common.quick_rounds)


SETTINGS = {
    "HOROVOD_CYCLE_TIME",
    "HOROVOD_FUSION_THRESHOLD",
    "OMPI_MCA_mpi_yield_when_idle",
    "RINGTRAIN_HOROVOD_NICE",
    "RINGTRAIN_THREADS",
}


def assert_pinning_recorded(report: dict, cpus_lists: list[str]) -> None:
    """One rule, its mpirun flags, and a Cpus_allowed_list read from /proc for every process."""
    assert report["pinning"]["rule"].strip()
    assert report["pinning"]["mpirun_flags"] == ["--bind-to", "none"]
    assert cpus_lists and all(c and c != "unknown" for c in cpus_lists)


def rounds_per_contender(rows: list[dict]) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = {}
    for r in rows:
        seen.setdefault(r["contender"], []).append(r["round"])
    return seen


@pytest.mark.mpi
def test_bench_pipeline_quick(tmp_path):
    """Every schedule kind and the single processes (one thread, whole and in 1F1B's slices;
    two threads) take every round; each pipeline is reported with its prediction from the
    run's calibration and its activation memory, and 1F1B with its limit at that slicing."""
    report = quick_bench("pipeline", tmp_path)
    rows = report["raw"]
    singles = {"single 1 thread", "single 1 thread in 8 slices", "single 2 threads"}
    expected = singles | {
        "gpipe M=2",
        "1f1b M=8",
        "interleaved M=8",
        "zb-h1 M=8",
    }
    assert set(rounds_per_contender(rows)) == expected
    assert all(r == QUICK for r in rounds_per_contender(rows).values())
    assert all(r["samples_per_sec"] > 0 for r in rows)
    for e in report["summary"]:
        assert e["samples_per_sec_min"] <= e["samples_per_sec_median"] <= e["samples_per_sec_max"]
        assert len(e["speedup_vs_single_per_round"]) == len(QUICK)
    pipes = {e["contender"]: e for e in report["summary"] if "bubble_gap" in e}
    assert set(pipes) == expected - singles
    limit = report["one_f_one_b_limit"]
    assert limit["unit_bubble"] == pytest.approx(1 / 9)
    assert limit["limit_vs_single_1_thread"] == pytest.approx(
        2 * 8 / 9 * limit["sliced_vs_single_1_thread"]
    )
    assert limit["one_f_one_b_of_limit"] > 0
    for e in pipes.values():
        assert 0 <= e["bubble_predicted_median"] < 1 and e["step_time_predicted_median"] > 0
        stages = 4 if e["schedule"] == "interleaved" else 2
        assert len(e["activation_bytes_peak"]) == len(e["peak_inflight"]) == stages
        assert e["calibration"]["link"]["bytes_per_second"] > 0
    assert pipes["zb-h1 M=8"]["calibration"]["seconds"].keys() >= {
        f"{s}{op}" for s in (0, 1) for op in ("F", "BI", "BW")
    }
    ready = report["ready"]
    assert (
        ready["single 1 thread"]["cpus_allowed_list"]
        != ready["single 2 threads"]["cpus_allowed_list"]
    )
    assert all(isinstance(v, bool) for v in report["targets"].values())


STRATEGIES = [
    "single",
    "data custom",
    "data fit",
    "pipeline 1f1b M=8",
    "single all cores",
    "TF MultiWorkerMirrored stock",
    "TF MultiWorkerMirrored tuned",
    "TF ParameterServer (asynchronous)",
    "TF Mirrored",
]
PS = "TF ParameterServer (asynchronous)"


@pytest.mark.mpi
def test_bench_strategies_quick(tmp_path):
    report = quick_bench("strategies", tmp_path)
    measured = rounds_per_contender(report["raw"])
    failures = report["failures"]
    # Every contender has every round's numbers; only the parameter servers may instead
    # have a recorded reason (they may not run on every TensorFlow).
    for name in STRATEGIES:
        if name == PS and name in failures:
            assert failures[name].strip()
            continue
        assert measured.get(name) == QUICK, (name, failures)
    assert set(failures) <= {PS}
    for r in report["raw"]:
        assert r["samples_per_sec"] > 0 and r["steps"] == report["steps_per_measurement"]
        assert r["others_cpu_seconds"] >= 0
    ratios = report["ratios"]
    assert len(ratios["data custom efficiency"]["per_round"]) == len(QUICK)
    assert "data custom / TF MultiWorkerMirrored stock" in ratios
    assert "data custom / TF MultiWorkerMirrored tuned" in ratios
    assert "data custom / TF Mirrored" in ratios
    for target in report["targets"].values():
        assert target["met"] in (True, False, None)
        assert target["met"] is not None or target["why_not_measured"]
    for kind, threads in report["threads"].items():
        assert threads["intra_op"] >= 1 and threads["inter_op"] >= 1, kind
    ranks = report["threads"]["ringtrain rank"]
    assert ranks["intra_op"] == ranks["inter_op"] == 1
    assert set(report["processes_per_contender"]) == set(STRATEGIES)
    # Every measured contender's processes report where they may run, under one rule.
    cpus = report["cpus_allowed_list"]
    assert set(measured) <= set(cpus)
    for name in measured:
        count = sum(n for n, _ in report["processes_per_contender"][name])
        assert len(cpus[name]) == count, (name, cpus[name])
    assert_pinning_recorded(report, [p["cpus_allowed_list"] for ps in cpus.values() for p in ps])
    assert set(report["environment"]) == SETTINGS
    assert report["environment"]["RINGTRAIN_THREADS"] == "1"
    # MWMS tuned: the sweep ran, and its pick is recorded along with every candidate.
    tuning = report["mwms_tuning"]
    assert len(tuning["candidates"]) >= 1  # quick: one candidate through the same sweep
    assert tuning["chosen"] in [
        {k: c[k] for k in ("implementation", "inter_op")} for c in tuning["candidates"]
    ]
    assert tuning["chosen"]["implementation"] in ("RING", "AUTO")
    assert report["threads"]["mwms tuned worker"]["inter_op"] == tuning["chosen"]["inter_op"]
    assert "asynchronous" in report["notes"][PS].lower()
    assert 0 <= report["machine"]["cpu_steal_fraction"] < 1  # /proc/stat is read on Linux


@pytest.mark.mpi
def test_bench_pipeline_sizes_quick(tmp_path):
    """One process and two 2-stage pipelines (the default backward and --recompute), each a
    `ringtrain train` launch, take every round, and 1F1B launches at 1 example per
    microbatch too; each pipeline reports its bubble, 1F1B its fixed cost per action, and
    every ratio is to the one process of its own round."""
    report = quick_bench("pipeline-sizes", tmp_path)
    rows = report["raw"]
    expected = {
        f"transformer {name} @ 256"
        for name in ("single 1 thread", "1f1b M=8", "1f1b M=8 recompute")
    } | {"transformer 1f1b M=8 @ 8"}
    assert set(rounds_per_contender(rows)) == expected
    assert all(r == QUICK for r in rounds_per_contender(rows).values())
    assert all(r["samples_per_sec"] > 0 for r in rows)
    by_name = {e["name"]: e for e in report["summary"]}
    assert len(report["summary"]) == 3  # the 1-example launches are no contender
    assert by_name["single 1 thread"]["vs_single_per_round"] == [1.0] * len(QUICK)
    for name in ("1f1b M=8", "1f1b M=8 recompute"):
        assert 0 <= by_name[name]["bubble_measured_median"] < 1
        assert by_name[name]["call_floor_ms_median"] > 0
        assert len(by_name[name]["vs_single_per_round"]) == len(QUICK)
    profile = by_name["1f1b M=8"]["fixed_ms_per_action_median"]  # action by action, per stage
    assert profile["0"].keys() == {"F", "SA", "RG", "B"}
    assert profile["1"].keys() == {"RA", "F", "B", "SG"}
    assert profile["0"]["F"] > 0 and profile["1"]["B"] > 0
    fixed = by_name["1f1b M=8"]["fixed_ms_per_microbatch_median"]
    assert fixed == max(sum(ops.values()) for ops in profile.values())


@pytest.mark.mpi
def test_bench_shard_optimizer_quick(tmp_path):
    """Plain and sharded data parallelism, each a `ringtrain train` launch on 2 ranks, take
    every round; each ratio is to the plain step of its own round, and the verdict is read
    from the median ratio."""
    report = quick_bench("shard-optimizer", tmp_path)
    rows = report["raw"]
    counts = rounds_per_contender(rows)
    assert set(counts) == {"cnn data", "cnn data --shard-optimizer"}
    assert all(r == QUICK for r in counts.values())
    assert all(r["step_seconds"] > 0 and r["peak_resident_bytes"] > 0 for r in rows)
    by_name = {e["name"]: e for e in report["summary"]}
    assert by_name["data"]["vs_plain_per_round"] == [1.0] * len(QUICK)
    sharded = by_name["data --shard-optimizer"]
    assert len(sharded["vs_plain_per_round"]) == len(QUICK)
    assert report["within_target"] == {"cnn": sharded["vs_plain_median"] <= 1.15}


@pytest.mark.mpi
def test_bench_zoo_quick(tmp_path):
    """Every contender takes every round; each ResNet50 run (and the CNN, which has no
    BatchNormalization) is compared with one-process model.fit, which the CNN and rank 0 alone
    match up to rounding: the method is right, whatever BatchNormalization makes of the rest."""
    report = quick_bench("zoo", tmp_path)
    contenders = [
        "built-in cnn, data",
        "your keras.Model cnn, data",
        "ResNet50 single",
        "ResNet50 data",
        "ResNet50 pipeline interleaved 4 stages M=4",
    ]
    assert rounds_per_contender(report["raw"]) == {name: QUICK for name in contenders}
    assert all(r["samples_per_sec"] > 0 for r in report["raw"])
    assert [len(r["per_round"]) for r in report["ratios"].values()] == [len(QUICK)] * 3
    target = report["targets"]["your_keras_model_at_least_0.95_of_builtin"]
    assert target["met"] == (target["value"] >= 0.95)
    distances = report["weight_distance"]
    assert list(distances) == contenders[1:]
    for d in distances.values():
        assert 0 <= d["median"] <= d["max"] and d["worst_tensor"] in d["per_tensor"]
    assert distances["ResNet50 single"]["tensors"] == 320  # ResNet50's weights, BN's included
    assert distances["your keras.Model cnn, data"]["max"] < 1e-3
    assert distances["ResNet50 single"]["max"] < 1e-3
    # against fit normalising as the run does (B/K accumulated over K), BatchNormalization's
    # gap is gone: the pipeline's every tensor, data parallelism's trainable ones (each
    # replica keeps its own moving statistics)
    shared = report["weight_distance_per_share"]
    assert {k: d["shares"] for k, d in shared.items()} == {contenders[3]: 2, contenders[4]: 4}
    assert shared[contenders[4]]["max"] < 1e-3
    assert shared[contenders[3]]["median_other_tensors"] < 1e-3
    assert len(report["partition"]) == 4
    assert_pinning_recorded(report, report["cpus_allowed_list"])
    assert len(report["cpus_allowed_list"]) == 2
    assert report["threads"]["intra_op"] == 1
    assert set(report["environment"]) == SETTINGS
    assert report["environment"]["RINGTRAIN_THREADS"] == "1"


def test_steal_fraction_is_the_stolen_share_of_the_ticks_between_readings():
    from ringtrain.bench.common import steal_fraction

    assert steal_fraction((10, 1000), (15, 1100)) == pytest.approx(0.05)
    assert steal_fraction((0, 0), (0, 0)) is None  # nothing read: no claim


@pytest.mark.mpi
def test_bench_allreduce_quick(tmp_path):
    report = quick_bench("allreduce", tmp_path)
    cpus = report["machine"]["cpus"]
    assert [run["ranks"] for run in report["runs"]] == [2]  # quick: 2 ranks; a full run adds 4
    for run_ in report["runs"]:
        assert run_["oversubscribed"] == (run_["ranks"] > cpus)
        cells = {}
        for r in run_["rows"]:
            assert r["seconds"] > 0 and r["iters"] >= 5
            cells.setdefault((r["contender"], r["bytes"]), []).append(r["round"])
        contenders = (
            "horovod",
            "horovod in a step",
            "mpi4py Allreduce",
            "mpi4py Allreduce IN_PLACE",
            "ring",
        )
        copies = {n for c, n in cells if c == "memcpy"}
        assert set(cells) == {(c, n) for c in contenders for n in report["sizes"]} | {
            ("memcpy", n) for n in copies
        }
        # memcpy copies twice the last-level cache, or is dropped where that size is unknown
        assert copies == ({2 * run_["last_level_cache_bytes"]} if copies else set())
        assert all(rounds == QUICK for rounds in cells.values())
        # The self-check ran: every collective, size, round and rank, and all sums were right.
        check = run_["self_check"]
        cells_per_rank = len(contenders) * len(report["sizes"]) * len(QUICK)
        assert check["checked"] == cells_per_rank * run_["ranks"]
        assert check["failures"] == []
        assert len(run_["cpus_allowed_list"]) == run_["ranks"]
        assert_pinning_recorded(report, run_["cpus_allowed_list"])
        assert set(run_["environment"]) == SETTINGS
    for e in report["summary"]:
        assert e["algbw_GBps_median"] > 0
        if e["contender"] != "memcpy":
            assert e["reference"] in ("mpi4py Allreduce", "mpi4py Allreduce IN_PLACE")
            assert e["busbw_GBps_min"] <= e["busbw_GBps_median"] <= e["busbw_GBps_max"]
            assert len(e["vs_allreduce_per_round"]) == len(QUICK)
    assert max(report["sizes"]) >= 4 * 2**20  # the targets' sizes are measured
    assert all(isinstance(t["met"], bool) for t in report["targets"].values())


@pytest.mark.parametrize(
    "args,needle",
    [
        (["nosuch"], "invalid choice: 'nosuch'"),
        ([], "required"),
        (["allreduce", "--rounds", "2"], "at least 3 rounds"),
        (["strategies", "--rounds", "many"], "expected a whole number"),
        (["pipeline", "--png", "chart.jpg"], "name it *.png"),
        (["allreduce", "--out", "/proc/no/such/out.json"], "cannot create folder"),
        (["allreduce", "--quick", "--bogus"], "unrecognized arguments"),
        (["pipeline", "--quick", "--out", "benchmarks/results/p.json"], "never writes into"),
    ],
)
def test_bad_bench_input_exits_with_one_line(args, needle):
    one_line_error(ringtrain("bench", *args, timeout=60), needle)
