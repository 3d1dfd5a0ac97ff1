"""TensorFlow for every ringtrain module that needs it, loaded without scikit-learn or matplotlib.

Keras imports scikit-learn for its scikit-learn wrappers and matplotlib for its image-gallery
plot, neither of which ringtrain uses. Together they are about a fifth of every rank's start-up
(scikit-learn about 1.2 of 6 CPU seconds, matplotlib about 0.3 of the rest), and a test suite
or a sweep starts hundreds of ranks. So both are hidden while TensorFlow (and the Keras it
loads) import, and visible again afterwards: ringtrain's own plots still import matplotlib, and
in this process Keras's scikit-learn wrappers and image-gallery plot report theirs missing.
"""

from __future__ import annotations

import gc
import sys

from ringtrain.proc import resident_bytes

OPTIONAL_FOR_KERAS = ("sklearn", "matplotlib")


def _load():
    hidden = (
        []
        if "tensorflow" in sys.modules
        else [m for m in OPTIONAL_FOR_KERAS if m not in sys.modules]
    )
    for name in hidden:
        sys.modules[name] = None  # Keras's optional import then takes its ImportError path
    try:
        import tensorflow
    finally:
        for name in hidden:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
    return tensorflow


tf = _load()
# The import leaves some 280,000 long-lived objects (modules, op wrappers, API tables) that
# are never garbage. Frozen, no later collection walks them, and neither does the one at exit,
# which otherwise costs every rank about 0.6 CPU seconds as it ends (a tenth of a short run).
gc.freeze()
# What a rank holds before any model: the baseline `ringtrain plan` predicts memory above.
RESIDENT_AFTER_IMPORT = resident_bytes()
