"""A user's Keras callbacks, as `fit(callbacks=...)` takes them: they run on rank 0 at the
ends (and starts) of epochs and of training, as Horovod's users run theirs.

What a callback changes that every rank must follow (`model.stop_training`, the optimizer's
learning rate) is broadcast from rank 0 at once, so EarlyStopping, ReduceLROnPlateau and
LearningRateScheduler act on the whole job. Under a pipeline, rank 0's model receives every
stage's weights before the epoch-end callbacks see it, so ModelCheckpoint saves the real model.
A callback that acts per batch, or on evaluation's or prediction's hooks, cannot be honoured
and is refused in one line.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ringtrain.errors import UserError
from ringtrain.keras_model.compiled import base_learning_rate, receive_weights
from ringtrain.tensorflow_loader import tf  # noqa: F401  (before Keras)

# isort: split
import keras

RUN = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end")
HOOKS = [name for name in dir(keras.callbacks.Callback) if name.startswith("on_")]


def _hooks_in_use(callback) -> list[str]:
    """The hooks a callback defines, on its class or (LambdaCallback) on the instance."""
    base = keras.callbacks.Callback
    return [
        name
        for name in HOOKS
        if getattr(type(callback), name) is not getattr(base, name) or name in vars(callback)
    ]


def _inactive_per_batch(callback) -> bool:
    """Callbacks whose per-batch hook does nothing here: ModelCheckpoint saving per epoch, and
    TerminateOnNaN, whose stop ringtrain makes itself on every rank."""
    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        return callback.save_freq == "epoch"
    return isinstance(callback, keras.callbacks.TerminateOnNaN)


def check_callbacks(callbacks: Sequence) -> None:
    """Every callback can be honoured at epoch ends, or the run is refused before it starts."""
    for callback in callbacks:
        if not isinstance(callback, keras.callbacks.Callback):
            raise UserError(f"callbacks: {type(callback).__name__} is not a keras Callback")
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            raise UserError(
                "callbacks: BackupAndRestore is ringtrain's --checkpoint-dir and --resume; "
                "use those (they keep every rank's state)"
            )
        other = [name for name in _hooks_in_use(callback) if name not in RUN]
        if other and not _inactive_per_batch(callback):
            raise UserError(
                f"callbacks: {type(callback).__name__} uses {', '.join(other)}; ringtrain runs "
                "callbacks on rank 0 at epoch ends only (--tensorboard DIR logs per step)"
            )


class EpochCallbacks:
    """The callbacks on rank 0 (nothing runs elsewhere), and the broadcast every rank joins."""

    def __init__(self, callbacks: Sequence, model, rank: int, epochs: int, steps_per_epoch: int):
        self.model = model
        self.here = (
            keras.callbacks.CallbackList(
                list(callbacks), model=model, epochs=epochs, steps=steps_per_epoch, verbose=0
            )
            if rank == 0
            else None
        )

    def train_begin(self) -> None:
        if self.here:
            self.model.stop_training = False
            self.here.on_train_begin()

    def train_end(self, logs: dict) -> None:
        """After rank 0's model holds the trained weights (EarlyStopping may restore others)."""
        if self.here:
            self.here.on_train_end(logs)

    def epoch_begin(self, epoch: int, engine, comm) -> None:
        self._follow(engine, comm, lambda: self.here.on_epoch_begin(epoch))

    def epoch_end(self, epoch: int, logs: dict, engine, comm) -> bool:
        """Run the epoch-end callbacks; True when one of them stops training (on every rank)."""
        if getattr(engine, "pp_size", 1) > 1:  # rank 0's model has only its own stages' weights
            weights = engine.gather_weights()
            if weights is not None:
                receive_weights(self.model, weights)
        return self._follow(engine, comm, lambda: self.here.on_epoch_end(epoch, logs))

    def _follow(self, engine, comm, run) -> bool:
        """Run the hooks on rank 0; every rank then takes the stop and the learning rate's
        change (as a factor on the rate the loop sets each step) from there."""
        shared = np.array([0.0, 1.0])
        if self.here:
            before = self._rate()
            run()
            after = self._rate()
            shared[:] = [float(self.model.stop_training), after / before if before else 1.0]
        comm.Bcast(shared, root=0)
        if shared[1] != 1.0 and engine.base_learning_rate is not None:
            engine.base_learning_rate *= float(shared[1])
        return bool(shared[0])

    def _rate(self) -> float:
        return base_learning_rate(self.model.optimizer) or 0.0
