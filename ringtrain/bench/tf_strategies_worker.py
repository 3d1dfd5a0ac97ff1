"""TensorFlow's own distribution strategies in `ringtrain bench strategies`.

Only TensorFlow's documented API is on the training path: a strategy, variables made in its
scope, `strategy.run` in a `tf.function` (for parameter servers, `ClusterCoordinator.schedule`),
`strategy.reduce`, and a Keras optimizer. From ringtrain come only the network's layers, the
synthetic arrays and the order of their batches, so every contender trains the same model on
the same data, and the one-line protocol the parent drives all contenders with.

MultiWorkerMirroredStrategy runs two ways. "mwms" is stock, as its guide builds it: a tf.data
input and the loss reduced every step. "mwms-tuned" is set up as a user chasing speed would:
numpy slices of each global batch fed to the `tf.function` (ringtrain's feed), and each step's
loss kept on its worker and summed across workers in one `strategy.reduce` when it is read,
after the timed steps, instead of a second collective per step.

    python -m ringtrain.bench.tf_strategies_worker ROLE INTRA_OP INTER_OP [RING|AUTO]
ROLE: mwms, mwms-tuned (one worker of MultiWorkerMirroredStrategy), mirrored (2 logical CPUs
in this process), ps-coordinator, or server (a parameter server or worker: it only serves).
TF_CONFIG, set by the parent, names the cluster and this task.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from ringtrain.bench.common import (
    batch_stream,
    cpus_allowed,
    read_command,
    reply,
    settings_in_force,
)
from ringtrain.bench.strategies import BATCH, LR, SEED, workload
from ringtrain.data import Dataset, shard

Runner = Callable[[int], float]  # steps -> seconds they took


def ready(role: str, intra: int, inter: int, **more) -> None:
    """Tell the parent this process is ready, with what it runs on and with."""
    reply(
        {
            "ready": True,
            "role": role,
            "threads": {"intra_op": intra, "inter_op": inter},
            "cpus_allowed_list": cpus_allowed(),
            "environment": settings_in_force(),
            **more,
        }
    )


def serve(intra: int, inter: int) -> None:
    """A parameter server or PS worker: TensorFlow runs what the coordinator sends it, until
    the parent says quit or goes away (its pipe closes), so no server outlives the bench."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol="grpc",
        config=tf.compat.v1.ConfigProto(
            intra_op_parallelism_threads=intra, inter_op_parallelism_threads=inter
        ),
        start=True,
    )
    ready(f"{resolver.task_type} {resolver.task_id}", intra, inter, target=server.target)
    while read_command()["cmd"] != "quit":
        pass


def make_strategy(role: str, implementation: str) -> tf.distribute.Strategy:
    """The strategy as its guide builds it; TF_CONFIG tells the multi-process ones the cluster."""
    if role.startswith("mwms"):
        chosen = getattr(tf.distribute.experimental.CommunicationImplementation, implementation)
        options = tf.distribute.experimental.CommunicationOptions(implementation=chosen)
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    if role == "mirrored":
        return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    return tf.distribute.ParameterServerStrategy(resolver)


def replica_step(strategy: tf.distribute.Strategy, build: Callable[[], keras.Model], batch: int):
    """The per-replica SGD step of the network `build` makes, built in the strategy's scope
    as its guide does, with the loss averaged over the global `batch`."""
    with strategy.scope():
        model = build()
        optimizer = keras.optimizers.SGD(learning_rate=LR)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return step_fn


def make_runner(role: str, strategy: tf.distribute.Strategy) -> Runner:
    """steps -> seconds, after one untimed step (which also lines the workers up)."""
    data, build = workload()
    step_fn = replica_step(strategy, build, BATCH)
    if role == "mwms-tuned":
        return numpy_fed(strategy, step_fn, data, BATCH)

    def dataset_fn(context):
        options = tf.data.Options()
        options.threading.private_threadpool_size = 1  # as few threads as the contenders get
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        dataset = tf.data.Dataset.from_tensor_slices((data.x, data.y))
        dataset = dataset.shard(context.num_input_pipelines, context.input_pipeline_id)
        batch = context.get_per_replica_batch_size(BATCH)
        return dataset.batch(batch, drop_remainder=True).cache().repeat().with_options(options)

    @tf.function
    def train_step(iterator):
        x, y = next(iterator)
        losses = strategy.run(step_fn, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    if role == "ps-coordinator":
        # Asynchronous: each scheduled step is one update from BATCH examples on one worker.
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        per_worker = coordinator.create_per_worker_dataset(
            tf.function(lambda: strategy.distribute_datasets_from_function(dataset_fn))
        )
        iterator = iter(per_worker)

        def run(steps: int) -> float:
            coordinator.schedule(train_step, args=(iterator,))
            coordinator.join()
            start = time.perf_counter()
            for _ in range(steps):
                coordinator.schedule(train_step, args=(iterator,))
            coordinator.join()
            return time.perf_counter() - start

        return run

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

    def run(steps: int) -> float:
        float(train_step(iterator))
        start = time.perf_counter()
        for _ in range(steps):
            loss = train_step(iterator)
        float(loss)
        return time.perf_counter() - start

    return run


def numpy_fed(strategy: tf.distribute.Strategy, step_fn, data: Dataset, batch: int) -> Runner:
    """MWMS tuned: this worker's slice of each global batch, as numpy, into one tf.function
    per step that returns the worker's own loss; the job's loss of every step comes from one
    SUM across workers when the losses are read, at the end of the timed steps."""
    worker = strategy.cluster_resolver.task_id
    workers = strategy.num_replicas_in_sync  # one replica (CPU) per worker

    @tf.function
    def train_step(x, y):
        return strategy.run(step_fn, args=(x, y))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def job_losses(mine):
        per_replica = strategy.run(tf.identity, args=(mine,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def run(steps: int) -> float:
        batches = [
            shard(b, worker, workers) for b in batch_stream(len(data.x), steps + 1, batch, SEED)
        ]
        float(job_losses(tf.stack([train_step(data.x[batches[0]], data.y[batches[0]])]))[0])
        start = time.perf_counter()
        mine = [train_step(data.x[local], data.y[local]) for local in batches[1:]]
        losses = job_losses(tf.stack(mine)).numpy()  # every step's loss, read once
        seconds = time.perf_counter() - start
        if not np.all(np.isfinite(losses)):
            raise FloatingPointError(f"MWMS tuned: a loss is not finite: {losses}")
        return seconds

    return run


def main(role: str, intra: int, inter: int, implementation: str = "RING") -> None:
    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    if role == "server":
        serve(intra, inter)
        leave()
    if role == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        logical = [tf.config.LogicalDeviceConfiguration()] * 2
        tf.config.set_logical_device_configuration(cpu, logical)
    strategy = make_strategy(role, implementation)
    run = make_runner(role, strategy)
    run(1)  # trace outside any timing
    settings = {"replicas": strategy.num_replicas_in_sync}
    if role.startswith("mwms"):
        settings["implementation"] = implementation
    ready(role, intra, inter, **settings)
    while (message := read_command())["cmd"] == "run":
        print(f"measuring {role}: {message['steps']} steps", file=sys.stderr, flush=True)
        reply(
            {
                "contender": message["contender"],
                "steps": message["steps"],
                "seconds": run(message["steps"]),
            }
        )
    leave()


def leave() -> None:
    """Exit at once: nothing here needs saving, and TensorFlow's orderly shutdown of a
    distributed runtime takes seconds of CPU, or catches the SIGTERM that would end it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
