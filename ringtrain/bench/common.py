"""What every `ringtrain bench` shares: the subcommands, long-lived drivers, facts, round maths.

Parent side: the `bench` subparser and its dispatch, the drivers that answer one protocol line
per command, the CPU time a hypervisor stole meanwhile, and the summaries of alternating rounds
(medians, ranges, ratios matched round by round). Bounded launches, mpirun's commands and the
machine's facts are the product's own (bounded, launch.mpirun, machine): calibration uses them too.
Rank side: waits that sleep instead of spinning, Horovod switched on only while measured, the
one-line JSON protocol of the long-lived benchmark drivers, and what each process may run on
(its Cpus_allowed_list) and the settings in force, recorded as proof of how it was pinned.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from queue import Empty, Queue
from statistics import median

import numpy as np

from ringtrain import log
from ringtrain.bounded import RunFailed, last_words, run_bounded, start_session
from ringtrain.errors import ProblemsFound, UserError
from ringtrain.launch.mpirun import binding_flags, mpi_env
from ringtrain.machine import machine_facts
from ringtrain.proc import processes

RESULTS = Path("benchmarks/results")
# name -> (module with measure/draw/describe, help line, rounds in full mode)
BENCHES = {
    "pipeline": (
        "ringtrain.bench.pipeline_bench",
        "measured vs predicted bubble, GPipe vs 1F1B, P=2",
        5,
    ),
    "pipeline-sizes": (
        "ringtrain.bench.pipeline_sizes",
        "2-stage pipelines through the CLI against one process: transformer, BERT-shaped",
        3,
    ),
    "strategies": (
        "ringtrain.bench.strategies",
        "ringtrain's data and pipeline parallelism against TensorFlow's strategies",
        5,
    ),
    "allreduce": (
        "ringtrain.bench.allreduce",
        "allreduce bandwidth: Horovod, mpi4py, a hand-written ring, memcpy",
        5,
    ),
    "dp": (
        "ringtrain.bench.roofline",
        "data parallelism against its roofline on three workloads, and plain Horovod",
        5,
    ),
    "plan": (
        "ringtrain.bench.plan_check",
        "ringtrain plan's predictions against measured runs of every 2-rank configuration",
        3,
    ),
    "zoo": (
        "ringtrain.bench.zoo",
        "your own Keras models (a CNN, ResNet50) against the built-in ones and one process",
        5,
    ),
    "input": (
        "ringtrain.bench.input_bench",
        "a CNN trained from TFRecord files on disk, under a memory cgroup, against memory",
        5,
    ),
    "shard-optimizer": (
        "ringtrain.bench.shard_bench",
        "a data-parallel step with --shard-optimizer against a plain one: CNN, transformer",
        5,
    ),
    "too-big": (
        "ringtrain.bench.too_big",
        "a BERT-large-sized encoder on 4 memory-capped nodes: refused, killed, or a pipeline",
        1,
    ),
    "sweep": (
        "ringtrain.bench.sweep_bench",
        "a sweep's trials packed in groups of 1 rank against data parallel on 2: trials/hour",
        5,
    ),
}
PROTOCOL = "@bench "  # marks driver replies among whatever else a rank prints on stdout


# ---- the `ringtrain bench` command ---------------------------------------------------------


def _rounds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 3:
        raise argparse.ArgumentTypeError(f"at least 3 rounds are needed, got {value}")
    return value


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """One subcommand per benchmark, all with the same flags."""
    sub = parser.add_subparsers(dest="bench", required=True, parser_class=type(parser))
    for name, (module, purpose, full_rounds) in BENCHES.items():
        bench = importlib.import_module(module)
        p = sub.add_parser(name, help=purpose, description=purpose, prog=f"{parser.prog} {name}")
        p.add_argument("--quick", action="store_true", help="a smoke run (under 3 minutes)")
        p.add_argument(
            "--rounds",
            type=_rounds,
            help=f"alternation rounds (default {full_rounds}, quick {quick_rounds(bench)})",
        )
        p.add_argument(
            "--out",
            help=f"raw and summary JSON (default {RESULTS}/{name}.json; quick: a scratch file)",
        )
        p.add_argument("--png", help=f"the chart (default {RESULTS}/{name}.png; quick: scratch)")
        p.set_defaults(prog=p.prog)
        more = getattr(bench, "add_arguments", None)
        if more is not None:  # a bench's own flags
            more(p)


def quick_rounds(bench) -> int:
    """A quick run's rounds: 2, enough to prove the alternation and the per-round ratios (a
    smoke test measures nothing), or 1 where a bench's every launch starts TensorFlow in
    several processes and 2 rounds would not fit a test's minute."""
    return getattr(bench, "QUICK_ROUNDS", 2)


def _default_outputs(args: argparse.Namespace) -> None:
    """A full run writes the figures' sources in benchmarks/results; a quick run is a smoke
    test whose figures must never reach the docs, so it writes to a scratch folder unless
    given paths, and never into benchmarks/results."""
    if args.quick:
        scratch = Path(tempfile.gettempdir()) / "ringtrain-bench"
        args.out = args.out or str(scratch / f"{args.bench}-quick.json")
        args.png = args.png or str(scratch / f"{args.bench}-quick.png")
        for flag, path in (("--out", args.out), ("--png", args.png)):
            if Path(path).resolve().parent == RESULTS.resolve():
                raise UserError(
                    f"{flag} {path}: a --quick run never writes into {RESULTS}, where the "
                    "docs' figures come from; give another path or drop --quick"
                )
    args.out = args.out or str(RESULTS / f"{args.bench}.json")
    args.png = args.png or str(RESULTS / f"{args.bench}.png")


def _prepare_outputs(args: argparse.Namespace) -> None:
    """Bad output paths fail before minutes of measuring, not after."""
    from ringtrain.config import check_png, check_writable

    _default_outputs(args)
    for flag, path in (("--out", args.out), ("--png", args.png)):
        folder = Path(path).resolve().parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"{flag} {path}: cannot create folder {folder} ({exc})") from None
    check_writable("--out", args.out)
    check_png("--png", args.png)


def run_bench_command(args: argparse.Namespace) -> int:
    """Measure, then write the JSON and the chart and print the summary lines."""
    module_name, _, full_rounds = BENCHES[args.bench]
    bench = importlib.import_module(module_name)
    args.rounds = args.rounds or (quick_rounds(bench) if args.quick else full_rounds)
    _prepare_outputs(args)
    started, cpu_before = time.perf_counter(), cpu_ticks()
    try:
        result = bench.measure(args)
    except RunFailed as exc:
        raise ProblemsFound(str(exc)) from None
    facts = machine_facts() | {"cpu_steal_fraction": steal_fraction(cpu_before, cpu_ticks())}
    result |= {"machine": facts, "quick": args.quick, "png": args.png}
    result["wall_seconds"] = time.perf_counter() - started
    write_json(args.out, result)
    bench.draw(result, args.png)
    for line in bench.describe(result):
        print(line)
    print(f"wrote {args.out} and {args.png} in {result['wall_seconds']:.0f} s")
    return 0


def write_json(path: str, data: dict) -> None:
    """Atomically: a crash never leaves half a results file behind."""
    partial = f"{path}.partial"
    Path(partial).write_text(json.dumps(data, indent=1))
    os.replace(partial, path)


# ---- stolen CPU time ----------------------------------------------------------------------


def cpu_ticks() -> tuple[int, int]:
    """The machine's (stolen, total) CPU ticks so far, from /proc/stat ((0, 0) elsewhere)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return fields[7], sum(fields)


def steal_fraction(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """The share of CPU time a hypervisor gave other guests between two readings: on a
    virtual machine it slows contenders unevenly, so a report states it."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else None


# ---- deadlines, pinning and drivers -------------------------------------------------------


def deadline(quick: bool) -> float:
    """Seconds a whole bench may take before it counts as hung. Quick runs take about a
    minute and full ones under 20 on a quiet machine; the slack is for a machine shared with
    other jobs, which can slow start-up (TensorFlow in up to 11 processes) severalfold."""
    return 420.0 if quick else 2400.0


LAUNCH_SECONDS = 300  # one `ringtrain train` launch: start-up, tracing and its steps, loaded


def train_metrics(command: list[str], limit: float, folder: str) -> dict:
    """One `ringtrain train ... --metrics-out FOLDER/metrics.json` launch, run to its end
    within LAUNCH_SECONDS and the bench's `limit` (a monotonic time): its metrics."""
    out = Path(folder) / "metrics.json"
    budget = min(LAUNCH_SECONDS, max(1.0, limit - time.monotonic()))
    command = [*command, "--metrics-out", str(out)]
    run_bounded(command, mpi_env(1), budget, Path(folder) / "launch.log", quiet=True)
    return json.loads(out.read_text())


UNBOUND = "none"  # the `--bind-to` value of the strategies and allreduce benches


def pinning() -> dict:
    """The one pinning rule of the strategies and allreduce benches, for their JSON."""
    return {
        "rule": "nobody is bound: every process of every contender may run on every core and "
        "the kernel places its threads (mpirun gets --bind-to none; TensorFlow's processes are "
        "started unbound); each process's Cpus_allowed_list is recorded as proof",
        "mpirun_flags": binding_flags(UNBOUND),
    }


def session_cpu_seconds(leaders: list[int]) -> float:
    """CPU time used so far by the sessions these processes lead (mpirun's ranks included)."""
    wanted = set(leaders)
    return sum(cpu for sid, cpu in processes().values() if sid in wanted)


class Process:
    """One child: commands go to its stdin; its protocol lines come back through a queue."""

    def __init__(self, role: str, cmd: list[str], env: dict[str, str], logs: Path):
        self.role, self.log = role, logs / f"{role.replace(' ', '_')}.log"
        with open(self.log, "w") as err:
            self.popen = start_session(
                cmd, env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
            )
        self.replies: Queue[dict | None] = Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            if line.startswith(PROTOCOL):
                self.replies.put(json.loads(line[len(PROTOCOL) :]))
        self.replies.put(None)  # stdout closed: the process ended

    def send(self, message: dict) -> None:
        try:
            self.popen.stdin.write(json.dumps(message) + "\n")
            self.popen.stdin.flush()
        except OSError:
            raise RunFailed(f"{self.role} is gone: {last_words(self.log)}") from None

    def receive(self, until: float) -> dict:
        try:
            message = self.replies.get(timeout=max(0.0, until - time.monotonic()))
        except Empty:
            said = last_words(self.log)
            raise RunFailed(f"{self.role} did not answer in time; it last said: {said}") from None
        if message is None:
            code = self.popen.wait()
            raise RunFailed(f"{self.role} ended (exit {code}): {last_words(self.log)}")
        return message


# ---- rounds -------------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    return {"median": median(values), "min": min(values), "max": max(values)}


def per_round(rows: list[dict], contender: str, metric: str) -> dict[int, float]:
    return {r["round"]: r[metric] for r in rows if r["contender"] == contender}


def round_ratios(
    rows: list[dict], metric: str, numerator: str, denominator: str, scale: float = 1.0
) -> list[float]:
    """numerator / (scale x denominator), each round against its own round: drift cancels."""
    top, bottom = per_round(rows, numerator, metric), per_round(rows, denominator, metric)
    return [top[r] / (scale * bottom[r]) for r in sorted(top) if r in bottom]


def summarise_contenders(
    rows: list[dict], metric: str, reference: str, ratio_name: str
) -> list[dict]:
    """Per contender, in first-seen order: median and range of metric, and its per-round ratio
    to the reference contender."""
    summary = []
    for name in dict.fromkeys(r["contender"] for r in rows):
        values = [r[metric] for r in rows if r["contender"] == name]
        ratios = round_ratios(rows, metric, name, reference)
        stats = spread(values)
        summary.append(
            {
                "contender": name,
                **{f"{metric}_{k}": v for k, v in stats.items()},
                f"{ratio_name}_per_round": ratios,
                f"{ratio_name}_median": median(ratios) if ratios else None,
            }
        )
    return summary


# ---- inside the ranks ---------------------------------------------------------------------


SETTINGS = (  # environment that changes the numbers, as the measured processes see it
    "HOROVOD_CYCLE_TIME",
    "HOROVOD_FUSION_THRESHOLD",
    "OMPI_MCA_mpi_yield_when_idle",
    "RINGTRAIN_HOROVOD_NICE",
    "RINGTRAIN_THREADS",
)


def settings_in_force() -> dict[str, str | None]:
    """The SETTINGS as this process has them (ringtrain's start-up fills in some defaults)."""
    return {name: os.environ.get(name) for name in SETTINGS}


def cpus_allowed(pid: int | str = "self") -> str:
    """The cores a process may run on, as /proc/<pid>/status lists them ("0-1", "0"...)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "unknown"
    found = (ln.split(":", 1)[1].strip() for ln in status if ln.startswith("Cpus_allowed_list"))
    return next(found, "unknown")


def ranks_cpus_allowed(comm) -> list[str]:
    """Every rank's Cpus_allowed_list, in rank order, at rank 0 (None elsewhere)."""
    return comm.gather(cpus_allowed(), root=0)


def bench_config(model: str, batch: int, lr: float, seed: int, **changes):
    """What every bench trains with: synthetic data and plain SGD, and a communication
    deadline (300 s) that no run that is merely slow, on a loaded machine, comes near."""
    from ringtrain.config import TrainConfig

    settings = {"strategy": "single", "dataset": "synthetic", "optimizer": "sgd"}
    settings |= {"comm_timeout": 300, **changes}
    return TrainConfig(model=model, batch_size=batch, lr=lr, seed=seed, **settings)


def engine_of(model, data, cfg, world):
    """The engine `ringtrain train` runs cfg's strategy on, for a compiled `model`."""
    from ringtrain.api import engine_for

    return engine_for(model, data, cfg, world.size)(world)[0]


def batch_stream(n_examples: int, count: int, batch: int, seed: int) -> np.ndarray:
    """The first `count` global batches of the shared order, across epochs as needed: every
    contender of a bench trains on the same batches."""
    from ringtrain.data import epoch_batches

    per_epoch = n_examples // batch
    epochs = [epoch_batches(n_examples, batch, seed, e) for e in range(-(-count // per_epoch))]
    return np.concatenate(epochs)[:count]


def idle_wait(request) -> None:
    """Complete an MPI request while sleeping, so a waiting rank leaves its core to the others."""
    while not request.Test():
        time.sleep(0.001)


def idle_barrier(comm) -> None:
    idle_wait(comm.Ibarrier())


Tensors = dict[str, np.ndarray]


def deal_out(comm, jobs: list[Callable[[], Tensors]], timeout: float = 600.0) -> list[Tensors]:
    """Run job i on rank i % size, so the ranks work at once (one done first sleeps at the
    barrier, leaving its core to the others). Rank 0 gets every job's tensors, in job order, as
    buffers (Link.send_named, no pickle); the other ranks get an empty list."""
    from ringtrain.comm import Link

    link = Link(comm, timeout)
    size, rank = comm.Get_size(), comm.Get_rank()
    mine = {i: job() for i, job in enumerate(jobs) if i % size == rank}
    idle_barrier(comm)
    if rank != 0:
        for i, tensors in mine.items():
            link.send_named(tensors, 0, i, "a dealt-out job's tensors")
        link.flush()
        return []
    return [
        mine[i] if i in mine else link.recv_named(i % size, i, "a dealt-out job's tensors")
        for i in range(len(jobs))
    ]


@contextmanager
def horovod_running(comm) -> Iterator[object]:
    """Horovod only while it is measured: its idle background thread polls MPI and would take
    CPU from whichever contender runs meanwhile."""
    import horovod.tensorflow as hvd

    from ringtrain.runtime import init_horovod

    init_horovod(hvd, comm)
    try:
        yield hvd
    finally:
        hvd.shutdown()


def reply(message: dict) -> None:
    """One protocol line to the parent."""
    print(PROTOCOL + json.dumps(message), flush=True)


def serve(comm, names: list[str], measure: Callable[[str, int], dict | None]) -> None:
    """The ranks' side of a long-lived driver: rank 0 reads each command from the parent and
    broadcasts it; every rank measures the contender named; rank 0 replies with what
    `measure` returned (a contender it returns None for is skipped). Waits sleep."""
    command = np.zeros(2, np.int64)  # contender index (-1: quit), steps
    while True:
        if comm.Get_rank() == 0:
            message = read_command()
            wanted = message["cmd"] == "run"
            command[:] = (
                (names.index(message["contender"]), message["steps"]) if wanted else (-1, 0)
            )
        idle_wait(comm.Ibcast(command, root=0))
        if command[0] < 0:
            return
        name, steps = names[command[0]], int(command[1])
        log.any_rank(f"measuring {name}: {steps} steps")  # the last words, should it hang
        result = measure(name, steps)
        if comm.Get_rank() == 0 and result is not None:
            reply({"contender": name, "steps": steps, **result})


def read_command() -> dict:
    """The parent's next command; a closed pipe means the parent is gone, so quit."""
    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else {"cmd": "quit"}


class Turns:
    """Contenders in launches of their own (TensorFlow's workers beside ringtrain's mpirun)
    take turns round by round through marker files in a folder their leaders share: a launch
    waits for the one before it in `order` to finish the same round (the first, for the last
    to finish the round before). A launch that failed is marked so, and nobody waits on it."""

    def __init__(self, folder: str | Path, order: list[str], me: str, timeout: float = 900.0):
        self.folder, self.order, self.me, self.timeout = Path(folder), order, me, timeout

    def wait(self, round_: int) -> None:
        """Block (sleeping) until it is this launch's turn in `round_`."""
        i = self.order.index(self.me)
        before, its_round = self.order[i - 1], round_ if i > 0 else round_ - 1
        if its_round < 0 or before == self.me:
            return
        until = time.monotonic() + self.timeout
        while not (self.folder / f"{before}-{its_round}").exists():
            if (self.folder / f"{before}-failed").exists():
                return
            if time.monotonic() > until:
                raise RunFailed(f"{before} did not finish round {its_round} in {self.timeout} s")
            time.sleep(0.02)

    def done(self, round_: int) -> None:
        (self.folder / f"{self.me}-{round_}").touch()

    def failed(self, launch: str) -> None:
        (self.folder / f"{launch}-failed").touch()
