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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING

from ringtrain.bench.common import Turns, deadline
from ringtrain.bench.strategies import free_ports
from ringtrain.bounded import RunFailed, end_session, last_words, start_session
from ringtrain.launch.mpirun import host_flags, mpi_env, mpirun_command
from ringtrain.plan.costmodel import roofline

if TYPE_CHECKING:
    import keras

    from ringtrain.data import Dataset

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
LAUNCH = "ringtrain"  # the launch of ringtrain's contenders, first in the turn order
# TensorFlow's MultiWorkerMirrored, tuned as `bench strategies` tunes it: RING collectives,
# inter-op threads 1 and 2 (the faster counts); a quick run keeps the one that sweep chose.
MWMS_INTER_OPS, QUICK_MWMS_INTER_OPS = (1, 2), (2,)
ROOFLINE_TARGET = 0.9  # the share of the no-overlap limit a data-parallel step should reach


def roofline_verdict(fraction: float) -> str:
    """The verdict on a step at `fraction` of its no-overlap limit (limit / step): "met",
    "missed" or "roofline error". A step faster than its own limit (fraction above 1) shows
    the limit is wrong for that case: its terms, timed alone, ran slower than inside the step.
    That says nothing of how close the step came to a true limit, so it never counts as met."""
    if fraction > 1:
        return "roofline error"
    return "met" if fraction >= ROOFLINE_TARGET else "missed"


def launch_name(inter_op: int) -> str:
    """The launch of MWMS workers with `inter_op` inter-op threads."""
    return f"mwms-{inter_op}"


@dataclass(frozen=True)
class Workload:
    """A model on synthetic data, and why it is in the sweep."""

    name: str
    regime: str
    shape: tuple[int, ...]
    batch: int  # global
    samples: int
    build: Callable[[tuple[int, ...], int], keras.Model]

    def model(self, data: Dataset) -> keras.Model:
        """A new copy of the workload's model, from the same weights every time."""
        return self.build(data.input_shape, data.n_classes)


def _cnn(shape: tuple[int, ...], classes: int) -> keras.Model:
    from ringtrain.models import cnn

    return cnn(shape, classes)


def _heavy_cnn(shape: tuple[int, ...], classes: int) -> keras.Model:
    """Wide convolutions at full resolution: much compute for few gradient bytes."""
    import keras

    from ringtrain.models import FlatDense, layer_names, sequential

    conv, name = keras.layers.Conv2D, layer_names()
    layers = [
        conv(48, 3, padding="same", activation="relu", name=next(name)),
        conv(48, 3, padding="same", activation="relu", name=next(name)),
        conv(32, 3, strides=4, padding="same", activation="relu", name=next(name)),
        FlatDense(classes, name=next(name)),
    ]
    return sequential("heavy_cnn", shape, layers, seed=0)


def _wide_mlp(shape: tuple[int, ...], classes: int) -> keras.Model:
    """Four 1024-wide dense layers on small inputs: gradient bytes spread evenly over the
    layers, so the backward releases them steadily, and about as long to move across a
    1 Gbit/s link (14 MB) as a rank's compute on its 1024 examples takes."""
    from ringtrain.models import mlp

    return mlp(shape, classes, widths=(1024, 1024, 1024, 1024))


WORKLOADS = {
    w.name: w
    for w in (
        Workload("cnn", "latency-bound", (32, 32, 3), 64, 1024, _cnn),
        Workload("heavy-cnn", "compute-bound", (32, 32, 3), 64, 1024, _heavy_cnn),
        Workload("wide-mlp", "balanced", (16, 16, 1), 2048, 8192, _wide_mlp),
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
    hosts = args.hosts.split(",") if getattr(args, "hosts", None) else ["localhost"] * 2
    folder = Path(tempfile.mkdtemp(prefix="ringtrain-bench-dp-"))
    reports = []
    inter_ops = QUICK_MWMS_INTER_OPS if args.quick else MWMS_INTER_OPS
    order = [LAUNCH, *(launch_name(i) for i in inter_ops)]
    for workload in map(WORKLOADS.get, args.workloads):
        turns = folder / f"turns-{workload.name}"
        turns.mkdir()
        shared = [str(args.rounds), str(steps)]
        tail = [str(turns), ",".join(order)]
        out = folder / f"{workload.name}.json"
        launches = {
            LAUNCH: (
                mpirun_command(
                    2, "ringtrain.bench.roofline_worker", workload.name, *shared, str(out), *tail
                ),
                out,
            )
        }
        for inter in inter_ops:
            mwms_out = folder / f"{workload.name}-{launch_name(inter)}.json"
            addresses = ",".join(f"{h}:{p}" for h, p in zip(hosts, free_ports(2), strict=True))
            launches[launch_name(inter)] = (
                mpirun_command(
                    2,
                    "ringtrain.bench.roofline_mwms_worker",
                    workload.name,
                    *shared,
                    str(inter),
                    addresses,
                    *tail,
                    str(mwms_out),
                ),
                mwms_out,
            )
        for command, _ in launches.values():
            command[1:1] = extra
        failures = run_in_turns(
            {name: c for name, (c, _) in launches.items()},
            Turns(turns, order, LAUNCH),
            folder,
            deadline(args.quick),
        )
        mwms = {
            name: json.loads(o.read_text()) if name not in failures else {"failed": failures[name]}
            for name, (_, o) in launches.items()
            if name != LAUNCH
        }
        reports.append(summarise(json.loads(out.read_text()), mwms))
    setting = getattr(args, "label", None) or (
        f"across {args.hosts}" if getattr(args, "hosts", None) else "one host, shared memory"
    )
    return {
        "setting": setting,
        "rounds": args.rounds,
        "steps_per_round": steps,
        # this machine's interpreter path is no part of the result
        "launch": [*command[: command.index("-m") - 1], "python"],
        "workloads": reports,
    }


def run_in_turns(
    launches: dict[str, list[str]], turns: Turns, folder: Path, timeout: float
) -> dict[str, str]:
    """Start every launch at once (they take turns among themselves); ringtrain's must
    succeed, a TensorFlow one may fail, and is then marked so nobody waits for it. Returns the
    failed launches' last words."""
    logs = {name: folder / f"{name}.log" for name in launches}
    running = {
        name: start_session(cmd, mpi_env(1), stderr=open(logs[name], "w"))  # noqa: SIM115
        for name, cmd in launches.items()
    }
    failures: dict[str, str] = {}
    until = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in running.values()):
            if time.monotonic() > until:
                raise RunFailed(f"bench dp did not finish within {timeout:.0f} s")
            for name, process in running.items():
                if process.poll() not in (None, 0) and name not in failures:
                    if name == LAUNCH:
                        raise RunFailed(f"the benchmark ranks failed: {last_words(logs[name])}")
                    failures[name] = last_words(logs[name])
                    turns.failed(name)
            time.sleep(0.2)
    finally:
        for process in running.values():
            end_session(process)
    if running[LAUNCH].returncode != 0:
        raise RunFailed(f"the benchmark ranks failed: {last_words(logs[LAUNCH])}")
    return failures


def summarise(report: dict, mwms: dict[str, dict]) -> dict:
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
    no_overlap, full_overlap = roofline(compute, allreduce)
    tf_ms = {
        f"MWMS tuned, inter-op {m['inter_op']}": median(m["ms"]) for m in mwms.values() if "ms" in m
    }
    for r, row in enumerate(rows):
        row |= {
            f"MWMS tuned, inter-op {m['inter_op']}": m["ms"][r] for m in mwms.values() if "ms" in m
        }
    tf_best = min(tf_ms.values(), default=None)
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
            **tf_ms,
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
            **({"ringtrain over tuned MWMS (speed)": tf_best / best} if tf_best else {}),
        },
        "mwms": {name: {k: v for k, v in m.items() if k != "ms"} for name, m in mwms.items()},
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
            + "".join(f", {k} {v:.2f}" for k, v in ms.items() if k.startswith("MWMS"))
        )
        lines += [
            f"    {name} failed: {m['failed']}" for name, m in w["mwms"].items() if "failed" in m
        ]
        verdict = roofline_verdict(ratios["roofline (no-overlap / ringtrain)"])
        lines.append(
            "    "
            + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
            + f"; roofline target {ROOFLINE_TARGET}: {verdict}; first bucket in at "
            f"{trace['bucket_arrival_ms'][0]:.2f} ms, backward done at "
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
        tf_runs = [v for k, v in w["ms"].items() if k.startswith("MWMS")]
        values += [min(tf_runs)] if tf_runs else []
        colors = ["tab:blue", "tab:cyan", "tab:gray", "tab:orange"][: len(values)]
        ax.bar(range(len(values)), values, color=colors)
        for limit, style in (("no-overlap limit", "--"), ("full-overlap limit", ":")):
            ax.axhline(w["ms"][limit], color="black", linestyle=style, label=limit)
        labels = ["ringtrain", "bucketed", "plain hvd", "MWMS tuned"][: len(values)]
        ax.set_xticks(range(len(values)), labels)
        ax.set_title(f"{w['workload']} ({w['regime']})")
        ax.set_ylabel("ms per step")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"data parallel, 2 ranks: {result['setting']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
