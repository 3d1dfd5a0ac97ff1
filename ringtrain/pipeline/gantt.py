"""Draw per-rank timelines as a Gantt PNG: simulated schedules and measured traces alike."""

from __future__ import annotations

import re
from collections.abc import Sequence

_COLORS = {"F": "#4c9be8", "B": "#f28e2b", "BI": "#f6b26b", "BW": "#b45f06"}
_NAMES = {"F": "forward", "B": "backward", "BI": "input gradient", "BW": "weight gradient"}
_LABEL = re.compile(r"^(\d*)([A-Z]+)(\d*)$")  # "1BI3" (an IR action) or "BI3" (a trace row)


def draw_gantt(
    timeline_per_rank: Sequence[Sequence[tuple[str, float, float]]], path: str, title: str
) -> None:
    """One row per rank (rank 0 on top), one box per (label, start, end), coloured by the
    computation and printed with its microbatch; a rank's later stages are drawn paler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(timeline_per_rank)
    boxes = [box for row in timeline_per_rank for box in row]
    begin = min((b[1] for b in boxes), default=0.0)
    end = max((b[2] for b in boxes), default=begin + 1.0)
    fig, ax = plt.subplots(figsize=(min(4 + 0.5 * len(boxes) / max(rows, 1), 24), 1 + 0.5 * rows))
    style = {"height": 0.8, "edgecolor": "black", "linewidth": 0.5}
    seen = set()
    for r, row in enumerate(timeline_per_rank):
        stages = sorted({_parse(label)[0] for label, _, _ in row})
        for label, start, stop in row:
            stage, code, mb = _parse(label)
            seen.add(code)
            alpha = 1.0 - 0.5 * stages.index(stage) / max(len(stages), 2)
            color = _COLORS.get(code, "#bbbbbb")
            ax.barh(r, stop - start, left=start, color=color, alpha=alpha, **style)
            ax.text((start + stop) / 2, r, mb or code, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(rows), [f"rank {r}" for r in range(rows)])
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xlim(begin, end)
    ax.set_xlabel("time")
    ax.set_title(title)
    codes = [code for code in _COLORS if code in seen]
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLORS[code]) for code in codes]
    names = [_NAMES[code] for code in codes]
    ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1, 1), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _parse(label: str) -> tuple[str, str, str]:
    """(stage, code, microbatch) of a label; the stage is "" in traces, which hold one stage."""
    match = _LABEL.match(label)
    return match.groups() if match else ("", label, "")
