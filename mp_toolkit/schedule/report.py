"""``mpt simulate``: a named schedule generated, simulated with per-action costs and (optionally) drawn."""

from __future__ import annotations

from .gantt import draw_gantt
from .generators import get_schedule
from .printer import format_schedule
from .simulator import DEFAULT_COSTS, CostSpec, complete_kinds, simulate

__all__ = ["simulate_report"]


def simulate_report(
    schedule_name: str,
    pp: int,
    microbatches: int,
    chunks: int | None = None,
    costs: CostSpec | None = None,
    *,
    gantt: str | None = None,
) -> dict:
    """What ``mpt simulate --schedule S --pp P --microbatches M [--chunks V]`` reports.

    ``costs`` as a kind dict (default :data:`DEFAULT_COSTS`) are for one micro-batch through
    one rank's share of the model; with ``chunks`` v > 1 each chunk's action takes 1/v of it,
    so schedules of the same model compare directly. A stage dict ``{stage: {...}}`` gives
    each schedule stage (chunk) its own costs, used as they are. ``gantt`` (a .png or .svg path)
    also draws the timeline. Returns ``schedule, pp, microbatches, chunks, placement`` (each stage's
    rank), ``step_time, bubble_fraction, peak_inflight`` (per stage), ``peak_inflight_rank`` (per rank,
    its stages' at once) and ``grid`` (`format_schedule`'s text). Bad names or sizes raise ``ValueError``.
    """
    schedule = get_schedule(schedule_name, pp, microbatches, chunks=chunks)
    v = schedule.num_stages // schedule.num_ranks
    if callable(costs):
        raise ValueError("simulate_report takes costs as a dict like {'F': 1.0, 'B': 2.0}")
    if costs and all(isinstance(k, int) for k in costs):
        table = costs
    else:
        table = {k: c / v for k, c in complete_kinds(costs or DEFAULT_COSTS).items()}
    timeline = simulate(schedule, table)
    if gantt is not None:
        draw_gantt(timeline, gantt)
    return {
        "schedule": schedule.name,
        "pp": pp,
        "microbatches": microbatches,
        "chunks": v,
        "placement": list(schedule.stage_to_rank),
        "step_time": timeline.step_time,
        "bubble_fraction": timeline.bubble_fraction,
        "peak_inflight": list(timeline.peak_inflight),
        "peak_inflight_rank": list(timeline.peak_inflight_rank),
        "grid": format_schedule(schedule),
    }
