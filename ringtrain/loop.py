"""The outer training loop every engine shares: global batch order, LR, progress, metrics."""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from ringtrain import log
from ringtrain.config import TrainConfig
from ringtrain.data import Dataset, epoch_batches, step_plan
from ringtrain.optim import learning_rate


class Engine(Protocol):
    """What a strategy provides: one optimizer step on a global batch, and evaluation."""

    def set_learning_rate(self, lr: float) -> None: ...
    def step(self, global_indices: np.ndarray) -> float: ...
    def evaluate(self) -> float: ...
    def gather_weights(self) -> dict[str, np.ndarray] | None: ...
    def extra_metrics(self) -> dict: ...


def run(engine: Engine, data: Dataset, cfg: TrainConfig, world_size: int, replicas: int) -> dict:
    """Train for the configured steps; return the metrics every strategy reports."""
    total, per_epoch = step_plan(len(data.x), cfg.batch_size, cfg.epochs, cfg.steps)
    n_epochs = -(-total // per_epoch)
    losses: list[float] = []
    step_seconds: list[float] = []
    accuracy = float("nan")
    started = time.perf_counter()
    for step in range(total):
        epoch, i = divmod(step, per_epoch)
        if i == 0:
            batches = epoch_batches(len(data.x), cfg.batch_size, cfg.seed, epoch)
            bar = log.ProgressBar(f"epoch {epoch + 1}/{n_epochs}", min(per_epoch, total - step))
        engine.set_learning_rate(learning_rate(cfg, step / per_epoch, replicas))
        tick = time.perf_counter()
        losses.append(engine.step(batches[i]))
        step_seconds.append(time.perf_counter() - tick)
        bar.update(losses[-1])
        if i == per_epoch - 1 or step == total - 1:
            accuracy = engine.evaluate()
            epoch_loss = float(np.mean(losses[step - i :]))
            bar.close(f"loss {epoch_loss:.4f}  held-out accuracy {accuracy:.4f}")
    seconds = time.perf_counter() - started
    steady = step_seconds[1:] or step_seconds  # the first step includes tracing
    metrics = {
        "strategy": cfg.strategy,
        "world_size": world_size,
        "steps": total,
        "epochs": n_epochs,
        "global_batch": cfg.batch_size,
        "losses": losses,
        "final_loss": losses[-1],
        "test_accuracy": accuracy,
        "samples_per_sec": cfg.batch_size * len(steady) / sum(steady),
        "seconds": seconds,
        "config": cfg.as_dict(),
    }
    metrics.update(engine.extra_metrics())
    return metrics
