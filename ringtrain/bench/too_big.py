"""A BERT-large-sized encoder where no node can hold it: run on 4 rehearsal nodes, each
capped (`ringtrain cluster up --nodes 4 --mem-per-node 3G`), one rank per node.

Not a race: each configuration runs once, through the CLI as a user runs it. `single` and
`data` are refused by the memory check (--shard-optimizer is refused for BERT's embedding,
whose gradients are sparse); forced past it, they are killed by the nodes' caps. A 4-stage
1F1B pipeline trains the model.
The report gives each stage rank's peak resident set (VmHWM) and its sampled anonymous memory
against the check's prediction and the cap, each node's peak cgroup usage, the step time and
the losses.
The encoder is examples/bert_classifier.py at BERT-large's shape (24 layers, hidden 1024, 16
heads, intermediate 4096, a 30,522-token vocabulary; about 335M weights), random weights,
sequences of 32 tokens, one batch of examples seen at every step, so the loss falls in 20
steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import tempfile
import textwrap
import time
from pathlib import Path

from ringtrain.bench.common import deadline
from ringtrain.bench.input_bench import RankSampler, cgroup_figure, node_groups
from ringtrain.bounded import run_bounded
from ringtrain.launch.mpirun import host_flags, mpi_env, mpirun_command

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "bert_classifier.py"
# mode -> the encoder's model args. Every step sees the same batch of examples: over different
# batches, an encoder from random weights barely moves its loss from chance in 20 steps.
SHAPES = {
    "full": {
        "layers": 24,
        "hidden": 1024,
        "heads": 16,
        "intermediate": 4096,
        "learning_rate": 2e-5,
    },
    "quick": {"layers": 4, "hidden": 256, "heads": 4, "intermediate": 1024, "learning_rate": 1e-4},
}
VOCABULARY = 30522
TOKENS = 32  # examples/bert_classifier.py's sequence length
NODES = 4
BATCH, MICROBATCHES, STEPS, QUICK_STEPS = 8, 4, 20, 4
LAUNCH_SECONDS = 1800.0  # the pipeline's 20 steps of a 335M-weight encoder on 2 shared cores
KILLED = "was killed by the node's memory limit"
UNITS = {"GiB": 2**30, "MiB": 2**20}  # as the memory check writes its figures
QUICK_ROUNDS = 1
DATA_SOURCE = """
import sys

sys.path.insert(0, {folder!r})
import bert_classifier


def data():
    return bert_classifier.data(n={examples}, vocabulary={vocabulary})
"""


def _hosts(text: str) -> str:
    host_flags(text, NODES)  # refuses another count, in one line
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hosts",
        type=_hosts,
        required=True,
        help=f"{NODES} nodes of a rehearsal cluster brought up with --mem-per-node (3G for the "
        "BERT-large shape), a rank on each",
    )


# (name, strategy flags, ranks, forced past the memory check)
RUNS = [
    ("single", ["--strategy", "single"], 1, False),
    ("single, forced", ["--strategy", "single"], 1, True),
    ("data", ["--strategy", "data"], NODES, False),
    ("data, forced", ["--strategy", "data"], NODES, True),
    (
        "pipeline 1f1b",
        ["--strategy", "pipeline", "--schedule", "1f1b", "--partition", "params"]
        + ["--microbatches", str(MICROBATCHES)],
        NODES,
        False,
    ),
]


def measure(args: argparse.Namespace) -> dict:
    shape = SHAPES["quick" if args.quick else "full"]
    steps = QUICK_STEPS if args.quick else STEPS
    hosts = args.hosts.split(",")
    groups, cap = node_groups(args.hosts, "too-big")
    limit = time.monotonic() + deadline(args.quick)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source = work / "tokens.py"
        folder = str(EXAMPLE.parent)
        source.write_text(DATA_SOURCE.format(folder=folder, examples=BATCH, vocabulary=VOCABULARY))
        model = ["--model", f"{EXAMPLE}:build", "--model-arg", f"vocabulary={VOCABULARY}"]
        for key, value in shape.items():
            model += ["--model-arg", f"{key}={value}"]
        common = [*model, "--data", f"{source}:data", "--batch-size", str(BATCH)]
        common += ["--steps", str(steps)]
        common += ["--progress", "none", "--no-shuffle", "--seed", "0"]
        for name, flags, ranks, forced in RUNS:
            metrics = work / "metrics.json"
            metrics.unlink(missing_ok=True)
            extra = ["--metrics-out", str(metrics), *(["--ignore-memory-check"] if forced else [])]
            placement = host_flags(",".join(hosts[:ranks]), ranks)
            command = mpirun_command(
                ranks, "ringtrain.cli", "train", *flags, *common, *extra, placement=placement
            )
            for group in groups:  # each node's peak from here on (cgroup v1 resets it so)
                with contextlib.suppress(OSError):
                    (group / "memory.max_usage_in_bytes").write_text("0")
            log = work / "run.log"
            budget = min(LAUNCH_SECONDS, max(1.0, limit - time.monotonic()))
            started = time.perf_counter()
            with RankSampler(groups[:ranks]) as sampler:
                code = run_bounded(
                    command, mpi_env(1), budget, log, quiet=True, expected=range(256)
                )
            said = log.read_text()
            row = {
                "name": name,
                "ranks": ranks,
                "forced": forced,
                "exit_code": code,
                "seconds": time.perf_counter() - started,
                "predicted_bytes": _predicted(said),
                "predicted_per_rank_bytes": _predicted_by_rank(said),
                "error": _error(said),
                "killed_by_cap": KILLED in said,
                "ranks_vmhwm_bytes": sampler.ranks_vmhwm(),
                "ranks_anonymous_peak_bytes": sampler.ranks_anonymous_peak(),
                "node_peak_bytes": [
                    cgroup_figure(g, "memory.max_usage_in_bytes", "memory.peak")
                    for g in groups[:ranks]
                ],
            }
            if code == 0:
                found = json.loads(metrics.read_text())
                kept = ("losses", "samples_per_sec", "model_resident_bytes")
                row |= {k: found.get(k) for k in kept}
                row["step_seconds"] = BATCH / found["samples_per_sec"]
            rows.append(row)
    return {
        "shape": shape,
        "vocabulary": VOCABULARY,
        "tokens": TOKENS,
        "weights": encoder_weights(shape, VOCABULARY, TOKENS),
        "examples": BATCH,
        "batch": BATCH,
        "microbatches": MICROBATCHES,
        "steps": steps,
        "cap_bytes": cap,
        "hosts": hosts,
        "runs": rows,
        "checks": checks(rows),
    }


def encoder_weights(shape: dict, vocabulary: int, tokens: int) -> int:
    """The classifier's weights, counted from its shape: token, position and segment
    embeddings and their layer norm; per layer the attention's four projections, the
    feed-forward pair and two layer norms; the pooler; the two-class head."""
    hidden, inner = shape["hidden"], shape["intermediate"]
    embeddings = (vocabulary + tokens + 2) * hidden + 2 * hidden
    attention = 4 * (hidden * hidden + hidden)
    feed_forward = 2 * hidden * inner + inner + hidden
    layer = attention + feed_forward + 2 * 2 * hidden
    return embeddings + shape["layers"] * layer + hidden * hidden + hidden + 2 * hidden + 2


def _predicted(text: str) -> float | None:
    """The memory check's prediction per rank, in bytes, from what rank 0 said."""
    found = re.search(r"predicted ([\d.]+) (GiB|MiB) per rank", text)
    if not found:
        return None
    return float(found[1]) * UNITS[found[2]]


def _predicted_by_rank(text: str) -> list[float]:
    """Each pipeline rank's predicted peak, in bytes, where rank 0 listed them (a run that fits
    as stages); else none."""
    found = re.search(r"\(by pipeline rank: ([^)]*)\)", text)
    if not found:
        return []
    return [float(v) * UNITS[u] for v, u in re.findall(r"([\d.]+) (GiB|MiB)", found[1])]


def _error(text: str) -> str | None:
    lines = [ln for ln in text.splitlines() if "error:" in ln]
    return lines[0].strip() if lines else None


def checks(rows: list[dict]) -> dict[str, bool]:
    """What the demonstration claims, each checked against what ran."""
    by_name = {row["name"]: row for row in rows}
    piped = by_name["pipeline 1f1b"]
    losses = piped.get("losses") or []
    head, tail = losses[: len(losses) // 4 or 1], losses[-(len(losses) // 4 or 1) :]
    return {
        "single and data refused by the memory check": all(
            by_name[n]["exit_code"] != 0 and "error: predicted" in (by_name[n]["error"] or "")
            for n in ("single", "data")
        ),
        "single and data killed by the caps when forced": all(
            by_name[n]["exit_code"] != 0 and by_name[n]["killed_by_cap"]
            for n in ("single, forced", "data, forced")
        ),
        "the pipeline trains": piped["exit_code"] == 0,
        "its loss falls": bool(losses) and sum(tail) / len(tail) < sum(head) / len(head),
    }


def describe(report: dict) -> list[str]:
    gib = 2**30
    lines = [
        f"encoder {report['shape']}, vocabulary {report['vocabulary']}, batch "
        f"{report['batch']}, cap {report['cap_bytes'] / gib:.2f} GiB per node"
    ]
    for row in report["runs"]:
        predicted = row["predicted_bytes"]
        line = f"{row['name']:>24}: exit {row['exit_code']}"
        if predicted:
            line += f", predicted {predicted / gib:.2f} GiB per rank"
        if row["predicted_per_rank_bytes"]:
            each = " ".join(f"{b / gib:.2f}" for b in row["predicted_per_rank_bytes"])
            line += f" ({each} by rank)"
        if row["killed_by_cap"]:
            line += ", killed by the cap"
        if row["ranks_vmhwm_bytes"]:
            line += ", VmHWM " + " ".join(f"{b / gib:.2f}" for b in row["ranks_vmhwm_bytes"])
            line += ", anonymous " + " ".join(
                f"{b / gib:.2f}" for b in row["ranks_anonymous_peak_bytes"]
            )
        if "step_seconds" in row:
            losses = row["losses"]
            line += f", {row['step_seconds']:.1f} s/step, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        lines.append(line)
    lines += [f"{claim}: {'yes' if held else 'NO'}" for claim, held in report["checks"].items()]
    return lines


def draw(report: dict, path: str) -> None:
    """Each stage rank's VmHWM against the prediction and the cap; the pipeline's losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    gib = 2**30
    piped = next(r for r in report["runs"] if r["name"] == "pipeline 1f1b")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    peaks = [b / gib for b in piped["ranks_vmhwm_bytes"]]
    anonymous = [b / gib for b in piped["ranks_anonymous_peak_bytes"]]
    left.bar(range(len(peaks)), peaks, label="VmHWM", color="C0")
    left.bar(range(len(anonymous)), anonymous, width=0.5, label="anonymous (sampled)", color="C2")
    predicted = [b / gib for b in piped["predicted_per_rank_bytes"]]
    left.scatter(
        range(len(predicted)), predicted, color="C1", marker="_", s=900, zorder=3, label="predicted"
    )
    left.axhline(report["cap_bytes"] / gib, color="red", label="node's cap")
    left.set(xlabel="stage rank", ylabel="GiB", title="a 4-stage pipeline's ranks")
    left.set_ylim(0, 1.25 * report["cap_bytes"] / gib)  # room above the cap for the legend
    left.legend(fontsize=8, loc="upper center", ncol=2)
    right.plot(range(1, len(piped.get("losses", [])) + 1), piped.get("losses", []), marker="o")
    right.set(xlabel="step", ylabel="loss", title="its training loss")
    for axis in (left.xaxis, right.xaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    title = "BERT-large-sized encoder on 4 capped rehearsal nodes (single and data cannot fit)"
    fig.suptitle(textwrap.fill(title, 110), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
