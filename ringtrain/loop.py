"""The outer training loop every engine shares: global batch order, LR, progress, metrics,
checkpoints, agreed stops and the watchdog."""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from ringtrain import log
from ringtrain.checkpoint import RunCheckpoints
from ringtrain.comm import Link
from ringtrain.config import TrainConfig
from ringtrain.data import Dataset, epoch_batches, step_plan
from ringtrain.guard import StopSignal, Watchdog
from ringtrain.optim import learning_rate


class Engine(Protocol):
    """What a strategy provides: one optimizer step on a global batch, evaluation, state."""

    def set_learning_rate(self, lr: float) -> None: ...
    def step(self, global_indices: np.ndarray) -> float: ...
    def evaluate(self) -> float: ...
    def gather_weights(self) -> dict[str, np.ndarray] | None: ...
    def extra_metrics(self) -> dict: ...
    def layout(self) -> dict: ...
    def checkpoint_part(self) -> str | None: ...
    def read_part(self) -> str: ...
    def state(self) -> dict[str, np.ndarray]: ...
    def load_state(self, state: dict[str, np.ndarray]) -> None: ...


def run(
    engine: Engine,
    data: Dataset,
    cfg: TrainConfig,
    world,
    replicas: int,
    watchdog: Watchdog,
) -> dict:
    """Train for the configured steps; return the metrics every strategy reports.

    `metrics["finished"]` is False when a signal or --stop-after ended the run early. The
    caller's watchdog keeps running after the loop, for the gathers that follow.
    """
    total, per_epoch = step_plan(len(data.x), cfg.batch_size, cfg.epochs, cfg.steps)
    n_epochs = -(-total // per_epoch)
    checkpoints = RunCheckpoints(cfg, world, engine) if cfg.checkpoint_dir else None
    first, losses = checkpoints.restore() if checkpoints and cfg.resume else (0, [])
    if first:
        log.info(f"resumed from {cfg.checkpoint_dir} at step {first}")
    stop, link = StopSignal(), Link(world.comm, cfg.comm_timeout)
    step_seconds: list[float] = []
    accuracy, finished, started = float("nan"), True, time.perf_counter()
    for step in range(first, total):
        epoch, i = divmod(step, per_epoch)
        if i == 0 or step == first:
            batches = epoch_batches(len(data.x), cfg.batch_size, cfg.seed, epoch)
            bar = log.ProgressBar(f"epoch {epoch + 1}/{n_epochs}", min(per_epoch, total - step) - i)
        engine.set_learning_rate(learning_rate(cfg, step / per_epoch, replicas))
        watchdog.kick(f"step {step + 1}")
        tick = time.perf_counter()
        losses.append(engine.step(batches[i]))
        step_seconds.append(time.perf_counter() - tick)
        bar.update(losses[-1])
        stopping = stop.agree(world.comm, link.wait) or cfg.stop_after == step + 1
        due = cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0
        if checkpoints and (stopping or due or step + 1 == total):
            watchdog.kick(f"the checkpoint at step {step + 1}")
            checkpoints.save(step + 1, epoch, losses)
        if stopping and step + 1 < total:
            finished = False
            log.info(
                f"stopped after step {step + 1} of {total}"
                + (f"; checkpoint in {cfg.checkpoint_dir}" if checkpoints else "")
            )
            break
        if i == per_epoch - 1 or step == total - 1:
            watchdog.kick(f"evaluation after step {step + 1}")
            accuracy = engine.evaluate()
            epoch_loss = float(np.mean(losses[step - i :]))
            bar.close(f"loss {epoch_loss:.4f}  held-out accuracy {accuracy:.4f}")
    watchdog.kick("the end-of-run metrics")
    seconds = time.perf_counter() - started
    steady = step_seconds[1:] or step_seconds  # the first step includes tracing
    metrics = {
        "strategy": cfg.strategy,
        "world_size": world.size,
        "steps": len(losses),
        "finished": finished,
        "epochs": n_epochs,
        "global_batch": cfg.batch_size,
        "losses": losses,
        "final_loss": losses[-1] if losses else float("nan"),
        "test_accuracy": accuracy,
        "samples_per_sec": cfg.batch_size * len(steady) / sum(steady) if steady else 0.0,
        "seconds": seconds,
        "config": cfg.as_dict(),
    }
    metrics.update(engine.extra_metrics())
    return metrics
