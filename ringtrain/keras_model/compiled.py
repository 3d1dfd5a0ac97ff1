"""What a user's `compile` said, honoured over a global batch that ranks hold in shares.

Keras reduces a loss over the batch it is given. A rank holds only its share of the global
batch, so its loss is rescaled (`loss_share`) so that the replicas' average is the loss Keras
would compute over the whole batch: exact under an uneven split or a partial last batch.
Held-out metrics are Keras's own compiled metrics, whose states (totals and counts) every rank
fills from its share and the ranks sum, so they are averaged by examples, not by ranks.
"""

from __future__ import annotations

import json

from ringtrain.tensorflow_loader import tf  # before Keras: keeps scikit-learn out of it

# isort: split
import keras
import numpy as np

from ringtrain.errors import UserError

MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def check_compiled(model, where: str) -> None:
    """A built, compiled Keras model whose losses reduce to a scalar."""
    if not isinstance(model, keras.Model):
        raise UserError(f"{where} returned {type(model).__name__}, not a keras.Model")
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise UserError(
            f"{where} returned an uncompiled model; call model.compile(optimizer=..., loss=...)"
        )
    if model.loss is None:
        raise UserError(f"{where} returned a model compiled without a loss")
    reduction_kind(model)


def _losses(loss) -> list:
    if isinstance(loss, dict):
        return [v for v in loss.values() if v is not None]
    if isinstance(loss, list | tuple):
        return [v for v in loss if v is not None]
    return [loss]


def reduction_kind(model) -> str:
    """ "mean" or "sum": how the compiled losses reduce over a batch (strings and plain
    functions reduce as Keras's default, the mean)."""
    kinds = set()
    for loss in _losses(model.loss):
        reduction = getattr(loss, "reduction", "sum_over_batch_size")
        if reduction in (None, "none"):
            name = getattr(loss, "name", type(loss).__name__)
            raise UserError(
                f"loss {name} has reduction=None, one loss per example; ringtrain needs a "
                "scalar (use reduction='sum_over_batch_size', Keras's default)"
            )
        kinds.add("sum" if reduction == "sum" else "mean")
    if len(kinds) > 1:
        raise UserError("the compiled losses mix reduction='sum' with mean reductions")
    return kinds.pop()


def loss_share(kind: str, local: int, total: int, replicas: int) -> float:
    """The factor on a replica's data loss that makes the replicas' average of it the global
    batch's: a mean over `local` of `total` examples weighs local/total; a sum adds up."""
    if kind == "sum":
        return float(replicas)
    return replicas * local / total


def global_loss(model, x, y, y_pred, share: tf.Tensor, added_share: float = 1.0) -> tf.Tensor:
    """This replica's term of the global batch's loss: its compiled (data) loss times its
    share, plus the model's own added losses (regularisers), which the average keeps once
    (`added_share` of them per accumulation slice)."""
    total = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
    added = [tf.cast(loss, total.dtype) for loss in model.losses]
    if not added:
        return total * share
    extra = tf.add_n(added)
    return (total - extra) * share + extra * added_share


def receive_weights(model, weights: dict) -> None:
    """Assign gathered weights, keyed by variable path, to the user's model."""
    from ringtrain.keras_model.deferred import set_value

    by_path = {v.path: v for v in model.weights}
    for name, value in weights.items():
        set_value(by_path[name], value)


def predictor(model):
    """The model's inference call, compiled once for every chunk size."""
    return tf.function(lambda x: model(x, training=False), reduce_retracing=True)


def base_learning_rate(optimizer) -> float | None:
    """The compiled constant rate, which --scale-lr and --warmup-epochs act on; None when a
    schedule sets it."""
    if isinstance(optimizer._learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        return None
    return float(optimizer.learning_rate.numpy())


class CompiledMetrics:
    """The compiled loss and metrics on held-out examples, as Keras's `evaluate` gives them.
    Where the model's outputs are (every rank under data parallelism, the last stage in a
    pipeline) the metrics fill their states; `result` sums the states over those ranks."""

    def __init__(self, model):
        self.model = model
        self._score = tf.function(self._score_graph, reduce_retracing=True)

    def _score_graph(self, y, y_pred) -> tf.Tensor:
        loss = self.model.compute_loss(y=y, y_pred=y_pred, training=False)
        self.model.compute_metrics(None, y, y_pred, sample_weight=None)
        return loss

    def reset(self) -> None:
        self.model.reset_metrics()
        self.loss_sum, self.count = 0.0, 0

    def update(self, outputs, y) -> None:
        """One chunk's outputs (a stage's tuple, or the model's own structure) and targets."""
        if isinstance(outputs, tuple):
            outputs = outputs[0] if len(outputs) == 1 else list(outputs)
        n = len(next(iter(y.values()))) if isinstance(y, dict) else len(y)
        self.loss_sum += float(self._score(y, outputs)) * n
        self.count += n

    def result(self, comm) -> dict[str, float]:
        """Collective over comm: the ranks that scored sum their states; the first of them
        tells every rank the scores (JSON bytes in buffers, never pickled)."""
        from mpi4py import MPI

        scored = self.count > 0
        group = comm.Split(color=int(scored), key=comm.Get_rank())
        scores = {}
        if scored:
            states = [v for metric in self.model.metrics for v in metric.variables]
            flat = np.concatenate(
                [np.ravel(v.numpy()).astype(np.float64) for v in states]
                + [[self.loss_sum, self.count]]
            )
            group.Allreduce(MPI.IN_PLACE, flat)
            offset = 0
            for v in states:
                n = int(np.prod(v.shape))
                v.assign(flat[offset : offset + n].reshape(v.shape).astype(v.dtype))
                offset += n
            found = self.model.get_metrics_result()
            scores = {"loss": float(flat[-2] / flat[-1])}
            scores |= {k: float(v) for k, v in found.items() if k != "loss"}
        group.Free()
        root = np.array([comm.Get_rank() if scored else comm.Get_size()], np.int64)
        comm.Allreduce(MPI.IN_PLACE, root, op=MPI.MIN)
        text = np.frombuffer(json.dumps(scores).encode(), np.uint8)
        size = np.array([len(text)], np.int64)
        comm.Bcast(size, root=int(root[0]))
        buf = (
            np.ascontiguousarray(text)
            if comm.Get_rank() == root[0]
            else np.empty(size[0], np.uint8)
        )
        comm.Bcast(buf, root=int(root[0]))
        return json.loads(buf.tobytes())


def unregistered(model) -> list[str]:
    """Custom layers and losses `keras.models.load_model` could not find again: neither part
    of Keras nor registered with @keras.saving.register_keras_serializable."""
    registered = set(map(id, keras.saving.get_custom_objects().values()))
    found = [type(layer) for layer in model._flatten_layers(include_self=False)]
    for loss in _losses(model.loss):
        found.append(getattr(loss, "fn", loss) if not isinstance(loss, str) else None)
        found.append(type(loss) if isinstance(loss, keras.losses.Loss) else None)
    names = []
    for obj in found:
        module = getattr(obj, "__module__", "") or ""
        if obj is None or module.startswith(("keras", "tensorflow")) or id(obj) in registered:
            continue
        names.append(getattr(obj, "__name__", repr(obj)))
    return sorted(set(names))
