"""`ringtrain bench dp`: data parallelism against its roofline, on three workloads.

For each workload one 2-rank mpirun measures, alternating round by round: the compute of one
rank's half batch, the MPI_Allreduce of the gradient bytes (the better of in place and out of
place), ringtrain's step as `ringtrain train` runs it (with and without --bucket-mb), a plain
Horovod step, and one process on the whole batch. From compute C and allreduce A it prints two
limits: no overlap (C + A) and full overlap (max(C, A)), beside the measured step and where
its time went. `--hosts a,b` runs the ranks on two nodes (e.g. of `ringtrain cluster`) instead
of this host's shared memory.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING

from ringtrain.bench.common import deadline, host_flags, mpi_env, mpirun_command, run_bounded

if TYPE_CHECKING:
    from ringtrain.data import Dataset
    from ringtrain.models import ModelSpec

BUCKET_MB = 1.0  # PyTorch DDP's first bucket is 1 MB too: small enough to start early
CONTENDERS = [
    "single",
    "compute per rank",
    "MPI_Allreduce",
    "ringtrain",
    "ringtrain bucketed",
    "plain Horovod",
]
STEPS, QUICK_STEPS = 30, 5


@dataclass(frozen=True)
class Workload:
    """A model on synthetic data, and why it is in the sweep."""

    name: str
    regime: str
    shape: tuple[int, ...]
    batch: int  # global
    samples: int
    build: Callable[[tuple[int, ...], int], ModelSpec]

    def spec(self, data: Dataset) -> ModelSpec:
        return self.build(data.input_shape, data.n_classes)


def _cnn(shape: tuple[int, ...], classes: int) -> ModelSpec:
    from ringtrain.models import cnn

    return cnn(shape, classes)


def _heavy_cnn(shape: tuple[int, ...], classes: int) -> ModelSpec:
    """Wide convolutions at full resolution: much compute for few gradient bytes."""
    import keras

    from ringtrain.models import FlatDense, ModelSpec, _named

    conv = keras.layers.Conv2D
    return ModelSpec(
        shape,
        _named(
            [
                lambda n: conv(48, 3, padding="same", activation="relu", name=n),
                lambda n: conv(48, 3, padding="same", activation="relu", name=n),
                lambda n: conv(32, 3, strides=4, padding="same", activation="relu", name=n),
                lambda n: FlatDense(classes, name=n),
            ]
        ),
    )


def _wide_mlp(shape: tuple[int, ...], classes: int) -> ModelSpec:
    """Wide dense layers: gradient bytes that take about as long to move across a 1 Gbit/s
    link as their compute takes."""
    from ringtrain.models import mlp

    return mlp(shape, classes, widths=(768, 768, 768))


WORKLOADS = {
    w.name: w
    for w in (
        Workload("cnn", "latency-bound", (32, 32, 3), 64, 1024, _cnn),
        Workload("heavy-cnn", "compute-bound", (32, 32, 3), 64, 1024, _heavy_cnn),
        Workload("wide-mlp", "balanced", (32, 32, 3), 512, 4096, _wide_mlp),
    )
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", help="two hosts for the two ranks, e.g. node1,node2")
    parser.add_argument("--label", help="names the setting in the report, e.g. 'capped 1 Gbit/s'")
    parser.add_argument(
        "--workloads",
        type=_workloads,
        default=list(WORKLOADS),
        help=f"a comma-separated subset of {','.join(WORKLOADS)} (default: all)",
    )


def _workloads(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown workload {unknown[0]!r}; choose from {', '.join(WORKLOADS)}"
        )
    return names


def measure(args: argparse.Namespace) -> dict:
    """One mpirun per workload; their reports, summarised."""
    steps = QUICK_STEPS if args.quick else STEPS
    extra = host_flags(getattr(args, "hosts", None))
    folder = Path(tempfile.mkdtemp(prefix="ringtrain-bench-dp-"))
    reports = []
    for workload in map(WORKLOADS.get, args.workloads):
        out = folder / f"{workload.name}.json"
        command = mpirun_command(
            2,
            "ringtrain.bench.roofline_worker",
            workload.name,
            str(args.rounds),
            str(steps),
            str(out),
        )
        command[1:1] = extra
        run_bounded(command, mpi_env(1), deadline(args.quick), folder / "ranks.log")
        reports.append(summarise(json.loads(out.read_text())))
    setting = getattr(args, "label", None) or (
        f"across {args.hosts}" if getattr(args, "hosts", None) else "one host, shared memory"
    )
    return {
        "setting": setting,
        "rounds": args.rounds,
        "steps_per_round": steps,
        "launch": command[: command.index("-m")],
        "workloads": reports,
    }


def summarise(report: dict) -> dict:
    """Medians over rounds, the roofline and the ratios the issue's targets read."""
    rows = report["rounds"]

    def mid(key: str) -> float:
        return median(r[key] for r in rows if key in r)

    compute = mid("compute per rank")
    allreduce = min(mid("MPI_Allreduce in_place"), mid("MPI_Allreduce out_of_place"))
    ringtrain, bucketed, plain, single = (
        mid(k) for k in ("ringtrain", "ringtrain bucketed", "plain Horovod", "single")
    )
    breakdown = {
        k: median(r["ringtrain breakdown"][k] for r in rows) for k in rows[0]["ringtrain breakdown"]
    }
    best = min(ringtrain, bucketed)
    no_overlap, full_overlap = compute + allreduce, max(compute, allreduce)
    return {
        **{k: report[k] for k in ("workload", "global_batch", "gradient_bytes", "buckets")},
        "regime": WORKLOADS[report["workload"]].regime,
        **{k: report[k] for k in ("link_mb_s", "hosts", "overlap_trace", "ranks")},
        "horovod_timeline_ms_per_step": report["horovod_timeline_ms_per_step"],
        "ms": {
            "single": single,
            "compute per rank": compute,
            "MPI_Allreduce in place": mid("MPI_Allreduce in_place"),
            "MPI_Allreduce out of place": mid("MPI_Allreduce out_of_place"),
            "ringtrain": ringtrain,
            "ringtrain bucketed": bucketed,
            "plain Horovod": plain,
            "no-overlap limit": no_overlap,
            "full-overlap limit": full_overlap,
        },
        "ringtrain_breakdown_ms": breakdown,
        "ratios": {
            "efficiency (single / 2 x ringtrain)": single / (2 * best),
            "roofline (no-overlap / ringtrain)": no_overlap / best,
            "ringtrain / plain Horovod (step time)": best / plain,
            "overhead beyond compute + MPI_Allreduce (ms)": best - no_overlap,
            "bucketed gain over no-overlap limit": no_overlap / bucketed - 1,
        },
        "rounds": rows,
    }


def describe(result: dict) -> list[str]:
    lines = [f"bench dp, {result['setting']} (ms per step, medians):"]
    for w in result["workloads"]:
        ms, ratios = w["ms"], w["ratios"]
        trace = w["overlap_trace"]
        lines.append(
            f"  {w['workload']}: compute {ms['compute per rank']:.2f}, MPI_Allreduce "
            f"{min(ms['MPI_Allreduce in place'], ms['MPI_Allreduce out of place']):.2f} "
            f"({w['gradient_bytes'] / 1e6:.2f} MB), limits {ms['no-overlap limit']:.2f} / "
            f"{ms['full-overlap limit']:.2f}; ringtrain {ms['ringtrain']:.2f}, bucketed "
            f"{ms['ringtrain bucketed']:.2f}, plain Horovod {ms['plain Horovod']:.2f}, "
            f"single {ms['single']:.2f}"
        )
        lines.append(
            "    "
            + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
            + f"; first bucket in at {trace['bucket_arrival_ms'][0]:.2f} ms, backward done at "
            f"{trace['backward_end_ms']:.2f} ms"
        )
    return lines


def draw(result: dict, path: str) -> None:
    """Per workload: the measured steps against the two limits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["ringtrain", "ringtrain bucketed", "plain Horovod"]
    workloads = result["workloads"]
    fig, grid = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.5), squeeze=False)
    axes = grid[0]
    for ax, w in zip(axes, workloads, strict=True):
        values = [w["ms"][n] for n in names]
        ax.bar(range(len(names)), values, color=["tab:blue", "tab:cyan", "tab:gray"])
        for limit, style in (("no-overlap limit", "--"), ("full-overlap limit", ":")):
            ax.axhline(w["ms"][limit], color="black", linestyle=style, label=limit)
        ax.set_xticks(range(len(names)), ["ringtrain", "bucketed", "plain hvd"])
        ax.set_title(f"{w['workload']} ({w['regime']})")
        ax.set_ylabel("ms per step")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"data parallel, 2 ranks: {result['setting']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
