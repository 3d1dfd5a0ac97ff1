"""Regenerate every measured figure of the docs from benchmarks/results/*.json: the performance
pages' tables (docs/performance/*.md, between BEGIN and END) and the inline figures of README.md
and docs/**/*.md (`<!-- fig: NAME -->...<!-- /fig -->`, NAME a key of FIGURES).

    python benchmarks/docs_tables.py          # rewrites every block and inline figure
    python benchmarks/docs_tables.py --check  # exit 1 naming every page that is out of date
Numbers are never typed by hand: this script is the only writer of those blocks and figures,
and tests/test_figures.py fails on a measured figure anywhere else in the docs.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from ringtrain.bench.allreduce import HOROVOD_CALLS, MPI_CALLS, TARGET_BYTES, size_label
from ringtrain.bench.plan_check import SPEED_TOLERANCE
from ringtrain.bench.roofline import ROOFLINE_TARGET, roofline_verdict
from ringtrain.plan.cli import in_sample

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = DOCS / "performance"
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
# An inline figure: the generator rewrites TEXT from FIGURES[NAME]; tests/test_figures.py skips it.
SPAN = re.compile(r"(<!-- fig: (?P<name>[^>]+?) -->)(?P<text>.*?)(<!-- /fig -->)", re.S)
ROOFLINE = "roofline (no-overlap / ringtrain)"


def doc_files() -> list[Path]:
    """README.md and every page of the site: where inline figures may stand."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def result(name: str) -> dict:
    """benchmarks/results/NAME.json."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def _range(entry: dict, metric: str, fmt: str = ".0f") -> str:
    return (
        f"{entry[f'{metric}_median']:{fmt}} ({entry[f'{metric}_min']:{fmt}}–"
        f"{entry[f'{metric}_max']:{fmt}})"
    )


def _span(values: list[float], fmt: str) -> str:
    """`low–high` of the values, or one figure when they print alike."""
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}–{high}"


def machine(facts: dict) -> str:
    """The cores and CPU, and what a hypervisor took of them while the bench ran."""
    text = f"{facts['cpus']} cores ({facts['cpu_model']})"
    steal = facts.get("cpu_steal_fraction")
    return text if steal is None else f"{text}, {steal:.1%} of CPU time stolen by the hypervisor"


def _mode(report: dict) -> str:
    return " (quick mode)" if report["quick"] else ""


def pipeline_table(report: dict) -> str:
    lines = [
        "| contender | samples/s (median, min–max) | × 1 thread (per round) | × 2 threads "
        "| bubble measured "
        "| bubble predicted | bubble gap | step ms measured / predicted | step error | "
        "peak in-flight per stage | activation MB per stage at peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in report["summary"]:
        rate = _range(e, "samples_per_sec")
        rounds = _span(e["speedup_vs_single_per_round"], ".2f")
        ratios = (
            f"{e['speedup_vs_single_median']:.2f} ({rounds}) | "
            f"{e['vs_single_2_threads_median']:.2f}"
        )
        if "bubble_gap" not in e:
            lines.append(f"| {e['contender']} | {rate} | {ratios} | | | | | | | |")
            continue
        memory = ", ".join(f"{b / 1e6:.1f}" for b in e["activation_bytes_peak"])
        lines.append(
            f"| {e['contender']} | {rate} | {ratios} | {e['bubble_measured_median']:.3f} | "
            f"{e['bubble_predicted_median']:.3f} | {e['bubble_gap']:.3f} | "
            f"{e['step_time_measured_median'] * 1e3:.0f} / "
            f"{e['step_time_predicted_median'] * 1e3:.0f} | {e['step_time_error']:+.0%} | "
            f"{e['peak_inflight']} | {memory} |"
        )
    met = ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in report["targets"].items())
    facts, work = report["machine"], report["workload"]
    intro = (
        f"`ringtrain bench pipeline`, {report['setting']}, on {machine(facts)}: "
        f"{work['model']} on synthetic "
        f"{'×'.join(map(str, work['input']))}, global batch {work['global_batch']}, P=2 ranks "
        f"of one thread each (bound to a core each), against one process with one thread (one "
        f"core) and with two (both cores); medians of {report['rounds']} alternating rounds of "
        f"{report['steps_per_measurement']} steps{_mode(report)}. Each timing predicts its "
        "other steps from 3 of its own, spread through it (the 1st, 11th and 21st of 30: the "
        "median of their replays, each with its own action times, and a link model timed "
        "before training); the gap and the error (predicted over "
        "measured step, less 1) are the medians of each round's prediction against that "
        "round's measurement."
    )
    limit = _one_f_one_b_limit(report)
    return "\n".join([intro, "", *lines, "", *limit, f"Targets: {met}."])


def _one_f_one_b_limit(report: dict) -> list[str]:
    """The sentence on 1F1B's limit at this microbatch size, where the run measured it."""
    limit = report.get("one_f_one_b_limit")
    if not limit:
        return []
    reached = limit["one_f_one_b_of_limit"]
    return [
        f"1F1B M=8's limit at this microbatch size is {limit['limit_vs_single_1_thread']:.2f}x "
        f"one thread: twice the one-thread process computing the batch in the same 8 slices "
        f"({limit['sliced_vs_single_1_thread']:.2f} of its whole-batch speed), less the "
        f"unit-cost bubble of {limit['unit_bubble']:.3f}. That is "
        f"{limit['limit_vs_single_2_threads']:.2f}x the two-thread process"
        + ("" if reached is None else f"; 1F1B M=8 reached {reached:.2f} of the limit")
        + ".",
        "",
    ]


def simulated_stages_table() -> str:
    """What more stages would add, which 2 cores cannot measure: the simulator at unit costs."""
    from ringtrain.pipeline.schedule import build_schedule
    from ringtrain.pipeline.simulate import simulate

    kinds = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
    cells = [(p, m) for p in (2, 4, 8) for m in (8, 32)]
    lines = [
        "| schedule | " + " | ".join(f"P={p} M={m}" for p, m in cells) + " |",
        "|---|" + "---|" * len(cells),
    ]
    for kind, virtual in kinds:
        row = []
        for p, m in cells:
            result = simulate(build_schedule(kind, p, m, virtual))
            row.append(f"{result.bubble:.3f} (peak {result.peak_inflight[0]})")
        label = f"{kind} V={virtual}" if virtual > 1 else kind
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    intro = (
        "**Simulated, not measured**: the bubble of each schedule at more stages, from "
        "`ringtrain schedule` at unit costs (F = B = 1 per rank's share, BI = BW = B/2, free "
        "messages), with stage 0's peak microbatches in flight (its activation memory)."
    )
    return "\n".join([intro, "", *lines])


def _tuned(chosen: dict | None) -> str:
    if chosen is None:
        return "none (every candidate failed)"
    return f"{chosen['implementation']} and {chosen['inter_op']} inter-op thread(s)"


def strategies_table(report: dict) -> str:
    threads = report["threads"]
    lines = [
        "| contender | processes (intra/inter-op threads) | samples/s (median, min–max) |"
        " × single |",
        "|---|---|---|---|",
    ]
    for e in report["summary"]:
        processes = " + ".join(
            f"{n} × {kind} ({threads[kind]['intra_op']}/{threads[kind]['inter_op']})"
            for n, kind in report["processes_per_contender"][e["contender"]]
        )
        lines.append(
            f"| {e['contender']} | {processes} | {_range(e, 'samples_per_sec')} | "
            f"{e['speedup_vs_single_median']:.2f} |"
        )
    lines += ["", "| ratio, per round | median (min–max) |", "|---|---|"]
    for name, r in report["ratios"].items():
        lines.append(f"| {name} | {r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f}) |")
    verdicts = []
    for name, t in report["targets"].items():
        if t["met"] is None:
            verdicts.append(f"{name}: not measured ({t['why_not_measured']})")
        else:
            verdicts.append(f"{name}: {t['value']:.2f}, {'met' if t['met'] else 'NOT met'}")
    failed = [f"{name} did not run: {why}." for name, why in report["failures"].items()]
    facts, w = report["machine"], report["workload"]
    intro = (
        f"`ringtrain bench strategies` on {machine(facts)}, "
        f"TensorFlow {facts['tensorflow']}: CNN on synthetic {'×'.join(map(str, w['input']))}, "
        f"global batch {w['global_batch']}, {w['optimizer']}, {report['steps_per_measurement']} "
        f"steps per turn, {report['rounds']} alternating rounds{_mode(report)}. "
        "Efficiency is data-parallel throughput over 2 × single; other ratios are ringtrain's "
        "data parallelism (custom loop) over each contender, round by round. "
        f"Pinning: {report['pinning']['rule']}. MultiWorkerMirrored tuned: numpy feed, loss "
        "reduced once when read, and of the collective implementations and inter-op threads "
        f"swept it ran fastest with {_tuned(report['mwms_tuning']['chosen'])}."
    )
    return "\n".join([intro, "", *lines, "", f"Targets: {'; '.join(verdicts)}.", *failed])


def sizes_table(report: dict) -> str:
    """2-stage pipelines through the CLI against one process, per workload and global batch."""
    lines = [
        "| workload | global batch | contender | samples/s (median, min–max) | × one process, "
        "per round: median (min–max) | bubble measured | fixed cost, ms per microbatch |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in report["summary"]:
        ratios = f"{e['vs_single_median']:.2f} ({_span(e['vs_single_per_round'], '.2f')})"
        bubble = f"{e['bubble_measured_median']:.2f}" if "bubble_measured_median" in e else ""
        fixed = e.get("fixed_ms_per_microbatch_median")
        lines.append(
            f"| {e['workload']} | {e['global_batch']} | {e['name']} | "
            f"{_range(e, 'samples_per_sec')} | {ratios} | {bubble} | "
            f"{'' if fixed is None else f'{fixed:.2f}'} |"
        )
    runs = "; ".join(
        f"{name}: {what}, "
        + ", ".join(f"{n} steps at batch {b}" for b, n in report["steps_per_launch"][name].items())
        for name, what in report["workloads"].items()
    )
    intro = (
        f"`ringtrain bench pipeline-sizes` on {machine(report['machine'])}. Workloads: {runs}. "
        "Each contender is one `ringtrain train` launch (`mpirun --bind-to core`: one process "
        "of one thread, or 2 pipeline ranks of one thread each), timed over its steps after "
        f"the first; medians of {report['rounds']} alternating rounds{_mode(report)}, each "
        "ratio against the one process of its own round."
    )
    return "\n".join([intro, "", *lines, "", fixed_profile_table(report)])


def fixed_profile_table(report: dict) -> str:
    """Where each stage's fixed cost per microbatch goes, action by action, for the pipelines
    also launched at one example per microbatch."""
    lines = [
        "| workload | global batch | contender | stage | F | B (ZB-H1: BI + BW) | send | "
        "receive | per microbatch | empty compiled call |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in report["summary"]:
        if "fixed_ms_per_action_median" not in e:
            continue
        for stage, ops in e["fixed_ms_per_action_median"].items():
            backward = sum(ops.get(op, 0.0) for op in ("B", "BI", "BW"))
            send = sum(ops.get(op, 0.0) for op in ("SA", "SG"))
            receive = sum(ops.get(op, 0.0) for op in ("RA", "RG"))
            total = ops["F"] + backward + send + receive
            lines.append(
                f"| {e['workload']} | {e['global_batch']} | {e['name']} | {stage} | "
                f"{ops['F']:.2f} | {backward:.2f} | {send:.2f} | {receive:.2f} | {total:.2f} | "
                f"{e['call_floor_ms_median']:.2f} |"
            )
    intro = (
        "Where a microbatch's fixed cost goes, action by action, in milliseconds. Each "
        f"contender also launched at a global batch of M ({report['one_example_steps']} "
        "steps, one example per microbatch); an action's fixed cost is its own work there "
        "(the median over the launch's steps after the first, its wait left out, then over "
        "the rounds), less one example's compute: how much that own work grew per example up "
        "to the timed launch's microbatch. The last column is a compiled call that does no "
        "work, called as the executor calls a stage and timed on rank 0: every F and B pays "
        "it before any of its own work."
    )
    return "\n".join([intro, "", *lines])


def _distance(value: float | None) -> str:
    return "–" if value is None else f"{value:.2g}"


def zoo_table(report: dict) -> str:
    """Throughput of a user's own models against the built-in CNN and one process, and how far
    their weights land from one-process model.fit's."""
    lines = [
        "| contender | samples/s (median, min–max) | against | ratio, per round: median "
        "(min–max) |",
        "|---|---|---|---|",
    ]
    for e in report["summary"]:
        rounds = e["vs_reference_per_round"]
        ratio = f"{e['vs_reference_median']:.2f} ({_span(rounds, '.2f')})"
        against = "itself" if e["contender"] == e["reference"] else e["reference"]
        lines.append(f"| {e['contender']} | {_range(e, 'samples_per_sec')} | {against} | {ratio} |")
    steps = report["compared_steps"]
    lines += [
        "",
        f"| after {steps} steps, ‖dw − dw_fit‖ / ‖dw_fit‖ per tensor | tensors | median | max "
        "(tensor) | median, BatchNormalization moving statistics | median, other tensors |",
        "|---|---|---|---|---|---|",
    ]
    for contender, d in report["weight_distance"].items():
        worst = f" (`{d['worst_tensor']}`)" if d["max"] > 0 else ""  # none where all are 0
        lines.append(
            f"| {contender} | {d['tensors']} | {_distance(d['median'])} | "
            f"{_distance(d['max'])}{worst} | "
            f"{_distance(d['median_moving_statistics'])} | {_distance(d['median_other_tensors'])} |"
        )
    shared = report.get("weight_distance_per_share", {})
    if shared:
        lines += [
            "",
            "| against `fit` on batches of B/K accumulated over K (normalised as the run is) | K | "
            "median | max (tensor) | median, BatchNormalization moving statistics | "
            "median, other tensors |",
            "|---|---|---|---|---|---|",
        ]
    for contender, d in shared.items():
        lines.append(
            f"| {contender} | {d['shares']} | {_distance(d['median'])} | "
            f"{_distance(d['max'])} (`{d['worst_tensor']}`) | "
            f"{_distance(d['median_moving_statistics'])} | {_distance(d['median_other_tensors'])} |"
        )
    verdicts = [
        f"{name}: {t['value']:.2f}, {'met' if t['met'] else 'NOT met'}"
        for name, t in report["targets"].items()
    ]
    facts, w, threads = report["machine"], report["workload"], report["threads"]
    per_turn = report["steps_per_measurement"]
    stages = ", ".join(f"[{a}, {b})" for a, b in report["partition"])
    intro = (
        f"`ringtrain bench zoo` on {machine(facts)}, TensorFlow {facts['tensorflow']}, Keras "
        f"{facts['keras']}: synthetic {'×'.join(map(str, w['input']))} ({w['samples']} "
        f"training examples), global batch {w['global_batch']}, {w['optimizer']}; "
        f"{per_turn['cnn']} CNN steps or {per_turn['resnet']} ResNet50 steps per turn, "
        f"{report['rounds']} alternating rounds{_mode(report)}. Two ranks of "
        f"{threads['intra_op']} intra-op and {threads['inter_op']} inter-op thread(s) each; "
        f"pinning: {report['pinning']['rule']}. ResNet50 has {w['resnet50_parameters']:,} "
        f"parameters; the pipeline's time partition cut its blocks at {stages}. The distances "
        f"compare the weights after {steps} steps from one set of initial weights with what "
        "one-process Keras `model.fit` made of the same batches, in order."
    )
    return "\n".join([intro, "", *lines, "", f"Targets: {'; '.join(verdicts)}."])


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def input_table(report: dict) -> str:
    """Training from TFRecord files on disk, under a memory cgroup, against memory: the
    throughputs, the targets, memory against the set, the disk, the pipeline alone, and where
    a disk step's time went."""
    lines = [
        "| contender | samples/s (median, min–max) | × from memory, per round: median "
        "(min–max) | input wait, share of the steps (median) | fullest rank's VmHWM | of the "
        "set | each rank's VmHWM, per round | read from storage per launch (median) | read "
        "rate over the launch (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in report["summary"]:
        ratio = f"{e['vs_memory_median']:.2f} ({_span(e['vs_memory_per_round'], '.2f')})"
        ranks = "; ".join(
            " + ".join(_gib(b) for b in highs) for highs in e["ranks_vmhwm_bytes_per_round"]
        )
        lines.append(
            f"| {e['contender']} | {_range(e, 'samples_per_sec')} | {ratio} | "
            f"{e['input_wait_fraction_median']:.1%} | {_gib(e['fullest_rank_vmhwm_bytes'])} | "
            f"{e['fullest_rank_vmhwm_of_set']:.1%} | {ranks} | {_gib(e['read_bytes_median'])} "
            f"| {e['read_bytes_per_sec_median'] / 1e6:.0f} MB/s |"
        )
    alone, p = report["pipeline_alone"], report["profile"]
    lines += [
        "",
        "| the input pipeline alone, one process, one thread, cold cache | value |",
        "|---|---|",
        f"| records read and parsed | {alone['records']} of {alone['set_records']} |",
        f"| records/s | {alone['records_per_sec']:.0f} |",
        f"| MB/s of records | {alone['mb_per_sec']:.0f} |",
        f"| MB/s read from storage | {alone['read_mb_per_sec']:.0f} |",
        f"| CPU ms per record | {alone['cpu_ms_per_record']:.3f} |",
        f"| indexing the files at start-up | {alone['index_seconds']:.1f} s, "
        f"{_gib(alone['index_read_bytes'])} read |",
        "",
        "| where a step's time goes, median ms per step | ms |",
        "|---|---|",
        f"| step from memory | {p['memory_step_ms']:.1f} |",
        f"| step from disk | {p['disk_step_ms']:.1f} |",
        f"| of which, beyond memory's | {p['disk_extra_ms']:.1f} |",
        f"| input wait from disk | {p['disk_input_wait_ms_per_step']:.1f} |",
        f"| the read-ahead's own CPU, a rank's share at the pipeline-alone cost (estimate) "
        f"| {p['read_ahead_cpu_ms_per_step_estimate']:.1f} |",
        f"| left unexplained | {p['unexplained_ms']:.1f} |",
    ]
    ratio = report["ratio_disk_over_memory"]
    verdicts = [
        f"{name}: {t['value']:.3f}, {'met' if t['met'] else 'NOT met'}"
        for name, t in report["targets"].items()
    ]
    data, cgroup, w = report["dataset"], report["cgroup"], report["workload"]
    facts = report["machine"]
    intro = (
        f"`ringtrain bench input` on {machine(facts)}, TensorFlow {facts['tensorflow']}: "
        f"{data['examples']:,} synthetic {'×'.join(map(str, data['shape']))} uint8 images in "
        f"{data['shards']} TFRecord shards, {_gib(data['bytes'])}; {w['model']}, "
        f"{w['optimizer']}, global batch {w['global_batch']} on {w['ranks']} ranks; "
        f"{report['steps_per_launch']} steps per launch, {report['rounds']} alternating "
        f"rounds{_mode(report)}. From memory: the set's first {report['memory_examples']:,} "
        f"examples as arrays. From disk: page cache dropped before each launch, "
        + (
            f"a rank on each of the rehearsal nodes {report['hosts']}, each node in a memory "
            f"cgroup ({cgroup['version']}, both contenders) capped at "
            if report.get("hosts")
            else f"mpirun and its ranks in a memory cgroup ({cgroup['version']}) limited to "
        )
        + f"{_gib(cgroup['disk_limit_bytes'])}, which peaked at "
        f"{_gib(cgroup['disk_peak_bytes'])}. Pinning: {report['pinning']['rule']}."
    )
    return "\n".join(
        [
            intro,
            "",
            *lines,
            "",
            f"From disk over from memory, per round: median {ratio['median']:.3f} "
            f"({ratio['min']:.3f}–{ratio['max']:.3f}). Targets: {'; '.join(verdicts)}.",
        ]
    )


def sweep_table(report: dict) -> str:
    """A sweep's trials per hour, packed in groups of one rank against one group on every
    rank, per model; the trials' own seconds and the launch's time outside them."""
    lines = [
        "| model | contender | trials/h (median, min–max) | × wide, per round: median "
        "(min–max) | launch s (median) | a trial's s (median) | launch s outside the busiest "
        "group's trials (median) | a trial's training samples/s (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in report["summary"]:
        ratio = f"{e['vs_wide_median']:.2f} ({_span(e['vs_wide_per_round'], '.2f')})"
        lines.append(
            f"| {e['model']} | {e['contender']} | {_range(e, 'trials_per_hour')} | {ratio} | "
            f"{e['wall_seconds_median']:.1f} | {e['trial_seconds_median']:.2f} | "
            f"{e['outside_trials_seconds_median']:.1f} | "
            f"{e['trial_samples_per_sec_median']:.0f} |"
        )
    groups = "; ".join(
        f"{name}: {_many(c['groups'], 'group')} of {_many(c['group_size'], 'rank')}, "
        f"`--strategy {c['strategy']}`"
        for name, c in report["contenders"].items()
    )
    steps = ", ".join(f"{m} {n}" for m, n in report["steps_per_trial"].items())
    load = report["load_average"]
    before = [r["load_1min_before"] for r in report["raw"]]
    intro = (
        f"`ringtrain bench sweep` on {machine(report['machine'])}: one `ringtrain sweep run` "
        f"launch of {len(report['trial_lrs'])} trials per contender on {report['ranks']} ranks "
        f"({groups}), the same learning rates queued in the study, every trial to its full "
        f"steps ({steps}) at global batch {report['global_batch']}; "
        + "; ".join(f"{m}: {what}" for m, what in report["models"].items())
        + f". Medians of {report['rounds']} alternating rounds{_mode(report)}, each ratio "
        f"against the wide launch of its own round and model. Pinning: "
        f"{report['pinning']['rule']}. The machine's load average (1 min) was "
        f"{load['start'][0]:.1f} at the start and {load['end'][0]:.1f} at the end, "
        f"{_span(before, '.1f')} before the launches."
    )
    return "\n".join([intro, "", *lines])


def _many(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def sweep_summary(reports: list[dict]) -> str:
    """Whether packing beat widening, per model, and how far a trial on every rank was from
    the speed-up widening needs to match packing (one trial per group, each as fast): whole,
    and in its training steps alone."""
    findings = []
    for report in reports:
        ranks = report["ranks"]
        for model, r in report["ratios"].items():
            ratio, faster, steps = (
                r["packed_over_wide"],
                r["wide_trial_speedup"],
                r["wide_steps_speedup"],
            )
            won, rounds = r["packed_won_rounds"], len(ratio["per_round"])
            verdict = (
                "packing beat widening"
                if ratio["median"] > 1
                else "widening beat packing"
                if ratio["median"] < 1
                else "packing and widening tied"
            )
            findings.append(
                f"- **{model}**: {verdict} (packed won {won} of {rounds} rounds): "
                f"{ratio['median']:.2f}× the trials per hour "
                f"({_span(ratio['per_round'], '.2f')} over the rounds). A trial on {ranks} "
                f"ranks ran {faster['median']:.2f}× as fast as one of the packed trials "
                f"({_span(faster['per_round'], '.2f')}), its training steps alone "
                f"{steps['median']:.2f}× ({_span(steps['per_round'], '.2f')}); to match "
                f"packing's {ranks} trials at a time, it must run {ranks}× as fast."
            )
    return "\n".join(findings)


def allreduce_table(report: dict) -> str:
    lines = [
        "| ranks | size | Horovod busbw | Horovod in a step busbw | MPI out-of-place busbw | "
        "MPI in-place busbw | ring busbw | Horovod / best MPI | Horovod in a step / best MPI | "
        "ring / best MPI |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    cells: dict[tuple[int, int], dict[str, dict]] = {}
    copies = []
    for e in report["summary"]:
        if e["contender"] == "memcpy":
            copies.append(
                f"{e['algbw_GBps_median']:.3g} GB/s ({size_label(e['bytes'])}, {e['ranks']} ranks)"
            )
            continue
        cells.setdefault((e["ranks"], e["bytes"]), {})[e["contender"]] = e
    for (ranks, nbytes), at in cells.items():
        over = " (oversubscribed)" if at["horovod"]["oversubscribed"] else ""
        lines.append(
            f"| {ranks}{over} | {size_label(nbytes)} | "
            + " | ".join(
                _range(at[c], "busbw_GBps", ".3g") for c in (*HOROVOD_CALLS, *MPI_CALLS, "ring")
            )
            + " | "
            + " | ".join(f"{at[c]['vs_allreduce_median']:.2f}" for c in (*HOROVOD_CALLS, "ring"))
            + " |"
        )
    verdicts = [
        f"{name}: {'met' if t['met'] else 'NOT met'} (worst {t['worst_median_ratio']:.2f})"
        if t["worst_median_ratio"] is not None
        else f"{name}: not measured"
        for name, t in report["targets"].items()
    ]
    facts = report["machine"]
    memcpy = f"memcpy (np.copyto of twice the last-level cache, one rank): {', '.join(copies)}"
    intro = (
        f"`ringtrain bench allreduce` on {machine(facts)}, "
        f"{facts['mpi']}, Horovod {facts['horovod']}: float32 sums, GB/s (median, min–max over "
        f"{report['rounds']} alternating rounds){_mode(report)}. Bus bandwidth is "
        "size/time × 2(N−1)/N. Ratios are medians of per-round ratios to the faster MPI call "
        "at that size (in place or out of place); every result is checked against the sum "
        "computed locally; targets are judged on ranks with a core each, from 4 MiB up. "
        f"Pinning: {report['pinning']['rule']}. "
        + (
            f"{memcpy}, the memory bandwidth every transfer on one machine is bounded by."
            if copies
            else ""
        )
    )
    findings = allreduce_findings(report)
    return "\n".join([intro, "", *lines, "", findings, "", f"Targets: {'; '.join(verdicts)}."])


def allreduce_findings(report: dict) -> str:
    """Where the targets are judged (ranks with a core each, from TARGET_BYTES up), each call's
    share of the faster MPI call, and what a call of the smallest size took."""
    cores = [e for e in report["summary"] if not e["oversubscribed"]]
    smallest = min(e["bytes"] for e in cores)

    def shares(contender: str) -> str:
        return ", ".join(
            f"{e['vs_allreduce_median']:.2f} at {size_label(e['bytes'])}"
            for e in cores
            if e["contender"] == contender and e["bytes"] >= TARGET_BYTES
        )

    def took(contender: str) -> str:
        entry = next(e for e in cores if e["contender"] == contender and e["bytes"] == smallest)
        return f"{smallest / entry['algbw_GBps_median'] / 1e6:.3f} ms"

    mpi = {
        e["contender"]: e for e in cores if e["bytes"] == smallest and e["contender"] in MPI_CALLS
    }
    faster = max(mpi, key=lambda c: mpi[c]["algbw_GBps_median"])
    cycle = {run["environment"].get("HOROVOD_CYCLE_TIME") for run in report["runs"]}
    return (
        f"On ranks with a core each, from {size_label(TARGET_BYTES)} up, of the faster MPI "
        f"call's bus bandwidth: Horovod in a step {shares('horovod in a step')}; Horovod from "
        f"Python {shares('horovod')}; out-of-place MPI {shares(MPI_CALLS[0])}. At "
        f"{size_label(smallest)} a call took {took('horovod in a step')} in a step, "
        f"{took('horovod')} from Python and {took(faster)} for the faster MPI call "
        f"(medians; HOROVOD_CYCLE_TIME {' and '.join(sorted(map(str, cycle)))} ms)."
    )


def _mwms(workload: dict) -> str:
    """The faster MWMS run and its inter-op threads, or why there is none."""
    runs = {k: v for k, v in workload["ms"].items() if k.startswith("MWMS")}
    if not runs:
        failed = [m["failed"] for m in workload.get("mwms", {}).values() if "failed" in m]
        return f"failed: {failed[0]}" if failed else "not run"
    name = min(runs, key=runs.get)
    return f"{runs[name]:.2f} ({name.split(', ')[-1]})"


def dp_table(report: dict) -> str:
    """`bench dp` in one setting: the measured steps beside the roofline, and the profile."""
    lines = [
        "| workload | gradients | compute | MPI_Allreduce | limits: no overlap / full | "
        "ringtrain | bucketed | plain Horovod | MWMS tuned | single | efficiency | "
        "of no-overlap limit | speed over MWMS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    profiles = []
    for w in report["workloads"]:
        ms, r = w["ms"], w["ratios"]
        allreduce = min(ms["MPI_Allreduce in place"], ms["MPI_Allreduce out of place"])
        lines.append(
            f"| {w['workload']} ({w['regime']}) | {w['gradient_bytes'] / 1e6:.2f} MB | "
            f"{ms['compute per rank']:.2f} | {allreduce:.2f} | {ms['no-overlap limit']:.2f} / "
            f"{ms['full-overlap limit']:.2f} | {ms['ringtrain']:.2f} | "
            f"{ms['ringtrain bucketed']:.2f} | {ms['plain Horovod']:.2f} | {_mwms(w)} | "
            f"{ms['single']:.2f} | {r['efficiency (single / 2 x ringtrain)']:.2f} | "
            f"{_roofline_cell(r[ROOFLINE])} | "
            f"{r.get('ringtrain over tuned MWMS (speed)', float('nan')):.2f} |"
        )
        phases = ", ".join(f"{k} {v:.3f}" for k, v in w["ringtrain_breakdown_ms"].items())
        horovod = ", ".join(f"{k} {v:.3f}" for k, v in w["horovod_timeline_ms_per_step"].items())
        trace = w["overlap_trace"]
        beyond = r["overhead beyond compute + MPI_Allreduce (ms)"]
        profiles.append(
            f"- {w['workload']}: {beyond:.2f} beyond compute + MPI_Allreduce; ringtrain's step "
            f"{phases}; Horovod's timeline per step: "
            f"{horovod}; with {w['buckets']} bucket(s) the first average arrived at "
            f"{trace['bucket_arrival_ms'][0]:.2f} ms and the backward ended at "
            f"{trace['backward_end_ms']:.2f} ms."
        )
    facts = report["machine"]
    intro = (
        f"`ringtrain bench dp`, {report['setting']}, 2 ranks of one thread on "
        f"{machine(facts)}, link "
        f"{report['workloads'][0]['link_mb_s']:.0f} MB/s measured: ms per step, medians of "
        f"{report['rounds']} alternating rounds of "
        f"{report['steps_per_round']} steps{_mode(report)}. Efficiency is single / (2 × "
        "ringtrain's better step); of no-overlap limit is that limit (compute + "
        "MPI_Allreduce) over that step; MWMS tuned is TensorFlow's MultiWorkerMirrored with "
        "RING, numpy feed and the loss read once, the faster of inter-op 1 and 2, launched "
        "with the same mpirun flags and taking turns with ringtrain round by round; speed "
        "over MWMS is its step over ringtrain's better one."
    )
    return "\n".join([intro, "", *lines, "", "Where the time went (ms per step):", "", *profiles])


def _roofline_cell(fraction: float) -> str:
    """A step's share of its no-overlap limit, or, above 1, why the share means nothing."""
    verdict = roofline_verdict(fraction)
    if verdict == "roofline error":
        return f"roofline error: limit wrong for this case (measured {fraction:.3f}, above 1)"
    return f"{fraction:.3f} ({verdict})"


def _where(report: dict) -> str:
    """A `bench dp` setting in a few words: the last clause of its label."""
    return report["setting"].rsplit(", ", 1)[-1]


def _over_mwms(workload: dict) -> str:
    """ringtrain's speed over tuned MultiWorkerMirrored on one workload, where MWMS ran."""
    speed = workload["ratios"].get("ringtrain over tuned MWMS (speed)")
    return f"{workload['workload']} " + ("(no MWMS run)" if speed is None else f"{speed:.2f}x")


def dp_summary(reports: list[dict]) -> str:
    """The page's findings across its settings: the roofline verdicts (a step that beats its
    limit is a roofline error, never a hit), and ringtrain against plain Horovod and MWMS."""
    cases: dict[str, list[str]] = {"met": [], "missed": [], "roofline error": []}
    against_horovod, over_mwms, bucketed = [], [], []
    for report in reports:
        where = _where(report)
        for w in report["workloads"]:
            r = w["ratios"]
            name, verdict = f"{w['workload']} ({where})", roofline_verdict(r[ROOFLINE])
            cases[verdict].append(f"{name} {r[ROOFLINE]:.3f}")
            against_horovod.append(r["ringtrain / plain Horovod (step time)"])
            wrong = ", against a wrong limit" if verdict == "roofline error" else ""
            bucketed.append(f"{name} {r['bucketed gain over no-overlap limit']:+.2f}{wrong}")
        over_mwms.append(f"{where}: " + ", ".join(map(_over_mwms, report["workloads"])))
    total = sum(map(len, cases.values()))
    return "\n".join(
        [
            f"- **Against the roofline** (target: ringtrain's better step at {ROOFLINE_TARGET} "
            f"or more of its no-overlap limit): met in {len(cases['met'])} of {total} cases; "
            f"missed in {len(cases['missed'])} ({'; '.join(cases['missed']) or 'none'}); "
            f"{len(cases['roofline error'])} roofline errors, counted as neither: the step beat "
            "its own limit, so the limit is wrong for that case "
            f"({'; '.join(cases['roofline error']) or 'none'}).",
            f"- **Against plain Horovod**: ringtrain's better step took "
            f"{min(against_horovod):.2f}–{max(against_horovod):.2f} of its time.",
            f"- **Speed over tuned MultiWorkerMirrored**: {'; '.join(over_mwms)}.",
            f"- **Bucketed step's gain over the no-overlap limit**: {'; '.join(bucketed)}.",
        ]
    )


def plan_table(report: dict) -> str:
    facts = report["machine"]
    parts = [
        f"`ringtrain bench plan`, {report['setting']}, on {machine(facts)}: every 2-rank "
        "configuration `ringtrain plan` ranks, each run "
        f"through `ringtrain train` ({report['steps_per_run']} steps, global batch "
        f"{report['global_batch']}, Adam) in {report['rounds']} rounds. Each round calibrates "
        "first, and its runs, in an order rotated by the round, are judged against its own "
        "calibration; the table shows medians over the rounds, and the error the same runs "
        "would have against round 1's calibration alone. "
        "Memory is what the fullest rank added to its high-water mark (VmHWM) after "
        f"TensorFlow's import, beside the prediction{_mode(report)}. In sample: `plan "
        "calibrate` ran that configuration itself, so its prediction repeats a timed run.",
        plan_accuracy(report),
    ]
    for w in report["workloads"]:
        lines = [
            f"**{w['model']}**: plan's first choice {w['first_choice']} (in "
            f"{w['first_choice_per_round'].count(w['first_choice'])} of "
            f"{len(w['first_choice_per_round'])} rounds), "
            f"{w['first_choice_vs_fastest']:.2f} of the fastest measured "
            f"({w['fastest_measured']}). {_plan_findings(w)}",
            "",
            "| configuration | in sample | predicted samples/s | measured | error | error, "
            "round 1's calibration | step ms predicted | compute | exposed comm | bubble "
            "| memory MiB predicted / measured |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in w["configurations"]:
            lines.append(
                f"| {r['configuration']} | {'yes' if _in_sample(r) else 'no'} | "
                f"{r['samples_per_sec']:.0f} | "
                f"{r['measured_median']:.0f} | {r['error']:+.0%} | "
                f"{r['error_against_round_1_calibration']:+.0%} | {r['step_ms']:.2f} | "
                f"{r['compute_ms']:.2f} | {r['exposed_comm_ms']:.2f} | {r['bubble']:.2f} | "
                f"{r['memory_predicted_bytes'] / 2**20:.0f} / "
                f"{r['memory_measured_bytes'] / 2**20:.0f} |"
            )
        parts.append("\n".join(lines))
    met = ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in report["targets"].items())
    parts.append(f"Targets: {met}.")
    return "\n\n".join(parts)


def _in_sample(row: dict) -> bool:
    """As the report recorded it, or, for a report older than that field, as decided now."""
    return row.get("in_sample", in_sample(row))


def _hits(rows: list[dict], key: str) -> str:
    """How many of the rows' speed errors under `key` are within SPEED_TOLERANCE."""
    return f"{sum(abs(r[key]) <= SPEED_TOLERANCE for r in rows)} of {len(rows)}"


def plan_accuracy(report: dict) -> str:
    """The headline: speed predictions of configurations calibration never ran (out of
    sample), apart from those it ran itself (in sample), which test the cost model less."""
    rows = [r for w in report["workloads"] for r in w["configurations"]]
    outside = [r for r in rows if not _in_sample(r)]
    inside = [r for r in rows if _in_sample(r)]
    models = ", ".join(
        f"{w['model']} {_hits([r for r in w['configurations'] if not _in_sample(r)], 'error')}"
        for w in report["workloads"]
    )
    names = ", ".join(dict.fromkeys(r["configuration"] for r in inside))
    return (
        f"**Speed within {SPEED_TOLERANCE:.0%}, out of sample: {_hits(outside, 'error')}** "
        f"predictions ({len(outside)} configurations `plan calibrate` never ran at this link "
        f"speed: {models}); against round 1's calibration alone "
        f"{_hits(outside, 'error_against_round_1_calibration')}. In sample ({names}, which "
        f"calibration ran itself): {_hits(inside, 'error')}."
    )


def _plan_findings(workload: dict) -> str:
    """What one model's rows say beyond the table: the best pipeline against data parallelism,
    lossy fp16 against exact, the worst memory error and the worst single round."""
    rows = {r["configuration"]: r for r in workload["configurations"]}
    data, fp16 = rows["data"], rows["data fp16 (lossy)"]
    pipelines = [r for name, r in rows.items() if name.startswith("pipeline")]
    best = max(pipelines, key=lambda r: r["measured_median"])
    rounds = [abs(e) for r in rows.values() for e in r["error_per_round"]]
    memory = max(abs(r["memory_error"]) for r in rows.values())
    return (
        f"The fastest pipeline, {best['configuration']}, ran "
        f"{best['measured_median'] / data['measured_median']:.2f} of data parallelism's "
        f"samples/s (predicted {best['samples_per_sec'] / data['samples_per_sec']:.2f}); lossy "
        f"fp16 ran {fp16['measured_median'] / data['measured_median']:.2f}x the exact data "
        f"parallelism; memory is predicted within {memory:.0%} in all {len(rows)} "
        f"configurations; a single round's speed error reached {max(rounds):.0%}."
    )


def shard_table(report: dict) -> str:
    """A sharded data-parallel step against a plain one, per workload, with the verdict."""
    lines = [
        "| workload | contender | ms/step (median, min–max) | × plain step (per round) | "
        "fullest rank's VmHWM (MiB) |",
        "|---|---|---|---|---|",
    ]
    for e in report["summary"]:
        ms = {k: v * 1e3 for k, v in e.items() if k.startswith("step_seconds_")}
        cells = {f"ms_{k.removeprefix('step_seconds_')}": v for k, v in ms.items()}
        ratios = ", ".join(f"{r:.3f}" for r in e["vs_plain_per_round"])
        lines.append(
            f"| {e['workload']} | {e['name']} | {_range(cells, 'ms', '.1f')} | "
            f"{e['vs_plain_median']:.3f} ({ratios}) | "
            f"{e['peak_resident_bytes_median'] / 2**20:.0f} |"
        )
    runs = ", ".join(
        f"{name} ({w['steps']} steps at global batch {w['global_batch']})"
        for name, w in report["workloads"].items()
    )
    verdicts = "; ".join(
        f"{name}: {'within' if met else 'over'} the target"
        for name, met in report["within_target"].items()
    )
    intro = (
        f"`ringtrain bench shard-optimizer` on {machine(report['machine'])}. Workloads: the "
        f"built-in {runs}, {report['optimizer']}. Each contender is one `ringtrain train` "
        "launch of 2 ranks (`mpirun --bind-to core`, one thread each), timed over its steps "
        f"after the first; medians of {report['rounds']} alternating rounds{_mode(report)}, "
        f"each ratio against the plain step of its own round. Target: {report['target']}. "
        f"{verdicts}."
    )
    return "\n".join([intro, "", *lines])


def too_big_table(report: dict) -> str:
    """The BERT-large-sized encoder on capped nodes: what one process would need by the
    arithmetic, then each run's verdict, prediction, peaks and, for the pipeline, its speed."""
    shape, cap = report["shape"], report["cap_bytes"]
    weights = report.get("weights")
    lines = [
        f"The encoder: {shape['layers']} layers, hidden {shape['hidden']}, {shape['heads']} "
        f"heads, intermediate {shape['intermediate']}, a vocabulary of {report['vocabulary']}; "
        f"global batch {report['batch']} of sequences of {report['tokens']} tokens, "
        f"{report['steps']} steps. Each node is capped at {_gib(cap)}; one rank per node.",
    ]
    if weights:
        lines += [
            "",
            f"By the arithmetic, one process holds {weights:,} weights: {_gib(4 * weights)} of "
            f"weights, as much again of gradients and {_gib(8 * weights)} of Adam's two "
            f"moments, {_gib(16 * weights)} before activations and the baseline.",
        ]
    lines += [
        "",
        "| run | ranks | exit | the memory check (per rank) | killed by the cap | each rank's "
        "VmHWM | each rank's anonymous peak (sampled) | each node's peak cgroup usage | s/step "
        "| loss, first → last |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["runs"]:
        refused = row["exit_code"] != 0 and "error: predicted" in (row["error"] or "")
        check = "refused" if refused else "not checked" if row["forced"] else "fits"
        if row["predicted_per_rank_bytes"]:
            check += ", predicted " + ", ".join(_gib(b) for b in row["predicted_per_rank_bytes"])
        elif row["predicted_bytes"]:
            check += f", predicted {_gib(row['predicted_bytes'])}"
        losses = row.get("losses")
        cells = [
            row["name"],
            str(row["ranks"]),
            str(row["exit_code"]),
            check,
            "yes" if row["killed_by_cap"] else "no",
            ", ".join(_gib(b) for b in row["ranks_vmhwm_bytes"]) or "—",
            ", ".join(_gib(b) for b in row["ranks_anonymous_peak_bytes"]) or "—",
            ", ".join(_gib(b) for b in row["node_peak_bytes"] if b is not None) or "—",
            f"{row['step_seconds']:.1f}" if losses else "—",
            f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else "—",
        ]
        lines.append(f"| {' | '.join(cells)} |")
    lines += ["", f"Each run once{_mode(report)}, on {machine(report['machine'])}.", ""]
    checks = report["checks"].items()
    lines += [f"- {claim}: {'yes' if held else '**no**'}" for claim, held in checks]
    return "\n".join(lines)


# Each page's generated block: the results it shows, in order (a name whose JSON is missing is
# left out), and whether the simulated table of more stages follows them.
PAGE_RESULTS = {
    "allreduce.md": (("allreduce", allreduce_table),),
    "data-parallel.md": (
        ("dp", dp_table),
        ("dp-cluster", dp_table),
        ("dp-cluster-capped", dp_table),
    ),
    "strategies.md": (("strategies", strategies_table),),
    "zoo.md": (("zoo", zoo_table),),
    "input.md": (("input", input_table), ("input-cluster", input_table)),
    "pipeline.md": (("pipeline", pipeline_table), ("pipeline-cluster", pipeline_table)),
    "pipeline-sizes.md": (("pipeline-sizes", sizes_table),),
    "sweeps.md": (("sweep", sweep_table),),
    "too-big.md": (("too-big", too_big_table),),
    "shard-optimizer.md": (("shard-optimizer", shard_table),),
    "planning.md": (
        ("plan-cluster-2gbit", plan_table),
        ("plan-cluster-200mbit", plan_table),
    ),
}
# Findings across all of a page's results, written before its tables.
PAGE_SUMMARIES: dict[str, Callable[[list[dict]], str]] = {
    "data-parallel.md": dp_summary,
    "sweeps.md": sweep_summary,
}
SIMULATED_ON = "pipeline.md"


def cpu_steal() -> str:
    """The share of CPU time the hypervisor stole, over every benchmark run in the results."""
    runs = [result(path.stem)["machine"] for path in sorted(RESULTS.glob("*.json"))]
    return _span([m["cpu_steal_fraction"] for m in runs if "cpu_steal_fraction" in m], ".2%")


def one_host_bubble() -> str:
    """The bubble measured on one host, the schedules at M=2 against those at M=8."""
    summary = result("pipeline")["summary"]

    def at(m: int) -> str:
        runs = [e for e in summary if e["contender"].endswith(f" M={m}")]
        bubbles = [e["bubble_measured_median"] for e in runs]
        return f"{_span(bubbles, '.2f')} at M={m}"

    return f"{at(2)} to {at(8)}"


# The inline figures a page may hold: `<!-- fig: NAME -->` ... `<!-- /fig -->`.
FIGURES: dict[str, Callable[[], str]] = {
    "cpu steal": cpu_steal,
    "one-host bubble": one_host_bubble,
}


def generated_block(page: str) -> str:
    """The text between a page's markers, from the results as they are on disk now."""
    reports, sections = [], []
    for name, table in PAGE_RESULTS[page]:
        if (RESULTS / f"{name}.json").exists():
            reports.append(result(name))
            sections.append(table(reports[-1]))
        if (RESULTS / f"{name}.png").exists():  # the site publishes the plots at results/
            sections.append(f"![{name} benchmark](../results/{name}.png)")
    if reports and page in PAGE_SUMMARIES:
        sections.insert(0, PAGE_SUMMARIES[page](reports))
    if page == SIMULATED_ON:
        sections.append(simulated_stages_table())
    return "\n\n".join(sections) or "(no results yet: run `ringtrain bench ...` first)"


def with_block(text: str, path: Path) -> str:
    """A performance page with its block rewritten; one line and exit 1 when its markers are
    not right."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        sys.exit(
            f"docs_tables: {path.relative_to(ROOT)} needs one {BEGIN} line and, after it, one "
            f"{END} line where the tables go; add them and run this again"
        )
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{generated_block(path.name)}\n{END}{tail}"


def with_figures(text: str, path: Path) -> str:
    """A page with every inline figure rewritten; one line and exit 1 naming an unknown one."""

    def fill(span: re.Match) -> str:
        name = span["name"].strip()
        if name not in FIGURES:
            sys.exit(
                f"docs_tables: {path.relative_to(ROOT)}: no inline figure {name!r}; "
                f"FIGURES has {', '.join(map(repr, FIGURES))}"
            )
        return f"{span[1]}{FIGURES[name]()}{span[4]}"

    return SPAN.sub(fill, text)


def regenerated(path: Path) -> str:
    """The page as the results make it now: its block, if it is a performance page, and its
    inline figures."""
    text = path.read_text()
    if path.parent == PAGES and path.name in PAGE_RESULTS:
        text = with_block(text, path)
    return with_figures(text, path)


def main(argv: list[str]) -> None:
    check = argv == ["--check"]
    if argv and not check:
        sys.exit("usage: python benchmarks/docs_tables.py [--check]")
    stale = []
    for path in doc_files():
        text = regenerated(path)
        if text != path.read_text():
            stale.append(path.relative_to(ROOT).as_posix())
            if not check:
                path.write_text(text)
    if check and stale:
        sys.exit(
            f"docs_tables: out of date: {', '.join(stale)}; run python benchmarks/docs_tables.py"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
