"""Optimizers and learning-rate rules shared by every strategy."""

from __future__ import annotations

import weakref

from ringtrain.tensorflow_loader import tf  # before Keras: keeps scikit-learn out of it

# isort: split
import keras

from ringtrain.config import TrainConfig


def make_optimizer(
    kind: str, lr: float, clip_norm: float | None = None
) -> keras.optimizers.Optimizer:
    """--optimizer sgd|adam at --lr; --clip-norm clips by the norm of all the gradients
    together (a pipeline takes that norm across its stages). A fixed name, because Horovod
    names its broadcasts after the optimizer's variables: Keras's automatic names ("adam_1",
    ...) count optimizers per process, so one extra optimizer on one rank would leave the
    ranks waiting on differently named broadcasts forever."""
    optimizer = keras.optimizers.SGD if kind == "sgd" else keras.optimizers.Adam
    return optimizer(learning_rate=lr, global_clipnorm=clip_norm, name=f"ringtrain_{kind}")


class LearningRate:
    """An optimizer's learning rate, assigned only when it changes: an assign is an eager op
    (about 0.4 ms a step here), and most schedules hold still for most steps."""

    def __init__(self, optimizer: keras.optimizers.Optimizer):
        self.optimizer, self.value = optimizer, None

    def set(self, lr: float) -> None:
        if lr != self.value:
            self.optimizer.learning_rate.assign(lr)
            self.value = lr


def learning_rate(
    cfg: TrainConfig, epoch_progress: float, dp_size: int, base: float | None = None
) -> float:
    """The base rate (--lr, or `base`: a user's compiled constant rate), optionally scaled by the
    replica count (dp_size) and reached by a linear warm-up.

    Scaling suits users who keep the per-rank batch fixed as they add ranks (Goyal et al., 2017);
    both options are off by default so runs stay exactly comparable across strategies. The
    warm-up is what Horovod's users know: it starts at the target divided by the replica count
    (so at --lr under --scale-lr) and reaches the target linearly after `warmup_epochs`.
    """
    base = cfg.lr if base is None else base
    target = base * dp_size if cfg.scale_lr else base
    if cfg.warmup_epochs > 0 and epoch_progress < cfg.warmup_epochs:
        start = target / dp_size
        return start + (target - start) * epoch_progress / cfg.warmup_epochs
    return target


def one_variable_at_a_time(optimizer: keras.optimizers.Optimizer) -> None:
    """Make a compiled step update its variables one after another. Side by side, TensorFlow
    starts every variable's update at once and holds all of their temporaries together: a
    pipeline stage, whose step starts from all of its gradient sums, peaked at 1.35 times its
    weights above them under Adam. The values are the same, in the same order per variable."""
    update = optimizer.update_step
    previous = weakref.WeakKeyDictionary()  # graph: the marker the next update waits on

    def chained(gradient, variable, learning_rate):
        if tf.executing_eagerly():  # eager ops run one at a time already
            return update(gradient, variable, learning_rate)
        graph = tf.compat.v1.get_default_graph()
        made = len(graph.get_operations())
        waits = [previous[graph]] if graph in previous else []
        with tf.control_dependencies(waits):
            update(gradient, variable, learning_rate)
        previous[graph] = tf.group(*graph.get_operations()[made:])

    optimizer.update_step = chained
