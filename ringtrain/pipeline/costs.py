"""Measured costs for the simulator: what a step's computations and messages take here.

The simulator (simulate.py) replays a schedule with any cost function; this module turns
measurements into one. Computations cost what a stage's F, B, BI or BW measured (seconds per
microbatch); a message costs the link's latency plus its bytes at the link's rate, fitted to
timings of a ping-pong and of windows of messages, less what the link's token bucket lets
through at once (timed on a lone message after a rest). Imports neither TensorFlow nor MPI, so a
prediction can be checked in milliseconds against synthetic figures with known answers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from ringtrain.pipeline.ir import Action, Schedule
from ringtrain.pipeline.simulate import SimResult, simulate


@dataclass(frozen=True)
class LinkModel:
    """One-way time of a message: `latency` seconds plus its bytes at `bytes_per_second`,
    less what the link's token bucket holds. A link that shapes its traffic (`tc tbf`, a cloud
    NIC's burst allowance) lets up to `burst_bytes` through at once after it has rested, and
    refills at its rate; on a link that does not shape, the burst is 0."""

    latency: float
    bytes_per_second: float
    burst_bytes: float = 0.0

    def time(self, nbytes: float) -> float:
        """On a busy link: its bucket empty, every byte at the rate."""
        return self.latency + nbytes / self.bytes_per_second

    def wire(self) -> Wire:
        return Wire(self)

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

    def with_lone_message(self, nbytes: int, seconds: float) -> LinkModel:
        """The burst that explains a message of `nbytes` sent alone, after the link rested, in
        `seconds`: what it did not pay for at the rate (0 up to all of it)."""
        unpaid = nbytes - max(seconds - self.latency, 0.0) * self.bytes_per_second
        return replace(self, burst_bytes=min(max(unpaid, 0.0), float(nbytes)))

    def to_json(self) -> dict[str, float]:
        return {
            "latency_s": self.latency,
            "bytes_per_second": self.bytes_per_second,
            "burst_bytes": self.burst_bytes,
        }


class Wire:
    """One direction of a link in a replay, with its token bucket: time between messages
    refills it at the link's rate up to the burst, and a message spends it, the bytes beyond
    what it holds going at the rate. Messages come in the order they leave."""

    def __init__(self, link: LinkModel):
        self.link, self.tokens, self.idle_since = link, link.burst_bytes, 0.0

    def carry(self, nbytes: float, leaves: float) -> float:
        """Seconds from `leaves` until the message has arrived."""
        link = self.link
        if link.burst_bytes:
            rested = max(leaves - self.idle_since, 0.0) * link.bytes_per_second
            self.tokens = min(link.burst_bytes, self.tokens + rested)
        seconds = link.latency + max(nbytes - self.tokens, 0.0) / link.bytes_per_second
        self.tokens = max(self.tokens - nbytes, 0.0)
        self.idle_since = leaves + seconds
        return seconds


FREE_LINK = LinkModel(0.0, float("inf"))


@dataclass(frozen=True)
class MeasuredCurve:
    """Seconds against bytes as timed at a few sizes, read between them along straight lines
    (and past the ends along the nearest segment). A capped link's token bucket lets what fits
    its burst pass faster than the cap, so no one latency + bytes / rate line holds at every
    size; timed at the sizes that matter, the curve is exact there."""

    points: tuple[tuple[int, float], ...]  # (bytes, seconds), bytes rising

    def time(self, nbytes: float) -> float:
        pts = self.points
        if len(pts) == 1:
            return pts[0][1]
        i = next((k for k in range(1, len(pts) - 1) if nbytes < pts[k][0]), len(pts) - 1)
        (x0, t0), (x1, t1) = pts[i - 1], pts[i]
        return max(t0 + (t1 - t0) * (nbytes - x0) / (x1 - x0), 0.0)

    @classmethod
    def of(cls, samples: Sequence[tuple[int, float]]) -> MeasuredCurve:
        """From (bytes, seconds) samples; a size timed twice keeps its median."""
        by_size: dict[int, list[float]] = {}
        for n, t in samples:
            by_size.setdefault(int(n), []).append(float(t))
        if not by_size:
            raise ValueError("a measured curve needs one timing at least")
        return cls(tuple((n, sorted(ts)[len(ts) // 2]) for n, ts in sorted(by_size.items())))

    def to_json(self) -> dict[str, list]:
        return {"points": [list(p) for p in self.points]}


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
        str(a) for row in schedule.actions for a in row if a.op.is_compute and measured(a) is None
    ]
    if missing:
        raise ValueError(f"no measured time for {missing[0]}")
    return simulate(schedule, lambda a: measured(a) or 0.0, link, boundary_bytes)
