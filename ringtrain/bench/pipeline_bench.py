"""`ringtrain bench pipeline`: the pipeline schedules against one process, on the clock.

The workload is a wider transformer, about 10 ms or more of forward per microbatch on one
core, cut into 2 stages (4 for interleaving) by measured time. Three long-lived contender
processes start once: the 2 pipeline ranks (mpirun, one core each), a single process with one
thread on one core (timed on whole batches, and on 1F1B's slices of them), and a single
process with two threads on both cores. Then the contenders take turns, round after round,
each timing `steps` steps while the others sleep.

Each pipeline contender reports, beside samples/s, its bubble measured from its own trace and
the bubble and step time the simulator predicts for the timing's other steps from 3 of them
spread through it (the median of their replays, each with its own actions' times, and a link
model timed before training), and its activation memory: the peak microbatches in flight per
stage times what the executor holds for each (the stage's input plus, with saved tapes, every
element's output: an estimate, since a tape may keep a layer's intermediates too).
"""

from __future__ import annotations

import argparse
import tempfile
import textwrap
import time
from contextlib import suppress
from pathlib import Path
from statistics import median

from ringtrain.bench.common import Process, deadline, round_ratios, summarise_contenders
from ringtrain.bounded import RunFailed, end_session
from ringtrain.launch.mpirun import host_flags, mpi_env, mpirun_command
from ringtrain.pipeline.schedule import build_schedule
from ringtrain.pipeline.simulate import simulate

BATCH, LR, SEED = 128, 0.01, 0  # global batch 128: microbatches of 16 at M = 8
SAMPLES, SHAPE, CLASSES = 1024, (32, 32, 3), 10
DIM, BLOCKS = 192, 4  # transformer(dim=192, blocks=4): 6 elements
SINGLE, SINGLE_BOTH = "single 1 thread", "single 2 threads"
# pipeline contender -> (schedule, microbatches M, virtual stages V)
PIPELINES = {
    "gpipe M=2": ("gpipe", 2, 1),
    "1f1b M=2": ("1f1b", 2, 1),
    "gpipe M=8": ("gpipe", 8, 1),
    "1f1b M=8": ("1f1b", 8, 1),
    "interleaved M=8": ("interleaved", 8, 2),
    "zb-h1 M=8": ("zb-h1", 8, 1),
}
ONE_F_ONE_B = "1f1b M=8"  # what the other schedules are matched against, round by round
# The 1-thread process again, accumulating over 1F1B's microbatches: the same matrix shapes a
# stage computes, so it prices the small microbatches apart from the pipeline's own costs.
SLICES = PIPELINES[ONE_F_ONE_B][1]
SINGLE_SLICED = f"single 1 thread in {SLICES} slices"
ACCUMULATE = {SINGLE: 1, SINGLE_SLICED: SLICES, SINGLE_BOTH: 1}  # single contender -> slices
QUICK_PIPELINES = ["gpipe M=2", "1f1b M=8", "interleaved M=8", "zb-h1 M=8"]
STEPS, QUICK_STEPS = 30, 3


def _batch(text: str) -> int:
    if not text.isdigit() or int(text) < 8 or int(text) % 8:
        raise argparse.ArgumentTypeError(f"expected a multiple of 8 (M = 8), got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", help="two hosts for the two stages, e.g. node1,node2")
    parser.add_argument(
        "--batch-size", type=_batch, default=BATCH, help=f"global batch (default {BATCH})"
    )
    parser.add_argument("--label", help="names the setting in the report, e.g. 'capped 1 Gbit/s'")


def _processes(logs: Path, names: list[str], hosts: str | None, batch: int) -> dict[str, Process]:
    """The three contender processes; each binds as its users would: a rank or the 1-thread
    process to one core, the 2-thread process to both (across hosts, a node's cores)."""
    worker = "ringtrain.bench.pipeline_worker"
    placed = host_flags(hosts)  # across hosts: unbound, a node's cores are its own
    ranks = mpirun_command(
        2,
        worker,
        str(batch),
        "ranks",
        ",".join(names),
        binding=None if placed else "core",
        placement=placed,
    )
    return {
        "pipeline": Process("pipeline ranks", ranks, mpi_env(1), logs),
        SINGLE: Process(
            SINGLE,
            mpirun_command(
                1, worker, str(batch), "single", f"{SINGLE},{SINGLE_SLICED}", binding="core"
            ),
            mpi_env(1),
            logs,
        ),
        SINGLE_BOTH: Process(
            SINGLE_BOTH,
            mpirun_command(1, worker, str(batch), "single", SINGLE_BOTH, binding="none"),
            mpi_env(2),
            logs,
        ),
    }


def measure(args: argparse.Namespace) -> dict:
    """Start the three processes, then alternate every contender, round after round."""
    names = QUICK_PIPELINES if args.quick else list(PIPELINES)
    steps = QUICK_STEPS if args.quick else STEPS
    limit = time.monotonic() + deadline(args.quick)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        batch = getattr(args, "batch_size", BATCH)
        processes = _processes(Path(tmp), names, getattr(args, "hosts", None), batch)
        try:
            ready = {role: p.receive(limit) for role, p in processes.items()}
            order = [SINGLE, SINGLE_SLICED, SINGLE_BOTH, *names]
            for round_index in range(args.rounds):
                shift = round_index % len(order)
                for contender in order[shift:] + order[:shift]:
                    role = SINGLE if contender == SINGLE_SLICED else contender
                    process = processes.get(role, processes["pipeline"])
                    process.send({"cmd": "run", "contender": contender, "steps": steps})
                    reply = process.receive(limit)
                    reply["samples_per_sec"] = batch * steps / reply["seconds"]
                    rows.append({"round": round_index, **reply})
        finally:
            for p in processes.values():
                with suppress(RunFailed):
                    p.send({"cmd": "quit"})
                end_session(p.popen)
    setting = getattr(args, "label", None) or (
        f"across {args.hosts}" if getattr(args, "hosts", None) else "one host, shared memory"
    )
    return summarise(rows) | {
        "setting": setting,
        "rounds": args.rounds,
        "steps_per_measurement": steps,
        "workload": {
            "model": f"transformer(dim={DIM}, blocks={BLOCKS}) (ringtrain.models)",
            "input": list(SHAPE),
            "samples": SAMPLES,
            "global_batch": batch,
            "optimizer": f"SGD(learning_rate={LR})",
        },
        "ready": ready,
    }


def summarise(rows: list[dict]) -> dict:
    """Medians and ranges per contender, ratios to both single processes matched round by
    round, the prediction's errors, and the issue's targets."""
    summary = summarise_contenders(rows, "samples_per_sec", SINGLE, "speedup_vs_single")
    both = {r["round"]: r["samples_per_sec"] for r in rows if r["contender"] == SINGLE_BOTH}
    for entry in summary:
        mine = [r for r in rows if r["contender"] == entry["contender"]]
        entry["vs_single_2_threads_median"] = median(
            r["samples_per_sec"] / both[r["round"]] for r in mine if r["round"] in both
        )
        if "bubble_measured" not in mine[0]:
            continue
        for key in ("bubble_measured", "bubble_predicted", "step_time_measured"):
            entry[f"{key}_median"] = median(r[key] for r in mine)
        entry["step_time_predicted_median"] = median(r["step_time_predicted"] for r in mine)
        # each round's prediction against that round's own later steps
        entry["bubble_gap"] = median(
            abs(r["bubble_measured"] - r["bubble_predicted"]) for r in mine
        )
        entry["step_time_error"] = median(
            r["step_time_predicted"] / r["step_time_measured"] - 1 for r in mine
        )
        for key in ("schedule", "microbatches", "virtual_stages", "peak_inflight"):
            entry[key] = mine[0][key]
        entry["activation_bytes_peak"] = mine[0]["activation_bytes_peak"]
        entry["calibration"] = mine[0]["calibration"]
        if entry["contender"] != ONE_F_ONE_B and any(r["contender"] == ONE_F_ONE_B for r in rows):
            ratios = round_ratios(rows, "samples_per_sec", entry["contender"], ONE_F_ONE_B)
            entry["vs_1f1b_median"] = median(ratios)
    return {
        "raw": rows,
        "summary": summary,
        "targets": _targets(summary),
        "one_f_one_b_limit": _one_f_one_b_limit(rows, summary),
    }


def _one_f_one_b_limit(rows: list[dict], summary: list[dict]) -> dict | None:
    """How fast 2-stage 1F1B could be if it paid nothing but its unit-cost bubble: twice the
    1-thread process computing the same microbatches. Its distance from the whole-batch
    process is what small microbatches cost; the rest of 1F1B's gap is the pipeline's own
    (imbalance, messages, the executor, two cores sharing memory)."""
    if not any(r["contender"] == SINGLE_SLICED for r in rows):
        return None
    kind, micro, virtual = PIPELINES[ONE_F_ONE_B]
    bubble = simulate(build_schedule(kind, 2, micro, virtual)).bubble
    sliced = median(round_ratios(rows, "samples_per_sec", SINGLE_SLICED, SINGLE))
    both = median(round_ratios(rows, "samples_per_sec", SINGLE_BOTH, SINGLE))
    limit = 2 * (1 - bubble) * sliced
    by_name = {e["contender"]: e for e in summary}
    one = by_name.get(ONE_F_ONE_B)
    return {
        "unit_bubble": bubble,
        "sliced_vs_single_1_thread": sliced,
        "limit_vs_single_1_thread": limit,
        "limit_vs_single_2_threads": limit / both,
        "one_f_one_b_of_limit": one["speedup_vs_single_median"] / limit if one else None,
    }


def _targets(summary: list[dict]) -> dict[str, bool]:
    by_name = {e["contender"]: e for e in summary}
    pipelines = [e for e in summary if "bubble_gap" in e]
    one, zero = by_name.get(ONE_F_ONE_B), by_name.get("zb-h1 M=8")
    targets = {
        "bubble_within_0.03_for_every_schedule": all(e["bubble_gap"] <= 0.03 for e in pipelines),
        "step_time_within_10pct_for_every_schedule": all(
            abs(e["step_time_error"]) <= 0.10 for e in pipelines
        ),
    }
    if one is not None:
        targets["1f1b_M8_at_least_1.5x_single_1_thread"] = one["speedup_vs_single_median"] >= 1.5
        targets["1f1b_M8_beats_single_2_threads"] = one["vs_single_2_threads_median"] > 1.0
    if one is not None and zero is not None:
        targets["zb-h1_bubble_below_1f1b"] = (
            zero["bubble_measured_median"] < one["bubble_measured_median"]
        )
        targets["zb-h1_at_least_1f1b_samples_per_sec"] = zero["vs_1f1b_median"] >= 1.0
    return targets


def describe(report: dict) -> list[str]:
    lines = []
    for e in report["summary"]:
        line = (
            f"{e['contender']:>16}: {e['samples_per_sec_median']:8.1f} samples/s "
            f"({e['speedup_vs_single_median']:.2f}x 1 thread, "
            f"{e['vs_single_2_threads_median']:.2f}x 2 threads)"
        )
        if "bubble_gap" in e:
            line += (
                f"  bubble {e['bubble_measured_median']:.3f} measured, "
                f"{e['bubble_predicted_median']:.3f} predicted; step "
                f"{e['step_time_measured_median'] * 1e3:.1f} ms measured, "
                f"{e['step_time_predicted_median'] * 1e3:.1f} ms predicted"
            )
        lines.append(line)
    limit = report.get("one_f_one_b_limit")
    if limit:
        lines.append(
            f"1F1B M=8 limit at these microbatches: {limit['limit_vs_single_1_thread']:.2f}x "
            f"1 thread ({limit['limit_vs_single_2_threads']:.2f}x 2 threads)"
        )
    lines += [f"target {k}: {'met' if v else 'NOT met'}" for k, v in report["targets"].items()]
    return lines


def draw(report: dict, path: str) -> None:
    """Bubble measured and predicted per schedule, and throughput over one process."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pipes = [e for e in report["summary"] if "bubble_gap" in e]
    names = [e["contender"] for e in pipes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    x = range(len(pipes))
    left.bar(
        [i - 0.2 for i in x], [e["bubble_measured_median"] for e in pipes], 0.4, label="measured"
    )
    left.bar(
        [i + 0.2 for i in x], [e["bubble_predicted_median"] for e in pipes], 0.4, label="predicted"
    )
    left.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    left.set(ylabel="bubble", title="bubble, P=2")
    left.legend(fontsize=8)
    every = report["summary"]
    right.bar(range(len(every)), [e["speedup_vs_single_median"] for e in every])
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_xticks(
        range(len(every)), [e["contender"] for e in every], rotation=30, ha="right", fontsize=8
    )
    right.set(ylabel="samples/s over 1 thread", title="throughput over one process")
    fig.suptitle(textwrap.fill(report["setting"], 110), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
