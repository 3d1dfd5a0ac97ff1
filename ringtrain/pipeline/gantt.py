"""Draw per-rank timelines as a Gantt PNG: simulated schedules and measured traces alike."""

from __future__ import annotations

import re
from collections.abc import Sequence

_COLORS = {
    "F": "#4c9be8",
    "B": "#f28e2b",
    "BI": "#f6b26b",
    "BW": "#b45f06",
    "wait": "#dddddd",
}
_NAMES = {
    "F": "forward",
    "B": "backward",
    "BI": "input gradient",
    "BW": "weight gradient",
    "wait": "waiting for a message",
}
_FIXED = "fixed cost (hatched): what the action costs on one example"
_LABEL = re.compile(r"^(\d*)([A-Z]+)(\d*)$")  # "1BI3" (an IR action) or "BI3" (a trace row)


# per rank: (label, start, end), and a measured one's fixed seconds (from its start) after them
Timeline = Sequence[Sequence[tuple]]


def draw_gantt(timeline_per_rank: Timeline, path: str, title: str) -> None:
    """One row per rank (rank 0 on top), one box per (label, start, end), coloured by the
    computation and printed with its microbatch; a rank's later stages are drawn paler, a
    measured action's fixed cost hatched, and a receive's wait grey."""
    draw_panels([(title, timeline_per_rank)], path)


def draw_panels(panels: Sequence[tuple[str, Timeline]], path: str) -> None:
    """Gantt charts one above the other on one time axis, each starting at zero: the
    simulator's prediction over the measured step shows where the two part."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shifted = [(title, _from_zero(lanes)) for title, lanes in panels]
    boxes = [box for _, lanes in shifted for row in lanes for box in row]
    end = max((b[2] for b in boxes), default=1.0)
    rows = sum(len(lanes) for _, lanes in shifted)
    width = min(4 + 0.5 * len(boxes) / max(rows, 1), 24)
    fig, axes = plt.subplots(
        len(shifted), 1, figsize=(width, 1 + 0.6 * rows + 0.4 * len(shifted)), squeeze=False
    )
    seen: set[str] = set()
    for ax, (title, lanes) in zip(axes[:, 0], shifted, strict=True):
        seen |= _draw_lanes(ax, lanes)
        ax.set_xlim(0, end)
        ax.set_title(title)
    axes[-1, 0].set_xlabel("seconds" if len(shifted) > 1 else "time")
    codes = [code for code in _COLORS if code in seen]
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLORS[code]) for code in codes]
    names = [_NAMES[code] for code in codes]
    if _FIXED in seen:
        handles.append(plt.Rectangle((0, 0), 1, 1, fill=False, hatch="///"))
        names.append(_FIXED)
    axes[0, 0].legend(handles, names, loc="upper left", bbox_to_anchor=(1, 1), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _from_zero(lanes: Timeline) -> list[list[tuple[str, float, float]]]:
    """Measured traces carry wall-clock times; every panel is drawn from its first start."""
    begin = min((b[1] for row in lanes for b in row), default=0.0)
    return [[(box[0], box[1] - begin, box[2] - begin, *box[3:]) for box in row] for row in lanes]


def _draw_lanes(ax, lanes: Timeline) -> set[str]:
    """One panel's boxes; the computation codes drawn, for the legend."""
    style = {"height": 0.8, "edgecolor": "black", "linewidth": 0.5}
    seen = set()
    for r, row in enumerate(lanes):
        stages = sorted({_parse(box[0])[0] for box in row if box[0] != "wait"})
        for label, start, stop, *fixed in row:
            stage, code, mb = _parse(label)
            seen.add(code)
            paler = stages.index(stage) if stage in stages else 0
            alpha = 1.0 - 0.5 * paler / max(len(stages), 2)
            color = _COLORS.get(code, "#bbbbbb")
            ax.barh(r, stop - start, left=start, color=color, alpha=alpha, **style)
            if fixed and fixed[0] > 0:
                ax.barh(r, fixed[0], left=start, fill=False, hatch="///", **style)
                seen.add(_FIXED)
            if code != "wait":
                ax.text((start + stop) / 2, r, mb or code, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(lanes)), [f"rank {r}" for r in range(len(lanes))])
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    return seen


def _parse(label: str) -> tuple[str, str, str]:
    """(stage, code, microbatch) of a label; the stage is "" in traces, which hold one stage."""
    match = _LABEL.match(label)
    return match.groups() if match else ("", label, "")
