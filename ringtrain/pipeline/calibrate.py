"""Calibration inside the run: the simulator's figures, measured where the job runs.

A prediction needs the seconds of each stage's F, B, BI and BW (and of the host's work around
each message, REDUCE and STEP), and a message's time by its bytes. The actions' times are read
from the executor's own trace, over the first steps after the one that traced the graphs
(CALIBRATION_STEPS); messages are timed by a ping-pong between
the first two pipeline ranks, through the same Link the executor sends with, at a tiny size and
at the boundary's size, and fitted to latency + bytes / rate (costs.LinkModel). The prediction
is then compared with the steps that follow, which the calibration did not see.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from statistics import median

import numpy as np

from ringtrain.pipeline.costs import FREE_LINK, LinkModel
from ringtrain.pipeline.ir import CODES
from ringtrain.pipeline.trace import END, OP, OPS, STAGE, START, STEP

OP_NAMES = {code: op for op, code in CODES.items()}  # the trace's codes, the IR's op names
CALIBRATION_STEPS = 3  # after the first, which traces the graphs
ROUND_TRIPS = 5


def stage_seconds(rows: np.ndarray, steps: Collection[int]) -> dict[tuple[int, str], float]:
    """Seconds of each (stage, op) over the given steps of a gathered trace: the median of
    every action, except a receive's. Its waits are what the simulator works out, so it gets
    only host work: the least receive anywhere in the pipeline, the one whose data was there.
    (A stage's own least is no such thing where every one of its receives waits, as the last
    stage's do across a slow link, and its wait would be counted twice.)"""
    chosen = rows[np.isin(rows[:, STEP], list(steps)) & (rows[:, STAGE] >= 0)]
    durations: dict[tuple[int, str], list[float]] = {}
    for row in chosen:
        op = OP_NAMES[OPS[int(row[OP])]]
        durations.setdefault((int(row[STAGE]), op), []).append(float(row[END] - row[START]))
    host_work = min(
        (v for (_, op), values in durations.items() if op.startswith("RECV") for v in values),
        default=0.0,
    )
    return {
        key: host_work if key[1].startswith("RECV") else median(values)
        for key, values in durations.items()
    }


def ping_pong(link, position: int, sizes: Collection[int], tag: int) -> LinkModel:
    """Pipeline ranks 0 and 1 time round trips at each size (half a round trip is one
    message); the others, and a pipeline of one rank, get a free link. Both ranks must call."""
    if position > 1 or link.comm.Get_size() < 2:
        return FREE_LINK
    peer = 1 - position
    samples = []
    for nbytes in sizes:
        buf = np.zeros(max(nbytes, 1), np.uint8)
        trips = []
        for _ in range(ROUND_TRIPS + 1):  # the first round trip sets the connection up
            start = time.perf_counter()
            for sender in (0, 1):
                if position == sender:
                    link.send_buffer(buf, peer, tag, "a calibration message")
                    link.flush()
                else:
                    link.recv_buffer(buf, peer, tag, "a calibration message")
            trips.append(time.perf_counter() - start)
        samples.append((buf.nbytes, median(trips[1:]) / 2))
    return LinkModel.fit(samples)
