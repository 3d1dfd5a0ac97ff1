"""The MPI tags of a pipeline's messages: one per stage, microbatch and direction."""

from __future__ import annotations

MPI_TAG_LIMIT = 32767  # the largest tag every MPI must accept (MPI_TAG_UB may be larger)


def message_tag(stage: int, microbatches: int, mb: int, kind: int = 0) -> int:
    """The MPI tag of stage `stage`'s message of microbatch `mb`: kind 0 an activation, 1 a
    gradient; `message_tag(n_stages, M, s)` is stage s's evaluation activations."""
    return 2 * (stage * microbatches + mb) + kind
