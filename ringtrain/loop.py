"""The outer training loop every engine shares: global batch order, LR, progress, metrics,
checkpoints, agreed stops and the watchdog."""

from __future__ import annotations

import math
import time
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import ArrayLike

from ringtrain import log, tensorboard
from ringtrain.checkpoint import RunCheckpoints
from ringtrain.comm import Link
from ringtrain.config import TrainConfig
from ringtrain.data import READS, step_plan
from ringtrain.guard import StopSignal, Watchdog, non_finite
from ringtrain.optim import learning_rate
from ringtrain.proc import resident_bytes
from ringtrain.weights import save_npz


class Engine(Protocol):
    """What a strategy provides: one optimizer step on a global batch, evaluation, state."""

    @property
    def base_learning_rate(self) -> float | None: ...  # None: a compiled schedule rules
    def set_learning_rate(self, lr: float) -> None: ...
    def step(self, global_indices: np.ndarray) -> float: ...
    def reads(self, global_indices: np.ndarray) -> np.ndarray: ...  # the examples it takes
    def evaluate(self) -> dict[str, float]: ...
    def gather_weights(self) -> dict[str, np.ndarray] | None: ...
    def extra_metrics(self) -> dict: ...
    def epoch_scalars(self) -> dict[str, float]: ...
    def layout(self) -> dict: ...
    def checkpoint_part(self) -> str | None: ...
    def read_part(self) -> str: ...
    def state(self) -> dict[str, ArrayLike]: ...
    def load_state(self, state: dict[str, np.ndarray]) -> None: ...


@runtime_checkable
class AgreeingEngine(Protocol):
    """An engine whose step also agrees on stopping (data parallelism folds the stop flag into
    its gradient allreduce), so the loop runs no collective of its own per step."""

    def step_agreeing(
        self, global_indices: np.ndarray, stop_requested: bool
    ) -> tuple[float, bool]: ...


PHASES = ("learning_rate", "step", "stop_agreement", "loop", "checkpoints_and_evaluation")


class PhaseClock:
    """Where a step's wall time goes, summed over the steps after the first (which traces)."""

    def __init__(self):
        self.totals, self.steps, self.mark = dict.fromkeys(PHASES, 0.0), 0, time.perf_counter()

    def lap(self, phase: str, counted: bool) -> None:
        now = time.perf_counter()
        if counted:
            self.totals[phase] += now - self.mark
        self.mark = now

    def means_ms(self) -> dict[str, float]:
        return {k: round(1e3 * v / max(1, self.steps), 4) for k, v in self.totals.items()}


INPUT_WAIT_SHOWN = 0.1  # the epoch line shows the input wait above this share of its steps


def epoch_line(loss: float, held_out: dict[str, float], input_wait: float) -> dict[str, float]:
    """What an epoch's line shows: its loss, the held-out scores and, when reading held this
    process's steps up for more than INPUT_WAIT_SHOWN of their time, that share."""
    shown = {"loss": loss, **{f"held-out {k}": v for k, v in held_out.items()}}
    return shown | ({"input wait": input_wait} if input_wait > INPUT_WAIT_SHOWN else {})


def input_wait(comm, waited: float, stepped: float) -> dict[str, float]:
    """Collective: the most any rank's steps waited on reading their examples (after the
    first step, as samples/s), in seconds and as a share of its steps' time."""
    from mpi4py import MPI

    worst = np.array([waited, waited / stepped if stepped else 0.0])
    comm.Allreduce(MPI.IN_PLACE, worst, op=MPI.MAX)
    return {"input_wait_s": float(worst[0]), "input_wait_fraction": float(worst[1])}


def write_initial_weights(path: str, engine: Engine) -> None:
    """What the first step starts from, after the broadcast from rank 0 or the restore, so a
    run can be reproduced or audited from its start. Collective: a pipeline's stages send their
    weights to rank 0 as they do at the end, and rank 0 writes them as --weights-out does."""
    weights = engine.gather_weights()  # None on every rank but 0
    if weights is not None:
        save_npz(path, weights)


def run(
    engine: Engine,
    data,
    cfg: TrainConfig,
    world,
    dp_size: int,
    watchdog: Watchdog,
    callbacks=None,
) -> dict:
    """Train for the configured steps; return the metrics every strategy reports.

    `metrics["finished"]` is False when a signal or --stop-after ended the run early (a
    callback's stop, as in Keras, is a finished run). The caller's watchdog keeps running
    after the loop, for the gathers that follow. `callbacks`: a user's Keras callbacks
    (keras_model.callbacks.EpochCallbacks), run at epoch boundaries.
    """
    n_examples, keep_partial = data.n_examples, data.keeps_partial_batch
    total, per_epoch = step_plan(n_examples, cfg.batch_size, cfg.epochs, cfg.steps, keep_partial)
    n_epochs = -(-total // per_epoch)
    checkpoints = RunCheckpoints(cfg, world, engine) if cfg.checkpoint_dir else None
    first, losses = checkpoints.restore() if checkpoints and cfg.resume else (0, [])
    if first:
        log.info(f"resumed from {cfg.checkpoint_dir} at step {first}")
    if cfg.initial_weights_out:  # a whole-model transfer: still start-up for the watchdog
        write_initial_weights(cfg.initial_weights_out, engine)
    style = log.progress_style(cfg.progress, world.launcher)
    board = tensorboard.Scalars(cfg.tensorboard) if cfg.tensorboard and world.rank == 0 else None
    stop, link = StopSignal(), Link(world.comm, cfg.comm_timeout)
    step_seconds: list[float] = []
    input_waits: list[float] = []  # per step, the seconds spent reading its examples
    agreeing, clock = isinstance(engine, AgreeingEngine), PhaseClock()
    history: dict[str, list[float]] = {"loss": []}
    held_out, finished, called_off, started = {}, True, False, time.perf_counter()
    resident_at_start = resident_bytes("VmHWM")  # model built, data opened: before step one
    for step in range(first, total):
        epoch, i = divmod(step, per_epoch)
        if i == 0 or step == first:
            batches = data.epoch_order(cfg.batch_size, cfg.seed, epoch, cfg.shuffle)
            label, steps = f"epoch {epoch + 1}/{n_epochs}", min(per_epoch - i, total - step)
            progress = log.EpochProgress(style, label, steps)
            if callbacks and i == 0:
                watchdog.kick(f"the callbacks before epoch {epoch + 1}")
                callbacks.epoch_begin(epoch, engine, world.comm)
        counted = step > first
        clock.lap("loop", counted)
        tick = clock.mark
        READS.lap()  # what evaluation and checkpoints read is no step's
        lr = None  # a user's compiled schedule sets its own rate
        if (base := engine.base_learning_rate) is not None:
            lr = learning_rate(cfg, step / per_epoch, dp_size, base)
            engine.set_learning_rate(lr)
        watchdog.kick(f"step {step + 1}")
        if i + 1 < len(batches) and step + 1 < total:  # read while this step computes
            data.read_ahead(engine.reads(batches[i + 1]))
        clock.lap("learning_rate", counted)
        if agreeing:
            loss, stopping = engine.step_agreeing(batches[i], bool(stop.requested))
            finite = math.isfinite(loss)
        else:
            loss = engine.step(batches[i])
        clock.lap("step", counted)
        if not agreeing:
            stopping, finite = stop.agree(world.comm, link.wait, loss)
        clock.lap("stop_agreement", counted)
        clock.steps += counted
        losses.append(loss)
        step_seconds.append(clock.mark - tick)  # learning rate, step and agreement
        input_waits.append(READS.lap())
        progress.update(loss)
        if board:  # on the optimizer-step axis: a resumed run continues the same curves
            rates = {
                "samples_per_sec": cfg.batch_size / step_seconds[-1],
                "input_wait_fraction": input_waits[-1] / step_seconds[-1],
            }
            rates |= {"learning_rate": lr} if lr is not None else {}
            board.write(step + 1, {"loss": loss, **rates})
        if step == first:  # its graphs are traced: --comm-timeout alone from here, from now
            watchdog.settle(f"the end of step {step + 1}")
        if not finite:  # every rank stops here, before a checkpoint could hold the damage
            what = f"the loss became non-finite ({losses[-1]})"
            newest = checkpoints.newest if checkpoints else None
            raise non_finite(what, step + 1, world.rank, newest)
        stopping = stopping or cfg.stop_after == step + 1
        due = cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0
        clock.lap("loop", counted)
        if checkpoints and (stopping or due or step + 1 == total):
            watchdog.kick(f"the checkpoint at step {step + 1}")
            checkpoints.save(step + 1, epoch, losses)
        if i == per_epoch - 1 or step == total - 1:  # an epoch ends, even on a stop: report it
            watchdog.kick(f"evaluation after step {step + 1}")
            held_out = engine.evaluate()
            epoch_loss = float(np.mean(losses[step - i :]))
            history["loss"].append(epoch_loss)
            for name, value in held_out.items():
                history.setdefault(f"val_{name}", []).append(value)
            since = max(0, step - i - first)  # this epoch's steps that this process ran
            waited = sum(input_waits[since:]) / sum(step_seconds[since:])
            progress.end(epoch_line(epoch_loss, held_out, waited))
            measured = engine.epoch_scalars() if cfg.tensorboard else {}  # every rank joins
            if board:
                scalars = {f"held_out_{k}": v for k, v in held_out.items()}
                board.write(step + 1, {**scalars, **measured}, flush=True)
            if callbacks and i == per_epoch - 1:
                watchdog.kick(f"the callbacks after epoch {epoch + 1}")
                logs = {"loss": epoch_loss, **{f"val_{k}": v for k, v in held_out.items()}}
                stop_now = callbacks.epoch_end(epoch, logs, engine, world.comm)
                called_off = stop_now and step + 1 < total
        clock.lap("checkpoints_and_evaluation", counted)
        if called_off:
            log.info(f"a callback stopped training after epoch {epoch + 1}")
            break
        if stopping and step + 1 < total:
            finished = False
            log.info(
                f"stopped after step {step + 1} of {total}"
                + (f"; checkpoint in {cfg.checkpoint_dir}" if checkpoints else "")
            )
            break
    if first == total:  # resumed from the last step's checkpoint: its scores, all the same
        watchdog.kick("evaluation of the finished run")
        held_out = engine.evaluate()
    if board:
        board.close()
    watchdog.kick("the end-of-run metrics")
    seconds = time.perf_counter() - started
    steady = step_seconds[1:] or step_seconds  # the first step includes tracing
    waits = input_waits[1:] or input_waits  # as steady: the first step includes tracing
    metrics = {
        "strategy": cfg.strategy,
        "world_size": world.size,
        "steps": len(losses),
        "finished": finished,
        "epochs": n_epochs,
        "global_batch": cfg.batch_size,
        "losses": losses,
        "final_loss": losses[-1] if losses else float("nan"),
        "test_accuracy": held_out.get("accuracy", float("nan")),
        "held_out": held_out,
        "history": history,
        "samples_per_sec": cfg.batch_size * len(steady) / sum(steady) if steady else 0.0,
        "seconds": seconds,
        "step_breakdown_ms": clock.means_ms(),
        **input_wait(world.comm, sum(waits), sum(steady)),
        "config": cfg.as_dict(),
    }
    metrics.update(engine.extra_metrics())
    from mpi4py import MPI  # started by now (runtime.start_mpi set its thread level first)

    from ringtrain.tensorflow_loader import RESIDENT_AFTER_IMPORT

    high = resident_bytes("VmHWM")
    peak = np.array([high, high - RESIDENT_AFTER_IMPORT, high - resident_at_start], np.int64)
    world.comm.Allreduce(MPI.IN_PLACE, peak, op=MPI.MAX)
    metrics["peak_resident_bytes"] = int(peak[0])  # the fullest rank's VmHWM
    metrics["peak_resident_above_import_bytes"] = int(peak[1])  # and the most any rank added
    metrics["peak_resident_above_start_bytes"] = int(peak[2])  # ... while it trained
    return metrics
