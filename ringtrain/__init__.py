"""ringtrain: data, pipeline and hybrid parallel training of Keras models on MPI clusters.

The public names load lazily, so `ringtrain --help` and the pure schedule code never pay for
importing TensorFlow.
"""

import os
from importlib import import_module

from ringtrain import quiet

# TensorFlow writes start-up notices (CPU features, oneDNN, absl's "All log messages before
# absl::InitializeLog()" line) to stderr as it loads, in every rank. Every ringtrain module
# that loads TensorFlow is imported after these lines, so ringtrain's processes start quiet:
# the level stops what TensorFlow filters itself, and `quiet` holds back what it does not.
# A level you set yourself wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
quiet.install()

_EXPORTS = {
    "TrainConfig": "ringtrain.config",
    "Dataset": "ringtrain.data",
    "load_dataset": "ringtrain.data",
    "load_digits": "ringtrain.data",
    "mlp": "ringtrain.models",
    "cnn": "ringtrain.models",
    "transformer": "ringtrain.models",
    "load_weights": "ringtrain.weights",
    "train": "ringtrain.api",
    "fit": "ringtrain.api",
    "init": "ringtrain.runtime",
    "TrainResult": "ringtrain.api",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ringtrain' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
