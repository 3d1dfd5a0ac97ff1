"""What a trial adds to `ringtrain train` inside the process: pruning, TensorBoard hparams."""

from __future__ import annotations

from ringtrain.tensorflow_loader import tf  # noqa: F401  (before Keras)

# isort: split
import keras


def write_hparams(folder: str, params: dict, number: int) -> None:
    """The trial's hyperparameters beside its scalars, for TensorBoard's HParams tab."""
    from tensorboard.plugins.hparams import api as hparams

    with tf.summary.create_file_writer(folder).as_default():
        hparams.hparams(dict(params), trial_id=f"trial-{number:05d}")


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
