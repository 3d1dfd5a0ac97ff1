"""`ringtrain plan` and `ringtrain plan calibrate`: the strategy table, from a calibration.

`calibrate` starts two 2-rank launches of plan/measure.py: one on this node (compute, and the
links inside a node) and, with --hosts, one across two nodes (the links between them). It
writes one JSON file with a fingerprint of the machine. `plan` reads that file, refuses one from
another machine or model in one line (unless --force), and prints every candidate the cost
model predicts, fastest fitting one first, with the command line that runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringtrain.bounded import RunFailed, run_bounded
from ringtrain.config import (
    TrainConfig,
    add_train_arguments,
    check_values,
    is_model_function,
    positive_whole_number,
)
from ringtrain.errors import UserError
from ringtrain.keras_model.source import add_source_arguments, check_source_flags, source_flags
from ringtrain.launch.mpirun import host_flags, mpi_env, mpirun_command
from ringtrain.machine import machine_facts
from ringtrain.memory_limit import rank_limit
from ringtrain.pipeline.costs import LinkModel, MeasuredCurve
from ringtrain.plan.costmodel import (
    FORMAT,
    Calibration,
    Candidate,
    ElementCost,
    Prediction,
    plan,
)

DEFAULT_CALIBRATION = "calibration.json"
FINGERPRINT_KEYS = ("cpu_model", "cpus", "tensorflow", "horovod")
# train's flags that plan takes: what it plans for, and the memory a rank may hold.
PLANNED_FLAGS = ("model", "dataset", "optimizer", "batch_size", "memory_per_rank")
COMPILED = "compiled"  # a user's model brings its optimizer: what its calibration records


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=["calibrate"], help="measure instead of plan")
    add_train_arguments(p, PLANNED_FLAGS)  # declared once, with train's defaults and help
    add_source_arguments(p)
    p.set_defaults(optimizer=None)  # absent unless typed: a compiled model refuses it
    p.add_argument("--nodes", type=positive_whole_number, default=1)
    p.add_argument("--ranks-per-node", type=positive_whole_number, default=2)
    p.add_argument("--grid", help="only the grid DxP (D replicas of P stages)")
    p.add_argument(
        "--calibration",
        help=f"the calibration file (default {DEFAULT_CALIBRATION}; plan makes it if missing)",
    )
    p.add_argument("--force", action="store_true", help="accept another machine's calibration")
    p.add_argument("--json", action="store_true", help="the table as JSON")
    p.add_argument("--hosts", help="calibrate: two hosts a,b for the across-node links")


@dataclass(frozen=True)
class Planned:
    """What a plan is for: a built-in model on a dataset with an optimizer, or a user's
    --model FUNCTION (with its arguments) on --data or a dataset, with its compiled optimizer."""

    model: str
    dataset: str
    optimizer: str
    data: str | None = None
    model_args: tuple[str, ...] = ()

    @classmethod
    def of(cls, args: argparse.Namespace) -> Planned:
        """From plan's flags, each checked as train checks it."""
        check_source_flags(args.model, args.model_arg, args.data, args.dataset)
        optimizer = args.optimizer
        if is_model_function(args.model):
            if optimizer is not None:
                raise UserError("--optimizer does not apply to a compiled model")
            optimizer = COMPILED
        else:
            optimizer = optimizer or TrainConfig.optimizer
        planned = cls(args.model, args.dataset, optimizer, args.data, tuple(args.model_arg))
        check_values(
            TrainConfig(
                model=args.model,
                dataset=args.dataset,
                batch_size=args.batch_size,
                optimizer=TrainConfig.optimizer if optimizer == COMPILED else optimizer,
            )
        )
        return planned

    @property
    def name(self) -> str:
        """The model as a calibration names it: with its --model-arg values."""
        return " ".join((self.model, *self.model_args))

    @property
    def data_name(self) -> str:
        return self.data or self.dataset

    def flags(self) -> list[str]:
        """train's flags that say what is trained, as `plan` was given them."""
        flags = source_flags(self.model, self.model_args, self.data, self.dataset)
        return flags + ([] if self.optimizer == COMPILED else ["--optimizer", self.optimizer])


def run_plan_command(args: argparse.Namespace) -> int:
    planned = Planned.of(args)
    path = args.calibration or DEFAULT_CALIBRATION
    if args.action == "calibrate" or (args.calibration is None and not Path(path).exists()):
        if args.action != "calibrate":
            print(f"no {path} here: calibrating this node first", flush=True)
        calibrate(planned, args.batch_size, args.hosts, path)
        print(f"wrote {path}")
        if args.action == "calibrate":
            return 0
    cal = load_calibration(path, planned, args.force)
    grid = _grid(args.grid, args.nodes * args.ranks_per_node)
    # read as `train` reads it: the flag, else this node's cgroup or Slurm limit, shared
    limit = rank_limit(args.memory_per_rank, args.ranks_per_node)
    memory = limit.bytes if limit else None
    table = plan(cal, args.nodes, args.ranks_per_node, args.batch_size, memory)
    if grid:
        table = [p for p in table if (p.candidate.dp_size, p.candidate.pp_size) == grid]
    if not table:
        raise UserError(f"no configuration divides the global batch {args.batch_size}")
    best = next((p for p in table if p.fits and not p.candidate.fp16_allreduce), None)
    command = _command(planned, args, best) if best else None
    if args.json:
        rows = [p.to_json() for p in table]
        print(json.dumps({"candidates": rows, "recommended": command}, indent=1))
    else:
        if limit:
            print(f"memory per rank: {limit.bytes / 2**20:.0f} MiB ({limit.source})")
        _print_table(table)
        if command is None:
            raise UserError(f"nothing fits in {memory} bytes per rank ({limit.source})")
        print(f"recommended: {command}")
    return 0


def _grid(text: str | None, ranks: int) -> tuple[int, int] | None:
    if text is None:
        return None
    found = re.fullmatch(r"(\d+)x(\d+)", text)
    if not found or min(int(found.group(1)), int(found.group(2))) < 1:
        raise UserError(f"--grid wants DxP like 2x2, got {text!r}")
    d, p = int(found.group(1)), int(found.group(2))
    if d * p != ranks:
        raise UserError(
            f"grid {d}x{p} needs {d * p} ranks, but --nodes x --ranks-per-node gives {ranks}"
        )
    return d, p


def _command(planned: Planned, args: argparse.Namespace, best: Prediction) -> str:
    ranks = args.nodes * args.ranks_per_node
    flags = [*planned.flags(), "--batch-size", str(args.batch_size), *best.candidate.flags()]
    return f"mpirun -np {ranks} ringtrain train {shlex.join(flags)}"


def _print_table(table: list[Prediction]) -> None:
    head = f"{'configuration':34} {'step ms':>8} {'samples/s':>10} {'compute':>8} "
    print(head + f"{'comm':>8} {'bubble':>7} {'peak MiB':>9}  fits")
    for p in table:
        print(
            f"{p.candidate.label():34} {p.step_seconds * 1e3:8.2f} {p.samples_per_second:10.0f} "
            f"{p.compute_seconds * 1e3:8.2f} {p.exposed_comm_seconds * 1e3:8.2f} "
            f"{p.bubble:7.2f} {p.peak_bytes / 2**20:9.1f}  {'yes' if p.fits else 'no'}"
        )


# ---- the calibration file -------------------------------------------------------------------


def fingerprint() -> dict:
    facts = machine_facts()
    return {key: facts[key] for key in FINGERPRINT_KEYS}


def load_calibration(path: str, planned: Planned, force: bool = False) -> Calibration:
    """Read and check a calibration file; one-line UserError for each way it can be wrong."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(
            f"{path}: no calibration file; run `ringtrain plan calibrate` first"
        ) from None
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: unreadable calibration ({err.__class__.__name__})") from None
    try:
        cal = _from_json(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise UserError(f"{path}: damaged calibration (bad or missing {err})") from None
    model, dataset, optimizer = planned.name, planned.data_name, planned.optimizer
    if (cal.model, cal.dataset) != (model, dataset):
        raise UserError(
            f"{path}: calibrated for model {cal.model!r} on {cal.dataset!r}, "
            f"not {model!r} on {dataset!r}"
        )
    if cal.optimizer != optimizer:  # Adam's step and state cost more than SGD's
        raise UserError(
            f"{path}: calibrated with optimizer {cal.optimizer!r}, not {optimizer!r}; "
            f"run `ringtrain plan calibrate --optimizer {optimizer}`"
        )
    here = fingerprint()
    differ = [k for k in FINGERPRINT_KEYS if cal.fingerprint.get(k) != here[k]]
    if differ and not force:
        k = differ[0]
        raise UserError(
            f"{path}: calibrated on another machine ({k} {cal.fingerprint.get(k)!r}, "
            f"here {here[k]!r}); recalibrate or pass --force"
        )
    return cal


def _from_json(doc: dict) -> Calibration:
    if doc.get("format") != FORMAT:
        if str(doc.get("format", "")).startswith(FORMAT.split("/")[0] + "/"):
            raise UserError(
                f"calibration format {doc['format']}, and this ringtrain reads {FORMAT}: "
                "recalibrate with `ringtrain plan calibrate`"
            )
        raise ValueError("format")
    elements = [
        ElementCost(
            {op: (float(a), float(b)) for op, (a, b) in e["seconds"].items()},
            int(e["params"]),
            int(e["input_floats"]),
            int(e["output_floats"]),
        )
        for e in doc["elements"]
    ]
    if not elements:
        raise ValueError("elements")

    def links(table: dict) -> dict[str, LinkModel]:
        return {
            k: LinkModel(
                float(v["latency_s"]), float(v["bytes_per_second"]), float(v["burst_bytes"])
            )
            for k, v in table.items()
        }

    def curves(table: dict) -> dict[str, MeasuredCurve]:
        return {
            k: MeasuredCurve.of([(int(n), float(t)) for n, t in v["points"]])
            for k, v in table.items()
        }

    return Calibration(
        str(doc["model"]),
        str(doc["dataset"]),
        str(doc["optimizer"]),
        elements,
        curves(doc["allreduce"]),
        links(doc["p2p"]),
        int(doc["baseline_bytes"]),
        tuple(float(v) for v in doc["step_seconds"]),
        (int(doc["step_peak"][0]), float(doc["step_peak"][1])),
        {
            (int(r["start"]), int(r["end"])): {
                op: (float(a), float(b)) for op, (a, b) in r["seconds"].items()
            }
            for r in doc["stages"]
        },
        [
            {
                "bounds": [tuple(b) for b in run["bounds"]],
                "microbatch": float(run["microbatch"]),
                "seconds": {str(k): float(v) for k, v in run["seconds"].items()},
                "microbatches": int(run["microbatches"]),
                "added_bytes": int(run["added_bytes"]),
            }
            for run in doc["executor"]
        ],
        dict(doc["fingerprint"]),
        (
            float(doc["engine_step_seconds"]["float32"]),
            float(doc["engine_step_seconds"]["fp16"]),
            int(doc["batch_size"]),
            doc["compute_measured"] == "inter",
        ),
        float(doc["optimizer_slots"]) if "optimizer_slots" in doc else None,
    )


def two_ranks(placement: list[str], module: str, *args: str) -> list[str]:
    """mpirun starting `python -m module args` in 2 ranks, placed by `placement` (host flags),
    or bound as Open MPI binds 2 ranks on one node (a core each), with the environment
    `mpirun ringtrain train` would see (launch.mpirun.mpi_env()): the calibration and the runs
    it predicts start alike. RINGTRAIN_THREADS, if set, reaches every rank."""
    forward = "RINGTRAIN_THREADS" in os.environ
    return mpirun_command(2, module, *args, placement=placement, forward_threads=forward)


REFERENCE_MICROBATCHES = (2, 8)
# What `plan calibrate` runs itself, on 2 ranks at the planned global batch: ringtrain's
# data-parallel engine without and with --fp16-allreduce (measure.py's engine blocks), and the
# executor's 2-stage 1F1B at each of REFERENCE_MICROBATCHES (_executor_reference).
CALIBRATION_RUNS = (
    Candidate(2, 1),
    Candidate(2, 1, fp16_allreduce=True),
    *(Candidate(1, 2, "1f1b", count) for count in REFERENCE_MICROBATCHES),
)
# the run's own calibration reads 3 of its steps spread through it (the 1st, 11th and 21st of
# 30): 8 steps put them within a fraction of a second, in one of this machine's slow or fast
# spells, and every microbatch's action carried that spell into the prediction
REFERENCE_STEPS = 30


def in_sample(prediction: Mapping[str, Any]) -> bool:
    """Whether `plan calibrate` ran this configuration itself, from its prediction's JSON
    (Prediction.to_json: replicas, stages, flags). Predicted at the calibrated batch, such a
    configuration repeats a run the calibration timed, so its error says little about the cost
    model; `bench plan` reports it apart from the configurations calibration never ran."""
    ran = {(c.dp_size, c.pp_size, tuple(c.flags())) for c in CALIBRATION_RUNS}
    return (prediction["replicas"], prediction["stages"], tuple(prediction["flags"])) in ran


def _executor_reference(
    common: list[str], batch: int, placement: list[str], tmp: Path
) -> list[dict]:
    """Short 2-stage 1F1B runs of the executor itself, placed as the compute was measured, at
    two microbatch sizes: their in-run calibration (each action's host time from the trace)
    shows what an action costs beyond the compute measured alone."""
    runs = []
    for candidate in (c for c in CALIBRATION_RUNS if c.schedule):
        count = candidate.microbatches
        metrics = tmp / f"reference-{count}.json"
        flags = [*candidate.flags(), "--steps", str(REFERENCE_STEPS), "--progress", "none"]
        flags += ["--metrics-out", str(metrics)]
        cmd = two_ranks(placement, "ringtrain.cli", "train", *common, *flags)
        try:
            run_bounded(cmd, mpi_env(), 300.0, tmp / "reference.log", quiet=True)
        except RunFailed as err:
            raise UserError(f"calibration of the pipeline executor failed: {err}") from None
        done = json.loads(metrics.read_text())
        runs.append(
            {
                "bounds": done["partition"],
                "microbatch": batch / count,
                "seconds": done["calibration"]["seconds"],
                "microbatches": count,
                "added_bytes": done["peak_resident_above_import_bytes"],
            }
        )
    return runs


def calibrate(planned: Planned, batch: int, hosts: str | None, path: str) -> dict:
    """Measure on this node, or across `hosts` a,b if given, and write the calibration.

    Compute and the executor's own costs are measured where the jobs will run: across the two
    hosts when given (a rank on each, as the nodes' cores and thread pools are), else here;
    the links inside a node are always measured here, and between nodes across the hosts."""
    common = [*planned.flags(), "--batch-size", str(batch)]
    try:
        across = host_flags(hosts) if hosts else None
    except argparse.ArgumentTypeError as err:
        raise UserError(str(err)) from None
    launches = [("intra", [], [] if across else ["--compute"])]
    if across:
        launches.append(("inter", across, ["--compute"]))
    computed = "inter" if across else "intra"
    found: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="ringtrain-calibrate-") as tmp:
        for where, placement, extra in launches:
            out = Path(tmp) / f"{where}.json"
            cmd = two_ranks(placement, "ringtrain.plan.measure", *common, *extra, "--out", str(out))
            print(f"calibrating {where}-node figures ...", flush=True)
            try:
                run_bounded(cmd, mpi_env(), 300.0, Path(tmp) / f"{where}.log")
            except RunFailed as err:
                raise UserError(f"calibration {where} node failed: {err}") from None
            found[where] = json.loads(out.read_text())
        print("calibrating the pipeline executor's own costs ...", flush=True)
        reference = _executor_reference(common, batch, across or [], Path(tmp))
    if hosts and len(set(found["inter"]["hosts"])) < 2:
        raise UserError(f"--hosts {hosts}: both ranks ran on {found['inter']['hosts'][0]}")
    links = {
        "allreduce": {k: v["allreduce"] for k, v in found.items()},
        "p2p": {k: v["p2p"] for k, v in found.items()},
    }
    stamp = {
        **fingerprint(),
        "link_bytes_per_second": {k: v["p2p"]["bytes_per_second"] for k, v in found.items()},
    }
    doc = {
        "format": FORMAT,
        "model": planned.name,
        "dataset": planned.data_name,
        "optimizer": planned.optimizer,
        "optimizer_slots": found[computed]["optimizer_slots"],
        "batch_size": batch,
        "fingerprint": stamp,
        "compute_measured": computed,
        "elements": found[computed]["elements"],
        "step_seconds": found[computed]["step_seconds"],
        "engine_step_seconds": found[computed]["engine_step_seconds"],
        "baseline_bytes": found[computed]["baseline_bytes"],
        "step_peak": found[computed]["step_peak"],
        "stages": found[computed]["stages"],
        "executor": reference,
        **links,
    }
    Path(path).write_text(json.dumps(doc, indent=1))
    return doc
