"""`ringtrain bench strategies`: ringtrain's data and pipeline parallelism against TensorFlow's
distribution strategies, on one CNN, one synthetic data set, global batch 64 and SGD(0.01).

Every contender lives in its own long-lived processes, started once; then the contenders take
turns, round after round, each measuring `steps` steps while all others sit idle (blocked on a
pipe; the CPU time they use meanwhile is recorded as a check). Thread pools are 1 intra-op and
1 inter-op per process, so 2 processes on 2 cores are fair against 1 process on 1 core; where
a TensorFlow strategy cannot run that way, or is tuned to run faster, it gets what it needs,
and the JSON says so.

Pinning, one rule for all: nobody is bound. mpirun starts ringtrain's ranks and the all-cores
process with `--bind-to none`, TensorFlow's processes are started unbound, and every process
reports its Cpus_allowed_list, which the JSON keeps per contender.

MultiWorkerMirrored runs twice: stock, as its guide builds it, and tuned, as a user chasing
speed would set it up (ringtrain's numpy feed, no loss collective per step), with the
collective implementation and inter-op threads picked by a sweep before the rounds.
ParameterServer is asynchronous, so it is not the same computation, and is labelled so.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

from ringtrain.bench.common import (
    UNBOUND,
    Process,
    deadline,
    pinning,
    round_ratios,
    session_cpu_seconds,
    spread,
    summarise_contenders,
)
from ringtrain.bounded import RunFailed, end_session
from ringtrain.launch.mpirun import QUIET, mpi_env, mpirun_command

if TYPE_CHECKING:
    import keras

    from ringtrain.data import Dataset

BATCH, LR, SEED = 64, 0.01, 0
SAMPLES, SHAPE, CLASSES = 1024, (32, 32, 3), 10
# The contenders. DP is ringtrain's data parallelism as `ringtrain train --strategy data` runs
# it; the 2-rank contenders (and SINGLE, on rank 0) share one mpirun, ALL_CORES has its own.
SINGLE, DP, FIT, PIPELINE = "single", "data custom", "data fit", "pipeline 1f1b M=8"
ALL_CORES = "single all cores"
MWMS, MWMS_TUNED = "TF MultiWorkerMirrored stock", "TF MultiWorkerMirrored tuned"
PS, MIRRORED = "TF ParameterServer (asynchronous)", "TF Mirrored"
# MWMS tuned's sweep: (collective implementation, inter-op threads); the fastest is kept. Quick
# runs, smoke runs, put one candidate through the same sweep, RING (what AUTO resolves to on
# CPUs without NCCL) at inter-op 1: two more TF workers would cost the smoke run 10 s of
# start-up on 2 cores, and the full sweep's four candidates end within 10% of each other.
TUNING = [(impl, inter) for impl in ("RING", "AUTO") for inter in (1, 2)]
QUICK_TUNING = [("RING", 1)]
TARGETS = {  # name -> (the ratio it reads, threshold)
    "dp_efficiency_at_least_0.93": (f"{DP} efficiency", 0.93),
    "dp_at_least_1.05x_mwms": (f"{DP} / {MWMS_TUNED}", 1.05),
    "dp_at_least_1.15x_ps": (f"{DP} / {PS}", 1.15),
}
CORES = os.cpu_count() or 1
# process kind -> (intra-op threads, inter-op threads, why)
THREADS = {
    "ringtrain rank": (1, 1, "RINGTRAIN_THREADS=1 in each of the 2 ranks"),
    "all-cores process": (CORES, CORES, "ringtrain's rule for one rank: the whole machine"),
    "mwms worker": (1, 1, "one thread per worker process, like ringtrain's ranks"),
    "mwms tuned worker": (1, 0, "inter-op 1 or 2, whichever the sweep found faster"),
    "mirrored": (1, 2, "with 1 inter-op thread MirroredStrategy runs its 2 replicas in turn"),
    "ps worker": (1, 2, "ParameterServerStrategy workers hang with 1 inter-op thread"),
    "ps server": (1, 1, "holds the variables and applies the updates"),
    "ps coordinator": (1, 1, "schedules steps on the workers"),
}
PROCESSES = {  # contender -> [(how many, process kind)] while it runs
    SINGLE: [(1, "ringtrain rank")],  # rank 0 alone; the other rank waits asleep
    DP: [(2, "ringtrain rank")],
    FIT: [(2, "ringtrain rank")],
    PIPELINE: [(2, "ringtrain rank")],
    ALL_CORES: [(1, "all-cores process")],
    MWMS: [(2, "mwms worker")],
    MWMS_TUNED: [(2, "mwms tuned worker")],
    PS: [(1, "ps coordinator"), (1, "ps server"), (2, "ps worker")],
    MIRRORED: [(1, "mirrored")],
}
NOTES = {  # what each contender's step is, where it is not obvious
    SINGLE: "ringtrain's custom loop in rank 0 alone (COMM_SELF), no Horovod",
    DP: "ringtrain's custom loop: one tf.function, grouped Horovod allreduce, loss per step",
    FIT: "model.fit with ringtrain's distributed_optimizer and BroadcastInitialState",
    PIPELINE: "ringtrain's pipeline executor, 2 stages, 1F1B, 8 microbatches of 8",
    ALL_CORES: "ringtrain's custom loop, one process, thread pools sized to every core",
    MWMS: "stock: strategy.run in a tf.function, RING collectives over gRPC, a tf.data input, "
    "the loss reduced in a second collective every step",
    MWMS_TUNED: "tuned: strategy.run in a tf.function fed numpy slices (ringtrain's feed), "
    "each step's loss kept per worker and summed across workers in one strategy.reduce when "
    "read, after the timed steps; implementation and inter-op threads from a sweep "
    "(mwms_tuning)",
    PS: "ASYNCHRONOUS, not the same computation: ClusterCoordinator.schedule, each step one "
    "update from 64 examples on one worker, both workers stepping at once",
    MIRRORED: "strategy.run in a tf.function over 2 logical CPU devices of one process",
}
RINGTRAIN_GROUPS = ("ringtrain", "all cores")  # must work; a TF group may fail, with a reason


def workload() -> tuple[Dataset, Callable[[], keras.Model]]:
    """The data, and what builds the model every contender trains, from the same weights
    (imports TensorFlow: call it in workers)."""
    from ringtrain.data import load_synthetic
    from ringtrain.models import cnn

    data = load_synthetic(SAMPLES, SHAPE, CLASSES, seed=SEED)
    return data, lambda: cnn(data.input_shape, data.n_classes, seed=SEED)


# ---- the processes the parent drives ------------------------------------------------------


class Group:
    """The processes behind some contenders: the first `talkers` take commands, the rest
    (parameter servers, PS workers) only serve."""

    def __init__(
        self,
        name: str,
        contenders: list[str],
        processes: list[Process],
        talkers: int,
        settings: dict | None = None,
    ):
        self.name, self.contenders, self.processes = name, contenders, processes
        self.talkers = processes[:talkers]
        self.settings = settings or {}  # a tuning candidate's settings
        self.ready: list[dict] = []

    def wait_ready(self, until: float) -> None:
        self.ready = [p.receive(until) | {"process": p.role} for p in self.processes]

    def run(self, contender: str, steps: int, until: float) -> float:
        """Seconds the slowest talker took (MWMS workers run in lockstep anyway)."""
        for p in self.talkers:
            p.send({"cmd": "run", "contender": contender, "steps": steps})
        return max(p.receive(until)["seconds"] for p in self.talkers)

    def close(self) -> None:
        for p in self.talkers:
            with suppress(RunFailed):
                p.send({"cmd": "quit"})
        for p in self.processes:
            end_session(p.popen)

    @property
    def leaders(self) -> list[int]:
        return [p.popen.pid for p in self.processes]


def free_ports(count: int) -> list[int]:
    """Ports free right now: bound to port 0 together, so the kernel gives distinct ones."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _tf(
    role: str, kind: str, logs: Path, cluster: dict | None = None, task=None, *tuned: str
) -> Process:
    """A TensorFlow process, unbound like every contender; cluster and task become its
    TF_CONFIG; tuned, if given, is (label, inter-op threads, collective implementation)."""
    env = {**os.environ, **QUIET}
    if cluster is not None:
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": task})
    label = kind if task is None or task["type"] == "chief" else f"{kind} {task['index']}"
    intra, inter, _ = THREADS[kind]
    if tuned:
        label, inter = f"{label} {tuned[0]}", int(tuned[1])
    cmd = [
        sys.executable,
        "-m",
        "ringtrain.bench.tf_strategies_worker",
        role,
        str(intra),
        str(inter),
        *tuned[2:],
    ]
    return Process(label, cmd, env, logs)


def _cluster(**jobs: int) -> dict[str, list[str]]:
    ports = iter(free_ports(sum(jobs.values())))
    return {job: [f"localhost:{next(ports)}" for _ in range(n)] for job, n in jobs.items()}


def _mwms_group(logs: Path, implementation: str | None = None, inter: int = 1) -> Group:
    """Stock MWMS (no implementation given), or one candidate of the tuned sweep."""
    cluster = _cluster(worker=2)
    tasks = [{"type": "worker", "index": i} for i in range(2)]
    if implementation is None:
        workers = [_tf("mwms", "mwms worker", logs, cluster, task) for task in tasks]
        return Group("mwms stock", [MWMS], workers, 2)
    label = f"{implementation} inter-op {inter}"
    tuned = (label, str(inter), implementation)
    workers = [_tf("mwms-tuned", "mwms tuned worker", logs, cluster, t, *tuned) for t in tasks]
    settings = {"implementation": implementation, "inter_op": inter}
    return Group(f"mwms tuned {label}", [MWMS_TUNED], workers, 2, settings)


def start_groups(logs: Path, tuning: list[tuple[str, int]]) -> list[Group]:
    """Every contender's processes (and every MWMS tuning candidate's), started at once; each
    says when it is traced and ready."""
    worker = "ringtrain.bench.strategies_worker"
    ranks = Process(
        "ringtrain ranks", mpirun_command(2, worker, "ranks", binding=UNBOUND), mpi_env(1), logs
    )
    alone = Process(
        "all-cores process",
        mpirun_command(1, worker, "all-cores", binding=UNBOUND),
        mpi_env(CORES),
        logs,
    )
    ps = _cluster(chief=1, worker=2, ps=1)
    parameter_servers = [
        _tf("ps-coordinator", "ps coordinator", logs, ps, {"type": "chief", "index": 0}),
        *(_tf("server", "ps worker", logs, ps, {"type": "worker", "index": i}) for i in range(2)),
        _tf("server", "ps server", logs, ps, {"type": "ps", "index": 0}),
    ]
    return [
        Group("ringtrain", [SINGLE, DP, FIT, PIPELINE], [ranks], 1),
        Group("all cores", [ALL_CORES], [alone], 1),
        _mwms_group(logs),
        *(_mwms_group(logs, implementation, inter) for implementation, inter in tuning),
        Group("ps", [PS], parameter_servers, 1),
        Group("mirrored", [MIRRORED], [_tf("mirrored", "mirrored", logs)], 1),
    ]


# ---- measuring ----------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict:
    """Start everything once, then alternate the contenders round by round."""
    steps = 10 if args.quick else 200
    started = time.monotonic()
    limit, ready_by = started + deadline(args.quick), started + deadline(args.quick) / 2
    rows: list[dict] = []
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        groups = start_groups(Path(tmp), QUICK_TUNING if args.quick else TUNING)
        try:
            live = [g for g in groups if _survives(g, failures, lambda g=g: g.wait_ready(ready_by))]
            tuning = tune_mwms(groups, live, failures, steps, limit)
            for round_index in range(args.rounds):
                for group in list(live):
                    for contender in group.contenders:
                        row = {"round": round_index, "contender": contender, "steps": steps}
                        others = [pid for g in live if g is not group for pid in g.leaders]
                        before = session_cpu_seconds(others)

                        def turn(g=group, c=contender, r=row) -> None:
                            r["seconds"] = g.run(c, steps, limit)

                        if not _survives(group, failures, turn, f"round {round_index}: "):
                            live.remove(group)
                            break
                        row["samples_per_sec"] = BATCH * steps / row["seconds"]
                        row["others_cpu_seconds"] = session_cpu_seconds(others) - before
                        rows.append(row)
        finally:
            with ThreadPoolExecutor(len(groups)) as pool:  # all at once: ending takes seconds
                list(pool.map(Group.close, groups))
    kept = [g for g in groups if not g.settings or g.settings == tuning["chosen"]]
    threads = {
        kind: {"intra_op": intra, "inter_op": inter, "why": why}
        for kind, (intra, inter, why) in THREADS.items()
    }
    threads["mwms tuned worker"]["inter_op"] = (tuning["chosen"] or {}).get("inter_op", 0)
    return summarise(rows, failures) | {
        "rounds": args.rounds,
        "steps_per_measurement": steps,
        "pinning": pinning(),
        "cpus_allowed_list": cpus_per_contender(kept),
        "environment": next(iter(groups[0].ready), {}).get("environment"),
        "mwms_tuning": tuning,
        "workload": {
            "model": "cnn (ringtrain.models)",
            "input": list(SHAPE),
            "samples": SAMPLES,
            "global_batch": BATCH,
            "optimizer": f"SGD(learning_rate={LR})",
        },
        "threads": threads,
        "processes_per_contender": PROCESSES,
        "notes": NOTES,
        "ready": {g.name: g.ready for g in groups},
    }


def tune_mwms(
    groups: list[Group], live: list[Group], failures: dict[str, str], steps: int, until: float
) -> dict:
    """MWMS tuned's sweep: every candidate runs `steps` steps, twice in alternation; the one
    with the fastest pass stays as the contender, the others are closed and leave `live`."""
    candidates = [g for g in groups if g.settings]
    started = [g for g in candidates if g in live]
    seconds: dict[str, list[float]] = {g.name: [] for g in candidates}
    errors = {g.name: failures.get(MWMS_TUNED, "did not start") for g in candidates}
    for g in started:
        errors.pop(g.name)
    for _ in range(2):
        for g in started:
            if g.name not in errors:
                try:
                    seconds[g.name].append(g.run(MWMS_TUNED, steps, until))
                except RunFailed as exc:
                    errors[g.name] = str(exc)
    working = [g for g in started if g.name not in errors]
    chosen = min(working, key=lambda g: min(seconds[g.name]), default=None)
    for g in started:
        if g is not chosen:
            g.close()
            live.remove(g)
    failures.pop(MWMS_TUNED, None)
    if chosen is None:
        failures[MWMS_TUNED] = f"every tuning candidate failed: {errors}"
    return {
        "candidates": [
            g.settings
            | {
                "seconds": seconds[g.name],
                "samples_per_sec_best": BATCH * steps / min(seconds[g.name])
                if seconds[g.name]
                else None,
                "failed": errors.get(g.name),
            }
            for g in candidates
        ],
        "chosen": chosen.settings if chosen else None,
        "steps": steps,
        "rule": "fastest of 2 alternating passes per candidate, before the rounds",
    }


def cpus_per_contender(groups: list[Group]) -> dict[str, list[dict]]:
    """contender -> each of its processes' Cpus_allowed_list, as the processes reported it
    (ringtrain's rank 0 reports every rank's; single runs on rank 0 alone)."""
    found: dict[str, list[dict]] = {}
    for g in groups:
        processes = []
        for ready in g.ready:
            cpus = ready["cpus_allowed_list"]
            if isinstance(cpus, list):
                processes += [
                    {"process": f"{ready['process']}, rank {i}", "cpus_allowed_list": c}
                    for i, c in enumerate(cpus)
                ]
            else:
                processes.append({"process": ready["process"], "cpus_allowed_list": cpus})
        for contender in g.contenders if processes else []:
            found[contender] = processes[:1] if contender == SINGLE else processes
    return found


def _survives(group: Group, failures: dict[str, str], action, when: str = "") -> bool:
    """Run action; a TensorFlow group that fails is recorded and closed, ringtrain's is fatal."""
    try:
        action()
        return True
    except RunFailed as exc:
        if group.name in RINGTRAIN_GROUPS:
            raise
        for contender in group.contenders:
            failures[contender] = f"{when}{exc}"
        group.close()
        return False


def summarise(rows: list[dict], failures: dict[str, str]) -> dict:
    """Medians and ranges; efficiency and ringtrain-to-TF ratios matched round by round."""
    summary = summarise_contenders(rows, "samples_per_sec", SINGLE, "speedup_vs_single")
    pairs = {f"{DP} efficiency": (DP, SINGLE, 2.0), f"{FIT} efficiency": (FIT, SINGLE, 2.0)}
    for e in summary:
        if e["contender"] not in (DP, SINGLE, FIT):
            pairs[f"{DP} / {e['contender']}"] = (DP, e["contender"], 1.0)
    ratios = {}
    for name, (top, bottom, scale) in pairs.items():
        per_round = round_ratios(rows, "samples_per_sec", top, bottom, scale)
        if per_round:
            ratios[name] = {"per_round": per_round, **spread(per_round)}
    targets = {}
    for name, (ratio, threshold) in TARGETS.items():
        value = ratios.get(ratio, {}).get("median")
        missing = ratio.split(" / ")[-1]
        targets[name] = {
            "ratio": ratio,
            "threshold": threshold,
            "value": value,
            "met": None if value is None else value >= threshold,
        }
        if value is None:
            targets[name]["why_not_measured"] = failures.get(missing, "not measured")
    return {
        "raw": rows,
        "summary": summary,
        "ratios": ratios,
        "targets": targets,
        "failures": failures,
    }


def _verdict(target: dict) -> str:
    if target["met"] is None:
        return "not measured"
    return f"{target['value']:.2f}, {'met' if target['met'] else 'NOT met'}"


def describe(report: dict) -> list[str]:
    lines = [
        f"{e['contender']:>33}: {e['samples_per_sec_median']:8.1f} samples/s "
        f"({e['samples_per_sec_min']:.0f}-{e['samples_per_sec_max']:.0f})"
        for e in report["summary"]
    ]
    lines += [f"{name:>47}: {r['median']:.3f}" for name, r in report["ratios"].items()]
    lines += [
        f"target {name} (>= {t['threshold']}): {_verdict(t)}"
        for name, t in report["targets"].items()
    ]
    lines += [f"failed: {name}: {why}" for name, why in report["failures"].items()]
    tuning = report["mwms_tuning"]
    tried = ", ".join(
        f"{c['implementation']} inter-op {c['inter_op']}: "
        + (f"{c['samples_per_sec_best']:.0f}/s" if c["samples_per_sec_best"] else "failed")
        for c in tuning["candidates"]
    )
    lines.append(f"{MWMS_TUNED} chose {tuning['chosen']} of {tried}")
    cpus = {
        c: sorted({p["cpus_allowed_list"] for p in ps})
        for c, ps in report["cpus_allowed_list"].items()
    }
    lines.append(
        f"pinning: {' '.join(report['pinning']['mpirun_flags'])}; Cpus_allowed_list {cpus}"
    )
    return lines


def draw(report: dict, path: str) -> None:
    """Throughput per contender (median, min-max), and the ratios with their targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    summary = report["summary"]
    names = [e["contender"] for e in summary]
    medians = [e["samples_per_sec_median"] for e in summary]
    spans = [
        [m - e["samples_per_sec_min"] for m, e in zip(medians, summary, strict=True)],
        [e["samples_per_sec_max"] - m for m, e in zip(medians, summary, strict=True)],
    ]
    colours = ["tab:orange" if n.startswith("TF") else "tab:blue" for n in names]
    left.barh(names, medians, xerr=spans, color=colours, capsize=3)
    left.invert_yaxis()
    left.set(xlabel="samples/s (median, min-max)", title="throughput, CNN 32x32x3, batch 64")
    ratio_names = list(report["ratios"])
    right.barh(ratio_names, [report["ratios"][n]["median"] for n in ratio_names], color="tab:grey")
    for y, name in enumerate(ratio_names):
        values = report["ratios"][name]["per_round"]
        right.plot(values, [y] * len(values), "k.", ms=4)
    for ratio, threshold in TARGETS.values():
        if ratio in ratio_names:
            y = ratio_names.index(ratio)
            right.plot([threshold] * 2, [y - 0.4, y + 0.4], "r-", lw=2)
    right.axvline(1.0, color="grey", lw=0.8)
    right.invert_yaxis()
    right.set(xlabel="ratio (bars: median, dots: rounds, red: target)", title="ringtrain ratios")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
