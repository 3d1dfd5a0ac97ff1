"""`ringtrain.fit`: Keras's `fit`, for a user's own compiled model, under any strategy.

    import keras, ringtrain
    model = build()                      # yours: compiled, Sequential or functional
    history = ringtrain.fit(model, x, y, strategy="data", batch_size=64, epochs=3,
                            validation_data=(x_val, y_val))

Run the same script under `horovodrun`, `mpirun` or `srun`: every rank calls `fit` with the same
arguments, and the trained weights end up in `model` (every rank's copy, under data
parallelism). The options are `ringtrain train`'s flags, named as in `TrainConfig`
(`checkpoint_dir`, `metrics_out`, `save`, `seed`, ...).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ringtrain.config import TrainConfig
from ringtrain.errors import UserError

OWN_ARGUMENTS = ("strategy", "batch_size", "epochs", "steps", "shuffle")
NOT_OPTIONS = ("model", "dataset", "synthetic_size", "synthetic_shape", *OWN_ARGUMENTS)


def fit(
    model,
    x,
    y=None,
    *,
    strategy: str = "data",
    batch_size: int,
    epochs: int | None = None,
    steps: int | None = None,
    shuffle: bool = True,
    validation_data: tuple | None = None,
    **options: Any,
):
    """Train `model` on numpy arrays (dicts of them for several inputs or outputs) as Keras's
    `fit` would on one process with this global batch; return a keras.callbacks.History whose
    `history` holds the loss per epoch and, with validation_data, `val_` + each compiled
    metric. Nothing is held out of x. With shuffle=False, global batch t is examples
    [t*B, (t+1)*B) and an epoch's last batch may be partial, as in Keras."""
    from ringtrain.api import train_keras
    from ringtrain.data import Examples, UserData

    allowed = {f.name for f in fields(TrainConfig)} - set(NOT_OPTIONS)
    for name in options:
        if name not in allowed:
            raise UserError(f"fit() has no option {name!r}; it takes ringtrain train's flags")
    if y is None:
        raise UserError("fit() needs y, the targets of x, as numpy arrays")
    validation = None
    if validation_data is not None:
        if not isinstance(validation_data, tuple) or len(validation_data) != 2:
            raise UserError("validation_data must be a tuple (x_val, y_val)")
        validation = Examples(*validation_data)
    cfg = TrainConfig(
        strategy=strategy,
        model=f"python:{model.name}",
        batch_size=batch_size,
        epochs=epochs if epochs is not None or steps is not None else 1,
        steps=steps,
        shuffle=shuffle,
        **options,
    )
    result = train_keras(model, UserData(Examples(x, y), validation), cfg, given=set(options))
    return history_of(model, result.metrics)


def history_of(model, metrics: dict):
    """The run's per-epoch figures as the History object Keras's own fit returns."""
    from ringtrain.tensorflow_loader import tf  # noqa: F401  (before Keras)

    # isort: split
    import keras

    history = keras.callbacks.History()
    history.set_model(model)
    history.history = metrics.get("history", {})
    history.epoch = list(range(len(history.history.get("loss", []))))
    history.params = {"epochs": metrics.get("epochs"), "steps": metrics.get("steps")}
    return history
