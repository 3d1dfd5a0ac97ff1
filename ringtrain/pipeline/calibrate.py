"""Calibration inside the run: the simulator's figures, measured where the job runs.

A prediction needs the seconds of each stage's F, B, BI and BW (and of the host's work around
each message, REDUCE and STEP), and a message's time by its bytes. The actions' times are read
from the executor's own trace, over CALIBRATION_STEPS steps spread through the run after the
one that traced the graphs (calibration_steps). Messages are timed between the first two
pipeline ranks, through the same Link the executor sends with: a tiny ping-pong for the
latency, a window of boundary-sized messages for the rate, fitted to latency + bytes / rate,
and one such message alone after a rest for the burst a shaping link lets through
(costs.LinkModel).

Each calibration step is replayed with its own actions' times (step_actions), not with a
median per (stage, op): a step is a max of sums, so the spread of its actions adds waiting
that no central figure carries, and medians under-predicted step time by 3-9% here. The
prediction is then compared with the other steps, which the calibration did not see.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from statistics import median

import numpy as np

from ringtrain.pipeline.costs import FREE_LINK, LinkModel
from ringtrain.pipeline.ir import Action, Op
from ringtrain.pipeline.trace import END, MB, OP, OPS, RANK, STAGE, START, STEP, WAIT

CALIBRATION_STEPS = 3  # after the first, which traces the graphs
ROUNDS = 5  # timed exchanges per size, after one that sets the connection up
WINDOW = 8  # messages streamed back to back to time a rate


def calibration_steps(first: int, steps: int) -> list[int]:
    """CALIBRATION_STEPS of the `steps` steps from `first` (all but one when there are fewer),
    spread evenly through them: a slow start, after another job's turn on the cores or a
    first-use allocation, then weighs on the calibration and the steps it predicts alike.
    Calibrated on a run's first 3 steps, GPipe at M=8 was predicted 16% too slow, its 3 first
    steps 12-24% slower than the 27 after them."""
    count = max(1, min(CALIBRATION_STEPS, steps - 1))
    stride = max(1, steps // count)
    return [first + k * stride for k in range(count)]


def _durations(rows: np.ndarray, steps: Collection[int]) -> list[tuple[int, Action, float]]:
    """(step, action, seconds) of every staged row over the given steps of a gathered trace;
    a receive's seconds are its own work, without its wait, which the simulator works out."""
    chosen = rows[np.isin(rows[:, STEP], list(steps)) & (rows[:, STAGE] >= 0)]
    timed = []
    for row in chosen:
        op = Op.of_code(OPS[int(row[OP])])
        seconds = float(row[END] - row[START] - (row[WAIT] if op.is_recv else 0.0))
        action = Action(int(row[STAGE]), op, None if row[MB] < 0 else int(row[MB]))
        timed.append((int(row[STEP]), action, seconds))
    return timed


def stage_seconds(rows: np.ndarray, steps: Collection[int]) -> dict[tuple[int, Op], float]:
    """Seconds of each (stage, op) over the given steps of a gathered trace: the median of
    every action (a receive's without its wait)."""
    durations: dict[tuple[int, Op], list[float]] = {}
    for _, a, t in _durations(rows, steps):
        durations.setdefault((a.stage, a.op), []).append(t)
    return {key: median(values) for key, values in durations.items()}


def step_actions(
    rows: np.ndarray, steps: Collection[int], pp_size: int
) -> list[dict[Action, float]]:
    """Each action's own seconds, one mapping per step and replica (ranks of one replica are
    `pp_size` consecutive ranks); receives without their waits, as in `stage_seconds`."""
    chosen = rows[np.isin(rows[:, STEP], list(steps))]
    dp_rank = chosen[:, RANK] // pp_size
    replays = []
    for step, which in sorted(
        {(int(s), int(r)) for s, r in zip(chosen[:, STEP], dp_rank, strict=True)}
    ):
        own = chosen[(chosen[:, STEP] == step) & (dp_rank == which)]
        replays.append({a: t for _, a, t in _durations(own, [step])})
    return replays


def measure_link(link, pp_rank: int, sizes: Collection[int], tag: int) -> LinkModel:
    """Pipeline ranks 0 and 1 time the link and both get rank 0's fit; the others, and a
    pipeline of one rank, get a free link. Both ranks must call.

    The smallest size is timed by ping-pong (half a round trip: the latency). Each larger one
    is timed as a bandwidth test streams it: a window of WINDOW messages from rank 0, back to
    back, that rank 1 acknowledges with the smallest. That is what a train of activations
    meets; a lone large message need not be: a link that shapes its traffic with a token
    bucket lets one burst through at several times its rate (48 MB/s on a 25 MB/s cap here).
    So the largest size is also timed alone, after the link has rested for two of its
    messages at the rate, and what that message did not pay for is the link's burst."""
    if pp_rank > 1 or link.comm.Get_size() < 2:
        return FREE_LINK
    peer = 1 - pp_rank
    smallest, *larger = sorted(sizes)
    ack = np.zeros(max(smallest, 1), np.uint8)
    what = "a calibration message"

    def exchange(buf: np.ndarray, count: int) -> float:
        start = time.perf_counter()
        if pp_rank == 0:
            for _ in range(count):
                link.send_buffer(buf, peer, tag, what)
            link.flush()
            link.recv_buffer(ack, peer, tag, what)
        else:
            for _ in range(count):
                link.recv_buffer(buf, peer, tag, what)
            link.send_buffer(ack, peer, tag, what)
            link.flush()
        return time.perf_counter() - start

    def timed(buf: np.ndarray, count: int, rest: float = 0.0) -> float:
        def after_rest() -> float:
            if pp_rank == 0:
                time.sleep(rest)
            return exchange(buf, count)

        # the first exchange sets the connection up
        return median([after_rest() for _ in range(ROUNDS + 1)][1:])

    latency = timed(ack, 1) / 2
    samples = [(ack.nbytes, latency)]
    window = 0.0
    for nbytes in larger:
        window = timed(np.zeros(nbytes, np.uint8), WINDOW) - latency
        samples.append((WINDOW * nbytes, window))
    largest = max(larger, default=ack.nbytes)
    # a window on shared memory can time below the ping-pong's latency: no rest then
    lone = timed(np.zeros(largest, np.uint8), 1, rest=max(2 * window / WINDOW, 0.0)) - latency
    figures = np.array([*(value for sample in samples for value in sample), lone], np.float64)
    if pp_rank == 0:
        link.send_buffer(figures, peer, tag, what)
        link.flush()
    else:
        link.recv_buffer(figures, peer, tag, what)
    fitted = LinkModel.fit([(int(n), float(t)) for n, t in figures[:-1].reshape(-1, 2)])
    return fitted.with_lone_message(largest, float(figures[-1]))
