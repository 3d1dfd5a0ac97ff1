"""Checkpoints on disk: npz parts plus a JSON manifest written last, nothing unpickled.

Layout: DIR/step-00000012/{<part>.npz, manifest.json}. Each part is written to a temporary
name, fsynced and renamed; the manifest names every part with its SHA-256 and is itself written
atomically, so a checkpoint without a manifest is an interrupted write, never a torn one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import zipfile

import numpy as np
from numpy.typing import ArrayLike

from ringtrain.comm import Link
from ringtrain.errors import UserError
from ringtrain.guard import agree, finite_on_every_rank, non_finite
from ringtrain.weights import replica_checksums

MANIFEST = "manifest.json"
FORMAT = 1


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: str, write) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as out:
        write(out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_part(root: str, step: int, part: str, arrays: dict[str, ArrayLike]) -> str:
    """Write one rank's part; returns its SHA-256 for the manifest."""
    folder = step_dir(root, step)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{part}.npz")
    _atomic_write(path, lambda out: np.savez(out, **arrays))
    return sha256(path)


def write_manifest(root: str, step: int, parts: dict[str, str], meta: dict) -> None:
    """The commit point: a checkpoint counts only once this file names all its parts."""
    body = {"format": FORMAT, "step": step, "parts": parts, **meta}
    path = os.path.join(step_dir(root, step), MANIFEST)
    _atomic_write(path, lambda out: out.write(json.dumps(body, indent=1).encode()))


def prune(root: str, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; interrupted writes older than them go too."""
    steps = sorted(_step_dirs(root), reverse=True)
    complete = [s for s in steps if os.path.exists(os.path.join(step_dir(root, s), MANIFEST))]
    if len(complete) <= keep:
        return
    oldest_kept = complete[keep - 1]
    for s in steps:
        if s < oldest_kept:
            shutil.rmtree(step_dir(root, s), ignore_errors=True)


def _step_dirs(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        if name.startswith("step-") and name[5:].isdigit():
            found.append(int(name[5:]))
    return found


def latest(root: str) -> dict | None:
    """The newest complete checkpoint's manifest, verified; None if there is none.

    A folder without a manifest is an interrupted write and is passed over. A manifest that is
    unreadable, or names a missing or altered part, is corruption: that is an error, because
    silently training on from an older state would hide it.
    """
    for step in sorted(_step_dirs(root), reverse=True):
        folder = step_dir(root, step)
        path = os.path.join(folder, MANIFEST)
        if not os.path.exists(path):
            continue
        try:
            with open(path) as f:
                manifest = json.load(f)
            parts = dict(manifest["parts"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"checkpoint {folder}: unreadable manifest ({exc})") from None
        if manifest.get("format") != FORMAT:
            raise UserError(f"checkpoint {folder}: format {manifest.get('format')} is not {FORMAT}")
        for part, digest in parts.items():
            part_path = os.path.join(folder, f"{part}.npz")
            if not os.path.exists(part_path):
                raise UserError(
                    f"checkpoint {folder}: manifest names part {part}, which is missing"
                )
            if sha256(part_path) != digest:
                raise UserError(
                    f"checkpoint {folder}: part {part} is corrupted (checksum mismatch)"
                )
        manifest["folder"] = folder
        return manifest
    return None


def stored_partition(root: str, n_stages: int, elements: int) -> list[tuple[int, int]] | None:
    """The split of the model the newest checkpoint was trained with, for a resumed pipeline
    to reuse: measuring `time` again could split differently, and the parts hold its stages.
    None when there is no checkpoint or it holds no partition (not a pipeline's)."""
    manifest = latest(root)
    bounds = None if manifest is None else manifest.get("identity", {}).get("partition")
    if bounds is None:
        return None
    ends = [end for _, end in bounds]
    if len(bounds) != n_stages or ends[-1] != elements:
        raise UserError(
            f"checkpoint {manifest['folder']} splits {_count(ends[-1], 'model element')} into "
            f"{_count(len(bounds), 'stage')}, but this run has {_count(elements, 'element')} in "
            f"{_count(n_stages, 'stage')}"
        )
    return [(int(start), int(end)) for start, end in bounds]


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def read_part(manifest: dict, part: str) -> dict[str, np.ndarray]:
    path = os.path.join(manifest["folder"], f"{part}.npz")
    if part not in manifest["parts"]:
        raise UserError(f"checkpoint {manifest['folder']} has no part {part}")
    try:
        with np.load(path, allow_pickle=False) as stored:
            return {k: stored[k] for k in stored.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise UserError(f"checkpoint {path} cannot be read ({exc})") from None


def flag_identity(cfg) -> dict:
    """What a checkpoint must share with the run resuming it, as far as the flags tell."""
    return {
        "model": cfg.model,
        "optimizer": cfg.optimizer,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "dataset": cfg.dataset,
        # what orders the examples: a resumed run must read on from where this one was
        "shuffle": cfg.shuffle,
        "shuffle_buffer": cfg.shuffle_buffer,
        "shard_policy": cfg.shard_policy,
    }


def check_identity(manifest: dict, identity: dict) -> None:
    theirs = manifest.get("identity", {})
    for key, mine in identity.items():
        if theirs.get(key) != mine:
            raise UserError(
                f"checkpoint {manifest['folder']} does not fit this run: {key} is "
                f"{theirs.get(key)!r} there and {mine!r} here (written by --strategy "
                f"{manifest.get('strategy')} on {manifest.get('world_size')} rank(s))"
            )


def check_resumable(cfg) -> None:
    """The newest checkpoint is whole and fits the flags: a refusal found from the files alone,
    before TensorFlow loads. What fits the model and the ranks is checked at the restore."""
    manifest = latest(cfg.checkpoint_dir)
    if manifest is not None:
        check_identity(manifest, flag_identity(cfg))


class RunCheckpoints:
    """Saving and resuming one run: who writes which part, and whether a checkpoint fits.

    The engine names the part this rank writes (or None) and the part it reads, and what its
    layout is; replicas that hold the same weights read the same part. `newest` is the step of
    the newest checkpoint this run wrote or resumed from (0: none).
    """

    def __init__(self, cfg, world, engine):
        self.cfg, self.world, self.engine = cfg, world, engine
        self.newest = 0
        self.identity = {**flag_identity(cfg), **engine.layout()}

    def save(self, step: int, epoch: int, losses: list[float]) -> None:
        """Write the checkpoint of `step`, or raise on every rank if any part of the state is
        NaN or infinite: the newest checkpoint then stays the last good one."""
        part = self.engine.checkpoint_part()
        state = self.engine.state() if part else {}
        if not finite_on_every_rank(self.world.comm, state.values()):
            what = "the weights or the optimizer's state became non-finite"
            raise non_finite(what, step, self.world.rank, self.newest)
        digest = write_part(self.cfg.checkpoint_dir, step, part, state) if part else ""
        entry = np.frombuffer(f"{part or '':<32}{digest:<64}".encode(), np.uint8)
        gathered = np.empty(96 * self.world.size, np.uint8) if self.world.rank == 0 else None
        self.world.comm.Gather(np.ascontiguousarray(entry), gathered, root=0)
        self.newest = step
        if self.world.rank != 0:
            return
        rows = [gathered[i : i + 96].tobytes().decode() for i in range(0, len(gathered), 96)]
        parts = {r[:32].strip(): r[32:].strip() for r in rows if r[:32].strip()}
        _inject_fault_before_manifest(step)
        meta = {
            "epoch": epoch,
            "losses": losses,
            "identity": self.identity,
            "strategy": self.cfg.strategy,
            "world_size": self.world.size,
            **self.engine.checkpoint_meta(),
        }
        write_manifest(self.cfg.checkpoint_dir, step, parts, meta)
        prune(self.cfg.checkpoint_dir, self.cfg.keep)

    def restore(self) -> tuple[int, list[float]]:
        """(first step to run, losses so far): (0, []) when the folder holds no checkpoint.

        Every rank checks the checkpoint; a refusal is agreed on, so all ranks stop together.
        """
        wait = Link(self.world.comm, self.cfg.comm_timeout).wait
        first, losses = agree(self.world.comm, wait, self._restore)
        self.newest = first
        return first, losses

    def _restore(self) -> tuple[int, list[float]]:
        manifest = latest(self.cfg.checkpoint_dir)
        if manifest is None:
            return 0, []
        check_identity(manifest, self.identity)
        part = self.engine.read_part()
        state = read_part(manifest, part)
        if SHARDS in manifest:
            state = whole_optimizer_state(manifest, part, state)
        self.engine.load_state(state)
        return int(manifest["step"]), [float(x) for x in manifest.get("losses", [])]


def weight_key(variable) -> str:
    """A weight's name in a checkpoint: its stable Keras path."""
    return f"weights/{variable.path}"


class ReadWhenWritten:
    """A variable whose value is read only as it is checked or written (numpy converts it
    through __array__), one at a time: a checkpoint never holds a second copy of the whole of
    a rank's state, which for a stage under Adam is three times its weights."""

    def __init__(self, variable):
        self.variable = variable

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.variable.numpy(), dtype=dtype)


def weights_state(variables) -> dict[str, ReadWhenWritten]:
    """Weights by stable name."""
    return {weight_key(v): ReadWhenWritten(v) for v in variables}


def optimizer_key(position: int) -> str:
    """An optimizer variable's name in a checkpoint: its position in the whole optimizer's
    variables (step count, learning rate, then the slots in Keras's build order)."""
    return f"optimizer/{position:04d}"


def training_state(variables, optimizer) -> dict[str, ReadWhenWritten]:
    """Weights by stable name, and the optimizer's variables (slots, step count) by position."""
    state = weights_state(variables)
    state |= {optimizer_key(i): ReadWhenWritten(v) for i, v in enumerate(optimizer.variables)}
    return state


SHARDS = "optimizer_shards"  # a manifest's entry: {a weights part: its group's parts}


def shard_part(weights_part: str, replica: int) -> str:
    """The part that replica `replica` (not 0) of a sharded optimizer writes beside its
    group's weights part: its own slots, by their position in the whole optimizer."""
    return f"{weights_part}-optimizer-shard-{replica:05d}"


def whole_optimizer_state(manifest: dict, read: str, state: dict[str, np.ndarray]) -> dict:
    """A checkpoint whose slots were saved in shards (--shard-optimizer), in the layout of one
    whose optimizer held them all: each shard holds its slots under their whole layout's
    names, so the group's parts together are that layout, and it resumes on any number of
    ranks, with or without sharding. `state` is the part `read`, already read."""
    whole = dict(state)
    for part in manifest[SHARDS].get(read, []):
        if part != read:
            whole |= read_part(manifest, part)
    return whole


def load_training_state(variables, optimizer, state: dict[str, np.ndarray]) -> None:
    expected = training_state(variables, optimizer)
    if expected.keys() != state.keys():
        missing = sorted(expected.keys() - state.keys())[:3]
        raise UserError(f"checkpoint does not match this model (missing {missing})")
    pairs = [(weight_key(v), v) for v in variables]
    pairs += [(optimizer_key(i), v) for i, v in enumerate(optimizer.variables)]
    assign_checked(state, pairs)


def assign_checked(state: dict[str, np.ndarray], pairs: list) -> None:
    """Assign each (key, variable) its stored value, refusing a value of another shape."""
    for key, v in pairs:
        if tuple(state[key].shape) != tuple(v.shape):
            raise UserError(f"checkpoint holds {key} of shape {state[key].shape}, not {v.shape}")
        v.assign(state[key])


class Checkpointable:
    """For engines holding `variables` and `optimizer`: their state as checkpoint arrays."""

    def state(self) -> dict[str, ArrayLike]:
        return training_state(self.variables, self.optimizer)

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        load_training_state(self.variables, self.optimizer, state)

    def checkpoint_meta(self) -> dict:
        """What the manifest says beyond the parts (a sharded optimizer's layout); rank 0's."""
        return {}


class WholeModelReplica(Checkpointable):
    """For data-parallel engines: every rank holds the whole model (`variables`), identical
    on every replica, so rank 0's copy is the model and rank 0 alone writes it."""

    def layout(self) -> dict:
        return {"layout": "whole model"}

    def checkpoint_part(self) -> str | None:
        return "model" if self.world.rank == 0 else None

    def read_part(self) -> str:
        return "model"

    def extra_metrics(self) -> dict:
        return {"replica_checksums": replica_checksums(self.world.comm, self.variables)}

    def epoch_scalars(self) -> dict[str, float]:
        """Nothing beyond what the loop measures: data parallelism has no bubble."""
        return {}


def _inject_fault_before_manifest(step: int) -> None:
    """The crash-safety tests' hook, at the point a crash must not corrupt: every part is
    written, the manifest is not. RINGTRAIN_TEST_CRASH_BEFORE_MANIFEST=1 exits at once;
    =freeze:HOST:STEP stops the writer (SIGSTOP) there at STEP if it runs on HOST, so a test
    can take that node's power while the writer is mid-checkpoint."""
    fault = os.environ.get("RINGTRAIN_TEST_CRASH_BEFORE_MANIFEST")
    if not fault:
        return
    if fault.startswith("freeze:"):
        _, host, at = fault.split(":")
        if host == socket.gethostname() and int(at) == step:
            os.kill(os.getpid(), signal.SIGSTOP)
        return
    os._exit(9)
