"""Measured costs for the simulator: what a step's computations and messages take here.

The simulator (simulate.py) replays a schedule with any cost function; this module turns
measurements into one. Computations cost what a stage's F, B, BI or BW measured (seconds per
microbatch); a message costs the link's latency plus its bytes at the link's rate, fitted to
timings of a ping-pong and of windows of messages. Imports neither TensorFlow nor MPI, so a
prediction can be checked in milliseconds against synthetic figures with known answers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ringtrain.pipeline.ir import Action, Schedule
from ringtrain.pipeline.simulate import SimResult, simulate


@dataclass(frozen=True)
class LinkModel:
    """One-way time of a message: `latency` seconds plus its bytes at `bytes_per_second`."""

    latency: float
    bytes_per_second: float

    def time(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bytes_per_second

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> LinkModel:
        """Least squares of time = latency + bytes / rate over (bytes, seconds) samples.

        A noisy fit can come out with a negative latency or rate; both are clamped to what a
        link can be (no latency below zero, and the largest message's own rate at most)."""
        if len(samples) < 2 or len({n for n, _ in samples}) < 2:
            raise ValueError("a link model needs timings at two message sizes or more")
        n = len(samples)
        mean_x = sum(x for x, _ in samples) / n
        mean_t = sum(t for _, t in samples) / n
        var = sum((x - mean_x) ** 2 for x, _ in samples)
        slope = sum((x - mean_x) * (t - mean_t) for x, t in samples) / var
        largest, its_time = max(samples)
        slope = max(slope, its_time / largest * 1e-3, 1e-15)
        latency = max(mean_t - slope * mean_x, 0.0)
        return cls(latency, 1.0 / slope)

    def to_json(self) -> dict[str, float]:
        return {"latency_s": self.latency, "bytes_per_second": self.bytes_per_second}


FREE_LINK = LinkModel(0.0, float("inf"))


def predict(
    schedule: Schedule,
    seconds: Mapping[tuple[int, str], float],
    link: LinkModel = FREE_LINK,
    boundary_bytes: Sequence[int] | None = None,
) -> SimResult:
    """The schedule replayed with seconds per (stage, op) and the link's message time.

    `boundary_bytes[s]` is the size of what crosses from stage s to s + 1 (its gradient is as
    big); messages between stages on one rank are not in the schedule, so they cost nothing.
    Compute, and the host's work around a message, REDUCE and STEP, cost what was measured;
    what was not costs nothing."""
    return _replay(schedule, lambda a: seconds.get((a.stage, a.op)), link, boundary_bytes)


def predict_from_steps(
    schedule: Schedule,
    steps: Sequence[Mapping[Action, float]],
    link: LinkModel = FREE_LINK,
    boundary_bytes: Sequence[int] | None = None,
) -> SimResult:
    """The median of replays of measured steps, each with its own actions' seconds: the one
    whose makespan is the median (the upper one of an even count), so its bubble and timeline
    belong to the step time it predicts."""
    if not steps:
        raise ValueError("no measured step to replay")
    replays = [_replay(schedule, step.get, link, boundary_bytes) for step in steps]
    return sorted(replays, key=lambda r: r.makespan)[len(replays) // 2]


def _replay(
    schedule: Schedule,
    measured: Callable[[Action], float | None],
    link: LinkModel,
    boundary_bytes: Sequence[int] | None,
) -> SimResult:
    missing = [
        str(a) for row in schedule.actions for a in row if a.is_compute and measured(a) is None
    ]
    if missing:
        raise ValueError(f"no measured time for {missing[0]}")
    return simulate(schedule, lambda a: measured(a) or 0.0, link.time, boundary_bytes)
