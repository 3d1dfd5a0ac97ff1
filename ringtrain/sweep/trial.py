"""One trial as `ringtrain train` runs it: its flags, its pruning, its TensorBoard run."""

from __future__ import annotations

import os

from ringtrain.tensorflow_loader import tf  # noqa: F401  (before Keras)

# isort: split
import keras


def trial_flags(shared: list[str], params: list[list[str]], folder: str, resume: bool) -> list[str]:
    """The trial's `train` flags: the shared ones, then its parameters (argparse keeps the last
    of a repeated flag), then its outputs in its folder. `--tensorboard DIR` becomes one run per
    trial, DIR/trial-NNNNN; a retry resumes from the trial's checkpoint, if it has one."""
    argv = ["--progress", "none"]  # the trials' lines would interleave; the user may override
    board = False
    for token in shared:
        if board:
            token, board = os.path.join(token, os.path.basename(folder)), False
        elif token.startswith("--tensorboard="):
            token = f"{token}{os.sep}{os.path.basename(folder)}"
        board = board or token == "--tensorboard"
        argv.append(token)
    for flags in params:
        argv += flags
    argv += ["--weights-out", os.path.join(folder, "weights.npz")]
    argv += ["--metrics-out", os.path.join(folder, "metrics.json")]
    argv += ["--checkpoint-dir", os.path.join(folder, "checkpoints")]
    return argv + (["--resume"] if resume else [])


def tensorboard_folder(argv: list[str]) -> str | None:
    """Where the trial's --tensorboard run goes, if it has one."""
    for i, token in enumerate(argv):
        if token == "--tensorboard" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--tensorboard="):
            return token.split("=", 1)[1]
    return None


def write_hparams(folder: str, params: dict, number: int) -> None:
    """The trial's hyperparameters beside its scalars, for TensorBoard's HParams tab."""
    from tensorboard.plugins.hparams import api as hparams

    with tf.summary.create_file_writer(folder).as_default():
        hparams.hparams({k: v for k, v in params.items()}, trial_id=f"trial-{number:05d}")


class Pruning(keras.callbacks.Callback):
    """Reports the objective after every epoch (rank 0 of the group runs it) and stops the
    trial when Optuna's pruner says it trails; the stop reaches the group's other ranks as any
    callback's does."""

    def __init__(self, study, trial_id: int | None, objective: str):
        super().__init__()
        self.study, self.trial_id, self.objective = study, trial_id, objective
        self.pruned, self.epochs = False, 0

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        import optuna

        self.epochs = epoch + 1
        value = (logs or {}).get(self.objective)
        if self.study is None or value is None:
            return
        trial = optuna.trial.Trial(self.study, self.trial_id)
        trial.report(float(value), epoch + 1)
        if trial.should_prune():
            self.pruned = True
            self.model.stop_training = True

    def final_value(self, metrics: dict) -> float | None:
        """The objective at the end: the final loss, or the last held-out score."""
        if self.objective == "loss":
            return metrics.get("final_loss")
        return metrics.get("held_out", {}).get(self.objective[len("val_") :])
