"""`ringtrain bench allreduce`: what the gradient exchange can move, per message size.

Contenders: Horovod's allreduce called from Python on a tensor Python holds (out of place) and
inside a compiled step on a tensor the step made (in place, as `--strategy data` calls it: see
horovod_in_step), mpi4py's Allreduce on numpy buffers out of place and in place (the MPI library
alone; the faster of the two at each size is the reference every ratio is taken against), and
ringtrain's hand-written ring (ring.py); np.copyto on one rank, of twice the last-level cache,
gives the memory bandwidth that bounds them all on one machine. 2 ranks, then 4 (more ranks than
cores here, so marked oversubscribed); a quick run takes 2 only. Bus bandwidth, size/time x
2(N-1)/N, is what each link carries in a ring, so it is comparable across rank counts. Every
collective's result is checked after its timing; a wrong sum fails the bench. Pinning: nobody is
bound (`--bind-to none`), every rank's Cpus_allowed_list is recorded, with the settings (cycle
time, yield, threads) the ranks ran with.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from statistics import median

from ringtrain.bench.common import UNBOUND, deadline, pinning, spread, summarise_contenders
from ringtrain.bounded import RunFailed, run_bounded
from ringtrain.launch.mpirun import mpi_env, mpirun_command

KiB, MiB = 1024, 1024 * 1024
SIZES = [4 * KiB * 4**k for k in range(8)]  # 4 KiB .. 64 MiB
QUICK_SIZES = [4 * KiB, 256 * KiB, 4 * MiB]
RANKS = [2, 4]
QUICK_RANKS = [2]  # a smoke run: 4 ranks run the same worker at twice the start-up cost
MPI_CALLS = ("mpi4py Allreduce", "mpi4py Allreduce IN_PLACE")  # the faster is the reference
HOROVOD_CALLS = ("horovod", "horovod in a step")  # from Python, and inside a compiled step
# x the faster MPI call's busbw, from TARGET_BYTES up
TARGETS = {"horovod": 0.9, "horovod in a step": 0.9, "ring": 0.7}
TARGET_BYTES = 4 * MiB


def measure(args: argparse.Namespace) -> dict:
    """One mpirun per rank count; inside each, the contenders alternate round by round."""
    sizes, rank_counts = (QUICK_SIZES, QUICK_RANKS) if args.quick else (SIZES, RANKS)
    budget, max_iters = (16 * MiB, 100) if args.quick else (256 * MiB, 400)
    limit = time.monotonic() + deadline(args.quick)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in rank_counts:
            raw_path = Path(tmp) / f"raw{ranks}.json"
            cmd = mpirun_command(
                ranks,
                "ringtrain.bench.allreduce_worker",
                str(raw_path),
                str(args.rounds),
                ",".join(map(str, sizes)),
                str(budget),
                str(max_iters),
                binding=UNBOUND,
            )
            log = Path(tmp) / f"ranks{ranks}.log"
            run_bounded(cmd, mpi_env(threads=1), limit - time.monotonic(), log)
            raw = json.loads(raw_path.read_text())
            _passed_self_check(raw)
            runs.append(raw | {"oversubscribed": ranks > (os.cpu_count() or 1)})
    return summarise(runs) | {
        "rounds": args.rounds,
        "sizes": sizes,
        "budget_bytes": budget,
        "pinning": pinning(),
        "reference": f"per size, the faster (by median) of {' and '.join(MPI_CALLS)}",
    }


def _passed_self_check(raw: dict) -> None:
    """A benchmark whose collectives gave a wrong sum measured nothing: stop, in one line."""
    failures = raw["self_check"]["failures"]
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise RunFailed(f"allreduce self-check failed, {raw['ranks']} ranks: {failures[0]}{more}")


def _with_bandwidths(run: dict) -> list[dict]:
    """algbw = size/time; busbw scales it by 2(N-1)/N, the share each rank sends in a ring."""
    n = run["ranks"]
    rows = []
    for r in run["rows"]:
        algbw = r["bytes"] / r["seconds"] / 1e9
        busbw = algbw * 2 * (n - 1) / n if r["contender"] != "memcpy" else None
        rows.append(r | {"ranks": n, "algbw_GBps": algbw, "busbw_GBps": busbw})
    return rows


def faster_mpi(at_size: list[dict]) -> str | None:
    """The MPI call with the higher median bandwidth among these rows (None if neither ran)."""
    medians = {
        call: median(r["algbw_GBps"] for r in at_size if r["contender"] == call)
        for call in MPI_CALLS
        if any(r["contender"] == call for r in at_size)
    }
    return max(medians, key=medians.get) if medians else None


def summarise(runs: list[dict]) -> dict:
    summary = []
    for run in runs:
        rows = _with_bandwidths(run)
        for nbytes in dict.fromkeys(r["bytes"] for r in rows):
            at_size = [r for r in rows if r["bytes"] == nbytes]
            reference = faster_mpi(at_size)
            for entry in summarise_contenders(at_size, "algbw_GBps", reference, "vs_allreduce"):
                busbw = [r["busbw_GBps"] for r in at_size if r["contender"] == entry["contender"]]
                if None not in busbw:
                    entry |= {f"busbw_GBps_{k}": v for k, v in spread(busbw).items()}
                summary.append(
                    {
                        "ranks": run["ranks"],
                        "oversubscribed": run["oversubscribed"],
                        "bytes": nbytes,
                        "reference": reference,
                    }
                    | entry
                )
    return {"runs": runs, "summary": summary, "targets": _targets(summary)}


def _targets(summary: list[dict]) -> dict:
    """Judged on ranks that have a core each, at sizes where bandwidth, not latency, rules."""
    judged = [e for e in summary if not e["oversubscribed"] and e["bytes"] >= TARGET_BYTES]
    targets = {}
    for contender, threshold in TARGETS.items():
        ratios = [e["vs_allreduce_median"] for e in judged if e["contender"] == contender]
        targets[f"{contender}_busbw_at_least_{threshold}x_allreduce_from_4MiB"] = {
            "threshold": threshold,
            "worst_median_ratio": min(ratios) if ratios else None,
            "judged_on": sorted({(e["ranks"], e["bytes"]) for e in judged}),
            "met": bool(ratios) and min(ratios) >= threshold,
        }
    return targets


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def describe(report: dict) -> list[str]:
    lines = []
    for e in report["summary"]:
        over = " (oversubscribed)" if e["oversubscribed"] else ""
        if e["contender"] == "memcpy":
            lines.append(
                f"{e['ranks']} ranks{over}: memcpy of {size_label(e['bytes'])} (2x last-level "
                f"cache) on rank 0: {e['algbw_GBps_median']:.3g} GB/s copied"
            )
            continue
        rate = f"{e['busbw_GBps_median']:8.3g} GB/s busbw ({e['vs_allreduce_median']:.2f}x)"
        lines.append(
            f"{e['ranks']} ranks{over} {size_label(e['bytes']):>8} {e['contender']:>25}: {rate}"
        )
    lines.append(f"ratios are to {report['reference']}")
    for name, t in report["targets"].items():
        lines.append(f"target {name}: {'met' if t['met'] else 'NOT met'}")
    return lines


def draw(report: dict, path: str) -> None:
    """Bus bandwidth against size (memcpy as the ceiling), and the ratio to the faster MPI call."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {"horovod": "tab:blue", MPI_CALLS[0]: "tab:green", MPI_CALLS[1]: "tab:olive"}
    colours |= {"horovod in a step": "tab:purple", "ring": "tab:orange"}
    for ranks, style in zip(RANKS, ("o-", "x--"), strict=True):
        mine = [e for e in report["summary"] if e["ranks"] == ranks]
        over = ", oversubscribed" if mine and mine[0]["oversubscribed"] else ""
        for contender, colour in colours.items():
            rows = [e for e in mine if e["contender"] == contender]
            sizes = [e["bytes"] for e in rows]
            label = f"{contender}, {ranks} ranks{over}"
            left.plot(
                sizes, [e["busbw_GBps_median"] for e in rows], style, color=colour, label=label
            )
            ratios = [e["vs_allreduce_median"] for e in rows]
            right.plot(sizes, ratios, style, color=colour, label=label)
        for e in mine:
            if e["contender"] == "memcpy":
                left.axhline(
                    e["algbw_GBps_median"],
                    color="grey",
                    ls=style[1:],
                    label=f"memcpy {size_label(e['bytes'])}, 1 rank (of {ranks})",
                )
    for threshold in TARGETS.values():
        right.axhline(threshold, color="grey", lw=0.8, ls=":")
    sizes = report["sizes"]
    for axes in (left, right):
        axes.set_xscale("log")
        axes.set_xticks(sizes, [size_label(n) for n in sizes], fontsize=7)
        axes.minorticks_off()
        axes.set_xlabel("message size (float32)")
    left.set(yscale="log", ylabel="GB/s", title="bus bandwidth (memcpy: copy bandwidth)")
    right.set(
        ylabel="busbw / faster MPI call", title="ratio to the faster MPI call (dotted: targets)"
    )
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
