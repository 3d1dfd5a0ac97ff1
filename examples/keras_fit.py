"""model.fit with ringtrain's Keras 3 integration over Horovod: a rank-aware script.

horovodrun -np 2 -H localhost:2 python examples/keras_fit.py
mpirun -np 2 python examples/keras_fit.py
"""

import keras
import numpy as np

import ringtrain
from ringtrain import runtime
from ringtrain.dataparallel.keras_fit import (
    BroadcastInitialState,
    LearningRateWarmup,
    MetricAverage,
    distributed_optimizer,
)

world = runtime.start(with_horovod=True)  # MPI (THREAD_MULTIPLE), thread pools, hvd.init
hvd = world.hvd
data = ringtrain.load_digits()
model = ringtrain.mlp(data.input_shape, data.n_classes)  # a keras.Sequential

cfg = ringtrain.TrainConfig(lr=1e-3, scale_lr=True, warmup_epochs=1)  # users who keep the
per_rank_batch = 32  # per-rank batch fixed scale the LR by the rank count, after a warm-up
model.compile(
    optimizer=distributed_optimizer(keras.optimizers.Adam(cfg.lr), hvd),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
shard = np.arange(len(data.x))[world.rank :: world.size]  # this rank's share of the examples
steps_per_epoch = len(shard) // per_rank_batch
history = model.fit(
    data.x[shard],
    data.y[shard],
    batch_size=per_rank_batch,
    epochs=5,
    verbose=2 if world.rank == 0 else 0,
    callbacks=[
        BroadcastInitialState(hvd),  # rank 0's initial weights and optimizer state everywhere
        MetricAverage(hvd),  # epoch metrics averaged over ranks
        LearningRateWarmup(cfg, world.size, steps_per_epoch),
    ],
)
if world.rank == 0:
    _, accuracy = model.evaluate(data.x_test, data.y_test, verbose=0)
    print(f"held-out accuracy {accuracy:.4f}")
