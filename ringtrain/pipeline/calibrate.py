"""Calibration inside the run: the simulator's figures, measured where the job runs.

A prediction needs the seconds of each stage's F, B, BI and BW, and a message's time by its
bytes. The computations are read from the executor's own trace, over the first steps after
the one that traced the graphs (CALIBRATION_STEPS); messages are timed by a ping-pong between
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
from ringtrain.pipeline.trace import END, OP, OPS, STAGE, START, STEP, computations

CALIBRATION_STEPS = 3  # after the first, which traces the graphs
ROUND_TRIPS = 5


def stage_seconds(rows: np.ndarray, steps: Collection[int]) -> dict[tuple[int, str], float]:
    """Median seconds of each (stage, computation) over the given steps of a gathered trace."""
    chosen = computations(rows[np.isin(rows[:, STEP], list(steps))])
    durations: dict[tuple[int, str], list[float]] = {}
    for row in chosen:
        key = (int(row[STAGE]), OPS[int(row[OP])])
        durations.setdefault(key, []).append(float(row[END] - row[START]))
    return {key: median(values) for key, values in durations.items()}


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
