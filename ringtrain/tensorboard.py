"""TensorBoard scalars from rank 0, written by TensorFlow's own summary writer.

Every scalar sits on the optimizer-step axis (updates done so far): the per-epoch values line
up with the per-step ones, and a resumed run, which starts at its checkpoint's step, continues
the curves of the run it resumes in the same folder (`tensorboard --logdir DIR` merges the
event files a folder holds). Should a crashed run have written steps past its last checkpoint,
TensorBoard keeps only the values written last for those steps.
"""

from __future__ import annotations


class Scalars:
    """An event file in `folder` (created if missing) that takes named scalars at a step."""

    def __init__(self, folder: str):
        import tensorflow as tf

        self._summary = tf.summary
        self._writer = tf.summary.create_file_writer(folder)

    def write(self, step: int, values: dict[str, float], flush: bool = False) -> None:
        with self._writer.as_default(step=step):
            for tag, value in values.items():
                self._summary.scalar(tag, value)
        if flush:  # so a live `tensorboard` shows the epoch as soon as it ends
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()
