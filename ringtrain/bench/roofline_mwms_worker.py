"""TensorFlow's MultiWorkerMirroredStrategy in `ringtrain bench dp`: one worker per rank that
mpirun starts (mpirun only places the processes; the workers talk gRPC), training a workload
of the sweep tuned as `bench strategies` tunes it (numpy feed, RING, the loss reduced once when
read), taking its turns with ringtrain's contenders round by round.

    mpirun -np 2 python -m ringtrain.bench.roofline_mwms_worker \
        WORKLOAD ROUNDS STEPS INTER_OP ADDRESSES TURNS_FOLDER ORDER OUT.json

ADDRESSES: host:port per worker, comma-separated; ORDER: the launches' turn order, e.g.
ringtrain,mwms-1,mwms-2 (this one is mwms-INTER_OP).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ringtrain.bench.common import Turns, cpus_allowed, settings_in_force
from ringtrain.bench.roofline import WORKLOADS, launch_name

SEED = 0


def measure(
    workload_name: str,
    rounds: int,
    steps: int,
    inter: int,
    addresses: list[str],
    turns: Turns,
    out: str,
) -> None:
    index = int(os.environ["OMPI_COMM_WORLD_RANK"])
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
    )
    import tensorflow as tf

    from ringtrain.bench.tf_strategies_worker import numpy_fed, replica_step
    from ringtrain.data import load_synthetic

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    workload = WORKLOADS[workload_name]
    data = load_synthetic(workload.samples, workload.shape, 10, SEED)
    run = numpy_fed(
        strategy,
        replica_step(strategy, lambda: workload.model(data), workload.batch),
        data,
        workload.batch,
    )
    run(1)  # trace before the first turn
    ms = []
    for r in range(rounds):
        if index == 0:  # the other worker follows in lockstep, blocked in the collectives
            turns.wait(r)
        print(f"round {r + 1}/{rounds}: {turns.me}", file=sys.stderr, flush=True)
        ms.append(1e3 * run(steps) / steps)
        if index == 0:
            turns.done(r)
    if index == 0:
        report = {
            "inter_op": inter,
            "implementation": "RING",
            "ms": ms,
            "cpus_allowed_list": cpus_allowed(),
            "environment": settings_in_force(),
        }
        Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    name, rounds, steps, inter, addresses, folder, order, out = sys.argv[1:9]
    me = launch_name(int(inter))
    measure(
        name,
        int(rounds),
        int(steps),
        int(inter),
        addresses.split(","),
        Turns(folder, order.split(","), me),
        out,
    )
