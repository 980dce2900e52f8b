"""Draw a simulated timeline as a Gantt chart: one row per rank, one box per compute action.

Boxes are coloured by kind (F, B, I, W) and labelled with the micro-batch number; when a rank
holds several stages (interleaved schedules) later chunks are drawn lighter and labelled
``stage:micro-batch``. The time axis is in the units of the costs given to ``simulate``.
matplotlib is imported on first use (Agg backend), so importing the schedule package stays
cheap for the executor.
"""
from __future__ import annotations

import io
import os

from mp_toolkit.user_files import write_output

from .simulator import Timeline

__all__ = ["draw_gantt", "KIND_COLOURS"]

KIND_COLOURS = {"F": "#4c72b0", "B": "#55a868", "I": "#dd8452", "W": "#8172b3"}
_FORMATS = (".png", ".svg")


def draw_gantt(timeline: Timeline, path: str | os.PathLike, title: str | None = None,
               xlabel: str = "time") -> None:
    """Write ``timeline`` as a PNG or SVG chart, chosen by the suffix of ``path``; ``xlabel``
    names the unit of the costs (the planner passes predicted milliseconds)."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in _FORMATS:
        raise ValueError(f"Gantt chart path {os.fspath(path)!r} must end in .png or .svg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    schedule = timeline.schedule
    ranks = timeline.num_ranks
    width = min(max(6.0, 0.35 * len(timeline.compute_events(0))), 30.0)
    fig, ax = plt.subplots(figsize=(width, 0.6 * ranks + 1.4))
    for rank in range(ranks):
        stages = schedule.stages_of(rank)
        for event in timeline.compute_events(rank):
            _draw_box(ax, rank, event, stages)
    ax.set_ylim(ranks - 0.5, -0.5)  # rank 0 on top, like the text view
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)])
    ax.set_xlim(0, max(timeline.step_time, 1e-12))
    ax.set_xlabel(xlabel)
    used = sorted({e.action.kind.value for evs in timeline.events for e in evs
                   if e.action.kind.is_compute}, key="FBIW".index)
    ax.legend(handles=[Patch(color=KIND_COLOURS[k], label=k) for k in used],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if ranks < 3 else -0.2),
              ncol=len(used), frameon=False)
    ax.set_title(title or (
        f"{schedule.name}: {ranks} ranks, {schedule.microbatches} micro-batches, "
        f"step {timeline.step_time:.3g}, bubble {timeline.bubble_fraction:.1%}"
    ))
    fig.tight_layout()
    image = io.BytesIO()
    try:
        fig.savefig(image, format=suffix[1:])
    finally:
        plt.close(fig)
    write_output("--gantt", path, image.getvalue())


def _draw_box(ax, rank: int, event, stages: tuple[int, ...]) -> None:
    """One compute action: a bar from start to end with its micro-batch number inside."""
    a = event.action
    chunk = stages.index(a.stage)
    alpha = 1.0 - 0.45 * chunk / max(len(stages) - 1, 1)
    duration = event.end - event.start
    ax.broken_barh([(event.start, duration)], (rank - 0.4, 0.8),
                   facecolors=KIND_COLOURS[a.kind.value], alpha=alpha,
                   edgecolor="white", linewidth=0.5)
    label = str(a.microbatch) if len(stages) == 1 else f"{a.stage}:{a.microbatch}"
    ax.text(event.start + duration / 2, rank, label, ha="center", va="center",
            fontsize=7, color="white")
