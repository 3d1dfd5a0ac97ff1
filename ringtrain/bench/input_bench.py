"""`ringtrain bench input`: training from TFRecord files on disk against training from memory.

A synthetic set of 64×64×3 uint8 images larger than 4 GB (`ringtrain data make-synthetic`,
kept outside the checkout and reused when complete) is trained on by a small CNN through
`ringtrain train`, 2 ranks `--bind-to core`, one compute thread each, alternating round by
round:

- from memory: `--data bench_data.py:arrays`, the set's first steps × batch examples as numpy
  arrays (the steps see as many examples either way, and memory need not hold 4 GB twice);
- from disk: `--data-files SET/*.tfrecord --data ringtrain.synthetic_files:parse_image`, the
  page cache dropped first and the whole mpirun inside a memory cgroup whose limit is well
  below the set, so the records come from the disk and not from the machine's 24 GiB.

Both launches run inside a cgroup of their own (only the disk's has a limit), from which a
thread samples the ranks' VmHWM and the bytes they read from storage. After the rounds, the
input pipeline alone (bench/input_worker) reads the set from a cold cache in the disk's cgroup.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import median

from ringtrain.bench.common import (
    PROTOCOL,
    deadline,
    round_ratios,
    spread,
    summarise_contenders,
)
from ringtrain.bounded import RunFailed, last_words, run_bounded
from ringtrain.cluster import control
from ringtrain.cluster.memory import join, memory_parent, set_limit
from ringtrain.errors import UserError
from ringtrain.launch.mpirun import binding_flags, host_flags, mpi_env, mpirun_command
from ringtrain.proc import parent_pid

SHAPE, CLASSES, SEED = (64, 64, 3), 10, 0
BATCH, LR = 256, 0.01
SIZES = {  # mode -> (examples, shards, steps per launch, seconds of the pipeline alone)
    "full": (350_000, 64, 60, 60.0),
    "quick": (4_000, 4, 4, 2.0),
}
MEMORY, DISK = "from memory", "from disk"
GIB = 1 << 30
MEMORY_LIMIT = 2 * GIB  # the disk cgroup: 2 ranks' TensorFlow (~0.6 GiB each) and little cache
TARGETS = {
    "disk_at_least_0.95_of_memory": ("samples_per_sec ratio, from disk / from memory", 0.95),
    "input_wait_at_most_0.05": ("input_wait_fraction from disk (worst rank)", 0.05),
}
LAUNCH_SECONDS = 600  # one launch: start-up, indexing the set, tracing and the steps
SAMPLE_SECONDS = 0.2
METRICS = "metrics.json"  # what each launch writes (--metrics-out) in the work folder
CHECKOUT = Path(__file__).resolve().parents[2]
MODEL_SOURCE = f'''"""The CNN of `ringtrain bench input`, written by the bench."""

import keras


def cnn():
    inputs = keras.Input({SHAPE}, dtype="uint8")
    x = keras.layers.Rescaling(1 / 255)(inputs)
    x = keras.layers.Conv2D(32, 3, activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(64, 3, activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(64, 3, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inputs, keras.layers.Dense({CLASSES})(x), name="input_bench_cnn")
    model.compile(
        optimizer=keras.optimizers.SGD({LR}),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model
'''
DATA_SOURCE = '''"""The set's first examples, in memory: written by `ringtrain bench input`."""

from ringtrain.synthetic_files import examples


def arrays():
    return examples({n}, {shape}, {classes}, {seed})
'''
NOTES = {
    MEMORY: "--data bench_data.py:arrays: the set's first steps x global batch examples, made "
    "by ringtrain.synthetic_files.examples (the same examples as the files' first records), "
    "so each launch's steps see as many examples as from disk; the cgroup has no limit",
    DISK: "--data-files SET/*.tfrecord --data ringtrain.synthetic_files:parse_image, records "
    "read by index with pread and the next step's read ahead on a thread; page cache dropped "
    "before each launch; mpirun and its ranks in a memory cgroup limited below the set's size",
    "pipeline alone": "one process, one compute thread (a rank's share), cache dropped, in the "
    "disk's cgroup: index the files, then read and parse global batches in training's shuffled "
    "order until its seconds are up",
    "read bytes": "what the ranks read from storage (/proc/PID/io read_bytes, sampled every "
    f"{SAMPLE_SECONDS} s), over the whole launch: it includes the index pass over every "
    "record's header at start-up, which each rank makes",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hosts",
        help="two nodes of a rehearsal cluster brought up with --mem-per-node below the set's "
        "size, e.g. node1,node2: a rank on each, under its node's memory cap",
    )
    p.add_argument(
        "--data-dir",
        help="where the synthetic set is made, and reused when complete (default: "
        "/var/tmp/ringtrain-input-bench; quick: a scratch folder); never inside the checkout",
    )


# ---- the set and the files the launches read ----------------------------------------------


def data_dir(args: argparse.Namespace) -> Path:
    """The set's folder: outside the checkout, so gigabytes never reach the repository."""
    if args.data_dir:
        folder = Path(args.data_dir)
    elif args.quick:
        folder = Path(tempfile.gettempdir()) / "ringtrain-bench" / "input-data"
    else:
        folder = Path("/var/tmp/ringtrain-input-bench")
    folder = folder.resolve()
    if folder == CHECKOUT or CHECKOUT in folder.parents:
        raise UserError(f"--data-dir {folder} is inside the checkout; give a folder outside it")
    return folder


def synthetic_set(folder: Path, examples: int, shards: int, logs: Path) -> Path:
    """The set's folder, made by `ringtrain data make-synthetic` unless a complete one is there:
    a set is written under a `.partial` name and renamed only once whole."""
    h, w, c = SHAPE
    done = folder / f"images-{examples}x{h}x{w}x{c}-k{CLASSES}-seed{SEED}-{shards}shards"
    if done.is_dir():
        return done
    partial = done.with_name(done.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted earlier attempt
    folder.mkdir(parents=True, exist_ok=True)
    make = [sys.executable, "-m", "ringtrain.cli", "data", "make-synthetic", str(partial)]
    make += ["--format", "tfrecord", "--examples", str(examples), "--shape", f"{h},{w},{c}"]
    make += ["--classes", str(CLASSES), "--shards", str(shards), "--seed", str(SEED)]
    run_bounded(make, mpi_env(), LAUNCH_SECONDS, logs / "make-synthetic.log", quiet=True)
    partial.rename(done)
    return done


def set_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.tfrecord"))


def write_sources(work: Path, examples: int) -> tuple[Path, Path]:
    """The --model and --data files the launches name."""
    model, data = work / "bench_model.py", work / "bench_data.py"
    model.write_text(MODEL_SOURCE)
    data.write_text(DATA_SOURCE.format(n=examples, shape=SHAPE, classes=CLASSES, seed=SEED))
    return model, data


# ---- the memory cgroups, the page cache, the ranks' /proc ---------------------------------


@contextmanager
def memory_cgroup(name: str, limit: int | None) -> Iterator[Path]:
    """A child memory cgroup (with `limit` bytes, if given), removed afterwards."""
    parent, _ = memory_parent("bench input")
    group = parent / f"ringtrain-input-bench-{os.getpid()}-{name}"
    try:
        group.mkdir()
    except OSError as exc:
        raise UserError(
            f"cannot make memory cgroup {group}: {exc.strerror} (run as root)"
        ) from None
    try:
        if limit is not None:
            set_limit(group, limit)
        yield group
    finally:
        for _ in range(50):  # its last processes may still be exiting
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def drop_page_cache() -> None:
    """So that the next reads come from the disk, not from memory."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        raise UserError(f"cannot drop the page cache: {exc.strerror} (run as root)") from None


def proc_field(pid: int, name: str, field: str) -> int | None:
    """A `field:` value of /proc/PID/NAME (status in kB, turned to bytes; io in bytes)."""
    try:
        with open(f"/proc/{pid}/{name}") as text:
            for line in text:
                if line.startswith(field + ":"):
                    value = int(line.split()[1])
                    return value * 1024 if name == "status" else value
    except (OSError, ValueError):
        return None
    return None


def is_rank(pid: int) -> bool:
    """A `python -m ringtrain.cli` process (not the mpirun whose arguments name it)."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"ringtrain.cli" in words and Path(words[0].decode()).name != "mpirun"


class RankSampler:
    """The ranks in some cgroups, sampled on a thread while they run: each one's VmHWM and the
    bytes it read from storage, as last seen (both only grow), and the most anonymous memory
    (RssAnon) a sample saw: what a memory cgroup kills for, which VmHWM overstates by the
    shared libraries' pages. A peak between samples is missed, so it is a lower bound."""

    def __init__(self, groups: list[Path]):
        self.groups = groups
        self.seen: dict[int, tuple[int, int]] = {}  # pid -> (VmHWM, read_bytes)
        self.anonymous: dict[int, int] = {}  # pid -> the highest RssAnon sampled
        # A rank's parent under a memory cap (memory_kill) has its command line, and is seen
        # alone before it forks: not a rank, once it is known to be a parent.
        self.supervisors: set[int | None] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RankSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            pids = []
            for group in self.groups:
                try:
                    pids += [int(p) for p in (group / "cgroup.procs").read_text().split()]
                except OSError:
                    continue
            found = [pid for pid in pids if is_rank(pid)]
            self.supervisors |= {parent_pid(pid) for pid in found}
            for pid in found:
                high = proc_field(pid, "status", "VmHWM")
                read = proc_field(pid, "io", "read_bytes")
                if high is not None and read is not None:
                    self.seen[pid] = (high, read)
                anonymous = proc_field(pid, "status", "RssAnon")
                if anonymous is not None:
                    self.anonymous[pid] = max(anonymous, self.anonymous.get(pid, 0))

    def ranks(self) -> list[tuple[int, int]]:
        return [seen for pid, seen in self.seen.items() if pid not in self.supervisors]

    def ranks_vmhwm(self) -> list[int]:
        return [high for high, _ in self.ranks()]

    def ranks_anonymous_peak(self) -> list[int]:
        """In the order of ranks_vmhwm."""
        return [self.anonymous.get(pid, 0) for pid in self.seen if pid not in self.supervisors]

    def read_bytes(self) -> int:
        return sum(read for _, read in self.ranks())


def cgroup_figure(group: Path, v1: str, v2: str) -> int | None:
    """A counter of the cgroup (v1's file name or v2's), None where neither is."""
    for name in (v1, v2):
        try:
            return int((group / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return None


# ---- where the ranks run ------------------------------------------------------------------


def node_groups(hosts: str, bench: str = "input") -> tuple[list[Path], int]:
    """The memory cgroups of the rehearsal nodes `hosts` names, and their cap: each rank runs
    under its node's cap, as on a cluster node whose memory its jobs share."""
    spec = control.read_spec()
    if spec.mem_per_node is None:
        raise UserError(
            f"bench {bench} --hosts needs a cluster brought up with --mem-per-node: the nodes' "
            "caps are what it measures against"
        )
    groups = {node.name: node.memory_group for node in spec.layout().nodes}
    names = hosts.split(",")
    unknown = [name for name in names if name not in groups]
    if unknown:
        raise UserError(f"--hosts {hosts}: no node {unknown[0]} (the cluster has {sorted(groups)})")
    return [groups[name] for name in names], spec.mem_per_node


def placement_flags(hosts: str | None) -> list[str]:
    """Both contenders alike: a rank bound to each core of this host, or a rank on each node."""
    return host_flags(hosts) if hosts else binding_flags("core")


# ---- the launches -------------------------------------------------------------------------


def train_command(
    contender: str,
    set_folder: Path,
    model: Path,
    data: Path,
    steps: int,
    work: Path,
    hosts: str | None = None,
) -> list[str]:
    """The contender's `mpirun ... ringtrain train`: the same model, batch, steps and pinning;
    only where the examples come from differs."""
    flags = ["train", "--model", f"{model}:cnn", "--batch-size", str(BATCH)]
    flags += ["--steps", str(steps), "--seed", str(SEED), "--progress", "none"]
    flags += ["--metrics-out", str(work / METRICS)]
    if contender == DISK:
        pattern = str(set_folder / "*.tfrecord")
        flags += ["--data-files", pattern, "--data", "ringtrain.synthetic_files:parse_image"]
    else:
        flags += ["--data", f"{data}:arrays"]
    return mpirun_command(2, "ringtrain.cli", *flags, placement=placement_flags(hosts))


def launch(
    contender: str, command: list[str], group: Path, sampled: list[Path], work: Path, budget: float
) -> dict:
    """One `ringtrain train`, mpirun in the cgroup `group`: its metrics, and what the sampler
    saw of the ranks in the cgroups `sampled` (the same group, or the nodes' groups)."""
    out = work / METRICS
    out.unlink(missing_ok=True)
    if contender == DISK:
        drop_page_cache()
    log = work / f"{contender.replace(' ', '_')}.log"
    started = time.perf_counter()
    with RankSampler(sampled) as sampler:
        run_bounded([*join(group), *command], mpi_env(1), budget, log, quiet=True)
    seconds = time.perf_counter() - started
    metrics = json.loads(out.read_text())
    read = sampler.read_bytes()
    return {
        "samples_per_sec": metrics["samples_per_sec"],
        "input_wait_fraction": metrics["input_wait_fraction"],
        "input_wait_s": metrics["input_wait_s"],
        "step_breakdown_ms": metrics["step_breakdown_ms"],
        "peak_resident_bytes": metrics["peak_resident_bytes"],
        "peak_resident_above_start_bytes": metrics["peak_resident_above_start_bytes"],
        "ranks_vmhwm_bytes": sampler.ranks_vmhwm(),
        "read_bytes": read,
        "launch_seconds": seconds,
        "read_bytes_per_sec": read / seconds,
    }


def pipeline_alone(set_folder: Path, group: Path, seconds: float, logs: Path) -> dict:
    """bench/input_worker in the disk's cgroup, from a cold cache: its protocol line."""
    drop_page_cache()
    worker = [sys.executable, "-m", "ringtrain.bench.input_worker"]
    command = [*join(group), *worker, str(set_folder / "*.tfrecord"), str(seconds)]
    log = logs / "pipeline_alone.log"
    run_bounded(command, mpi_env(1), LAUNCH_SECONDS, log, quiet=True)
    said = [ln for ln in log.read_text().splitlines() if ln.startswith(PROTOCOL)]
    if not said:
        raise RunFailed(f"the pipeline alone said nothing: {last_words(log)}")
    found = json.loads(said[-1].removeprefix(PROTOCOL))
    found["mb_per_sec"] = found["records_per_sec"] * found["record_bytes"] / 1e6
    found["read_mb_per_sec"] = found["read_bytes"] / found["seconds"] / 1e6
    found["cpu_ms_per_record"] = 1e3 * found["cpu_seconds"] / found["records"]
    return found


# ---- the run ------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict:
    """Make or find the set, alternate the two launches round by round (each round in the
    other order), then the pipeline alone."""
    examples, shards, steps, alone_seconds = SIZES["quick" if args.quick else "full"]
    limit = time.monotonic() + deadline(args.quick)
    hosts = getattr(args, "hosts", None)
    nodes, node_cap = node_groups(hosts) if hosts else ([], None)
    disk_limit = node_cap or MEMORY_LIMIT
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        set_folder = synthetic_set(data_dir(args), examples, shards, work)
        if hosts and not args.quick and (size := set_bytes(set_folder)) <= disk_limit:
            raise UserError(
                f"the set ({_gib(size)}) fits under the nodes' memory cap "
                f"({_gib(disk_limit)}): bring the cluster up with a smaller --mem-per-node"
            )
        model, data = write_sources(work, steps * BATCH)
        with (
            memory_cgroup("disk", MEMORY_LIMIT) as disk_group,
            memory_cgroup("memory", None) as memory_group,
        ):
            groups = {MEMORY: memory_group, DISK: disk_group}
            for round_index in range(args.rounds):
                shift = round_index % len(groups)
                for contender in [*groups][shift:] + [*groups][:shift]:
                    budget = min(LAUNCH_SECONDS, max(1.0, limit - time.monotonic()))
                    command = train_command(contender, set_folder, model, data, steps, work, hosts)
                    group = groups[contender]
                    found = launch(contender, command, group, nodes or [group], work, budget)
                    rows.append({"round": round_index, "contender": contender, **found})
            alone = pipeline_alone(set_folder, disk_group, alone_seconds, work)
            peaks = [
                cgroup_figure(group, "memory.max_usage_in_bytes", "memory.peak")
                for group in nodes or [disk_group]
            ]
    dataset = {
        "folder": str(set_folder),
        "examples": examples,
        "shards": shards,
        "shape": list(SHAPE),
        "classes": CLASSES,
        "bytes": set_bytes(set_folder),
    }
    return summarise(rows, alone, dataset, steps) | {
        "rounds": args.rounds,
        "steps_per_launch": steps,
        "memory_examples": steps * BATCH,
        "cgroup": {
            "version": memory_parent("bench input")[1],
            "disk_limit_bytes": disk_limit,
            "disk_peak_bytes": max((peak for peak in peaks if peak is not None), default=None),
            "set_exceeds_limit": dataset["bytes"] > disk_limit,
        },
        "pinning": {
            "rule": "both contenders alike: 2 ranks, "
            + (
                "one on each node, under the node's memory cap (both contenders), "
                if hosts
                else "each bound to a core, "
            )
            + "one compute thread (RINGTRAIN_THREADS=1); the read-ahead and tf.data's parsing "
            "share the rank's core",
            "mpirun_flags": placement_flags(hosts),
        },
        "workload": {
            "model": "Rescaling(1/255), Conv2D 32, MaxPool, Conv2D 64, MaxPool, Conv2D 64, "
            "GlobalAveragePooling, Dense 10 (logits)",
            "optimizer": f"SGD(learning_rate={LR})",
            "global_batch": BATCH,
            "ranks": 2,
        },
        "hosts": hosts,
        "where": f"2 rehearsal nodes ({hosts}), each capped at {_gib(disk_limit)}"
        if hosts
        else "one host",
        "notes": NOTES,
    }


def _median_of(rows: list[dict], contender: str, key: str) -> float:
    return median(r[key] for r in rows if r["contender"] == contender)


def summarise(rows: list[dict], alone: dict, dataset: dict, steps: int) -> dict:
    """Per contender: samples/s against memory round by round, input wait, the ranks' VmHWM
    against the set and what they read; the targets; where the step's time went."""
    summary = summarise_contenders(rows, "samples_per_sec", MEMORY, "vs_memory")
    for entry in summary:
        name, mine = entry["contender"], [r for r in rows if r["contender"] == entry["contender"]]
        fullest = max(r["peak_resident_bytes"] for r in mine)
        entry |= {
            key + "_median": _median_of(rows, name, key)
            for key in ("input_wait_fraction", "read_bytes", "read_bytes_per_sec")
        }
        entry |= {
            "step_ms_median": median(r["step_breakdown_ms"]["step"] for r in mine),
            "ranks_vmhwm_bytes_per_round": [sorted(r["ranks_vmhwm_bytes"]) for r in mine],
            "fullest_rank_vmhwm_bytes": fullest,
            "fullest_rank_vmhwm_of_set": fullest / dataset["bytes"],
        }
    per_round = round_ratios(rows, "samples_per_sec", DISK, MEMORY)
    ratio = {"per_round": per_round, **spread(per_round)}
    waited = _median_of(rows, DISK, "input_wait_fraction")
    values = dict(zip(TARGETS, (ratio["median"], waited), strict=True))
    targets = {
        name: {
            "measures": measures,
            "threshold": threshold,
            "value": values[name],
            "met": values[name] >= threshold
            if name.startswith("disk_at_least")
            else values[name] <= threshold,
        }
        for name, (measures, threshold) in TARGETS.items()
    }
    return {
        "raw": rows,
        "summary": summary,
        "ratio_disk_over_memory": ratio,
        "targets": targets,
        "dataset": dataset,
        "pipeline_alone": alone,
        "profile": profile(rows, alone, steps),
    }


def profile(rows: list[dict], alone: dict, steps: int) -> dict:
    """Where a disk step's time goes beyond a memory step's, in median ms per step: the wait
    for the read-ahead, and the CPU the read-ahead itself takes (a rank's share of a global
    batch at the pipeline-alone cost per record) on the core the step computes on."""
    memory_step = median(r["step_breakdown_ms"]["step"] for r in rows if r["contender"] == MEMORY)
    disk_step = median(r["step_breakdown_ms"]["step"] for r in rows if r["contender"] == DISK)
    timed_steps = max(1, steps - 1)  # the metrics leave out the first step, which traces
    wait = median(1e3 * r["input_wait_s"] / timed_steps for r in rows if r["contender"] == DISK)
    read_ahead = alone["cpu_ms_per_record"] * BATCH / 2
    return {
        "memory_step_ms": memory_step,
        "disk_step_ms": disk_step,
        "disk_extra_ms": disk_step - memory_step,
        "disk_input_wait_ms_per_step": wait,
        "read_ahead_cpu_ms_per_step_estimate": read_ahead,
        "unexplained_ms": disk_step - memory_step - read_ahead,
    }


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def describe(report: dict) -> list[str]:
    """A line per contender, the ratio and targets, memory against the set, the disk, the
    pipeline alone and, when a target is missed, where the time went."""
    lines = []
    for e in report["summary"]:
        low, high = e["samples_per_sec_min"], e["samples_per_sec_max"]
        lines.append(
            f"{e['contender']}: {e['samples_per_sec_median']:.0f} samples/s ({low:.0f}-{high:.0f})"
            f", input wait {e['input_wait_fraction_median']:.1%}, fullest rank's VmHWM "
            f"{_gib(e['fullest_rank_vmhwm_bytes'])} ({e['fullest_rank_vmhwm_of_set']:.1%} of "
            f"the set), read {_gib(e['read_bytes_median'])} at "
            f"{e['read_bytes_per_sec_median'] / 1e6:.0f} MB/s"
        )
    ratio, data, alone = (
        report["ratio_disk_over_memory"],
        report["dataset"],
        report["pipeline_alone"],
    )
    lines.append(f"disk / memory: {ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})")
    for name, t in report["targets"].items():
        lines.append(f"target {name}: {t['value']:.3f}, {'met' if t['met'] else 'NOT met'}")
    cgroup = report["cgroup"]
    lines.append(
        f"set: {data['examples']} records, {_gib(data['bytes'])}; disk cgroup limit "
        f"{_gib(cgroup['disk_limit_bytes'])} (cgroup {cgroup['version']})"
    )
    lines.append(
        f"pipeline alone: {alone['records_per_sec']:.0f} records/s ({alone['mb_per_sec']:.0f} "
        f"MB/s of records, {alone['read_mb_per_sec']:.0f} MB/s read), "
        f"{alone['cpu_ms_per_record']:.3f} CPU ms per record; indexing took "
        f"{alone['index_seconds']:.1f} s"
    )
    if not all(t["met"] for t in report["targets"].values()):
        p = report["profile"]
        lines.append(
            f"where the time went: a disk step {p['disk_step_ms']:.0f} ms against "
            f"{p['memory_step_ms']:.0f} ms from memory; input wait "
            f"{p['disk_input_wait_ms_per_step']:.1f} ms, read-ahead CPU about "
            f"{p['read_ahead_cpu_ms_per_step_estimate']:.0f} ms, unexplained "
            f"{p['unexplained_ms']:.0f} ms per step"
        )
    lines.append(f"where: {report['where']}")
    return lines


def draw(report: dict, path: str) -> None:
    """samples/s per contender and the ratio per round; VmHWM against the set; the profile."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, ratio, memory, steps) = plt.subplots(1, 4, figsize=(17, 4))
    entries = report["summary"]
    medians = [e["samples_per_sec_median"] for e in entries]
    spans = [
        [m - e["samples_per_sec_min"] for m, e in zip(medians, entries, strict=True)],
        [e["samples_per_sec_max"] - m for m, e in zip(medians, entries, strict=True)],
    ]
    speed.bar([e["contender"] for e in entries], medians, yerr=spans, capsize=4)
    speed.set(ylabel="samples/s (median, min-max)", title="training throughput, 2 ranks")
    rounds = report["ratio_disk_over_memory"]["per_round"]
    ratio.plot(range(len(rounds)), rounds, "ko-")
    ratio.axhline(report["targets"]["disk_at_least_0.95_of_memory"]["threshold"], color="r")
    ratio.set_xticks(range(len(rounds)))
    ratio.set(xlabel="round", ylabel="from disk / from memory", title="ratio (red: target)")
    ratio.set_ylim(0, 1.05 * max(1.1, *rounds))
    bars = {e["contender"]: e["fullest_rank_vmhwm_bytes"] / GIB for e in entries}
    bars |= {
        "disk cgroup limit": report["cgroup"]["disk_limit_bytes"] / GIB,
        "the set": report["dataset"]["bytes"] / GIB,
    }
    memory.barh([textwrap.fill(k, 18) for k in bars], list(bars.values()), color="grey")
    memory.invert_yaxis()
    memory.set(xlabel="GiB", title="fullest rank's VmHWM against the set")
    p = report["profile"]
    parts = {
        "memory step": p["memory_step_ms"],
        "disk step": p["disk_step_ms"],
        "disk input wait": p["disk_input_wait_ms_per_step"],
        "read-ahead CPU (est.)": p["read_ahead_cpu_ms_per_step_estimate"],
    }
    steps.bar([textwrap.fill(k, 10) for k in parts], list(parts.values()), color="tab:orange")
    steps.tick_params(axis="x", labelsize=8)
    steps.set(ylabel="ms per step (median)", title="where a step's time goes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
