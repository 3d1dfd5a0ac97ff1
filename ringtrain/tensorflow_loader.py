"""TensorFlow for every ringtrain module that needs it, loaded without scikit-learn.

Keras imports scikit-learn only for its scikit-learn wrappers, which ringtrain never uses, and
that import is a fifth of every rank's start-up (about 1.2 of 6 CPU seconds). So scikit-learn
is hidden while TensorFlow (and the Keras it loads) import, and visible again afterwards; in
this process Keras's own scikit-learn wrappers then report scikit-learn as missing.
"""

from __future__ import annotations

import sys

from ringtrain.proc import resident_bytes


def _load():
    hide = "sklearn" not in sys.modules and "tensorflow" not in sys.modules
    if hide:
        sys.modules["sklearn"] = None  # Keras's optional import then takes its ImportError path
    try:
        import tensorflow
    finally:
        if hide and sys.modules.get("sklearn", False) is None:
            del sys.modules["sklearn"]
    return tensorflow


tf = _load()
# What a rank holds before any model: the baseline `ringtrain plan` predicts memory above.
RESIDENT_AFTER_IMPORT = resident_bytes()
