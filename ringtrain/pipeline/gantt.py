"""Draw per-stage timelines as a Gantt PNG: simulated schedules and measured traces alike."""

from __future__ import annotations

import re
from collections.abc import Sequence

_COLORS = {"F": "#4c9be8", "B": "#f28e2b"}


def draw_gantt(
    timeline_per_stage: Sequence[Sequence[tuple[str, float, float]]], path: str, title: str
) -> None:
    """One row per stage (stage 0 on top), one labelled box per (label, start, end).

    Labels like "F3"/"B3" pick the colour from their first letter and print the microbatch.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(timeline_per_stage)
    boxes = [box for row in timeline_per_stage for box in row]
    begin = min((b[1] for b in boxes), default=0.0)
    end = max((b[2] for b in boxes), default=begin + 1.0)
    fig, ax = plt.subplots(figsize=(min(4 + 0.5 * len(boxes) / max(rows, 1), 24), 1 + 0.5 * rows))
    style = {"height": 0.8, "edgecolor": "black", "linewidth": 0.5}
    for s, row in enumerate(timeline_per_stage):
        for label, start, stop in row:
            color = _COLORS.get(label[:1], "#bbbbbb")
            ax.barh(s, stop - start, left=start, color=color, **style)
            mb = re.search(r"\d+$", label)
            text = mb.group(0) if mb else label
            ax.text((start + stop) / 2, s, text, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(rows), [f"stage {s}" for s in range(rows)])
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xlim(begin, end)
    ax.set_xlabel("time")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, ["forward", "backward"], loc="upper left", bbox_to_anchor=(1, 1), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
