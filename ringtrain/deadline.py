"""The deadline rule every wait for a peer follows.

A wait for a message of B bytes may last `--comm-timeout` plus B at `--min-link-rate` MB/s. A
slow link that still moves data at the minimum rate never trips it; a silent peer trips it
`--comm-timeout` after the transfer should have ended.
"""

from __future__ import annotations

DEFAULT_MIN_LINK_RATE = 1.0  # MB/s: below any real cluster link, above a dead one


def transfer_time(nbytes: int, min_rate: float = DEFAULT_MIN_LINK_RATE) -> float:
    """Seconds `nbytes` may take at the minimum rate: what a deadline adds to --comm-timeout."""
    return nbytes / (min_rate * 1e6)


def waited(timeout: float, extra: float) -> str:
    """How an error line states a deadline: `20 s`, or `20 s (+1.5 s for the bytes)`."""
    return f"{timeout:g} s" + (f" (+{extra:.1f} s for the bytes)" if extra >= 0.05 else "")


def step_traffic(engine, microbatches: int) -> int:
    """Bytes one step may move through a rank: its gradients twice (a ring allreduce sends and
    receives about that much), plus, on a pipeline stage, each microbatch's activation and
    gradient buffers."""
    from ringtrain.weights import variable_bytes

    weights = sum(variable_bytes(engine.variables))
    per_microbatch = getattr(engine, "microbatch_bytes", 0)
    return 2 * weights + microbatches * per_microbatch
