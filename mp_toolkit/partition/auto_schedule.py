"""``--schedule auto``: the fastest predicted schedule among GPipe, 1F1B, interleaved 1F1B, ZB-drain,
ZB-H1, ZB-V and DualPipeV that fits the memory cap.

Each candidate is planned in full (`planner.make_plan`: its own cut, in-flight memory, simulated
timeline with messages, optimizer step); a candidate fits when no rank is over ``memory_gb`` (and
its cut exists: ``method`` memory raises when nothing fits); with a device profile and no cap, the
device's capacity is the cap (`Plan.fits`). Interleaved runs with ``chunks`` model
chunks per rank (2 unless the request names more) where the micro-batches are a multiple of pp and
the layers suffice; ZB-V and DualPipeV with two stages per rank in a V (DualPipeV where there are at
least 2 pp micro-batches). Ties go to the earlier candidate in the order above (the simpler schedule):
`mp_toolkit.names.SCHEDULES`' order.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from mp_toolkit.names import SCHEDULES, stages_per_rank

from .cost import CostModelError
from .planner import GB, Plan, PlanRequest, make_plan
from .solvers import PartitionError

CANDIDATES = SCHEDULES
DEFAULT_CANDIDATES = ("1f1b", "zbdrain", "zbh1", "interleaved", "zbv", "dualpipev")
"""What `mpt train` weighs when no schedule is named (issues 23, 38), 1F1B first so a tie keeps it and
those of several stages per rank last (they re-cut the model into pp x 2 stages:
`run.recompute_plan.default_schedule` leaves them out where the run fixes the cut or per-stage counts)."""


@dataclass
class ScheduleChoice:
    """The chosen plan and every candidate's predicted step time (ms) or why it was left out."""

    plan: Plan
    considered: dict[str, str]

    def describe(self) -> str:
        r = self.plan.request
        name = r.schedule + (f" x{r.chunks} chunks" if r.chunks > 1 else "")
        return f"--schedule auto: {name} ({'; '.join(f'{k} {v}' for k, v in self.considered.items())})"


def fastest_schedule(req: PlanRequest, candidates: tuple[str, ...] = CANDIDATES) -> ScheduleChoice:
    """Plan ``req`` under every candidate schedule; the fastest that fits. Raises PartitionError
    (one line, each candidate's reason) when none does."""
    considered, best = {}, None
    for schedule in candidates:
        chunks = max(req.chunks, 2) if schedule == "interleaved" else stages_per_rank(schedule)
        try:
            plan = make_plan(replace(req, schedule=schedule, chunks=chunks))
        except (PartitionError, CostModelError) as e:
            considered[schedule] = f"left out: {str(e).splitlines()[0]}"
            continue
        if not plan.fits:
            cap = (f"--memory-gb {req.memory_gb:g}" if req.memory_gb is not None
                   else f"the device's {plan.rates.capacity / GB:.3g} GB")
            considered[schedule] = f"left out: over {cap}"
            continue
        considered[schedule] = f"{plan.step_time_ms:.1f} ms"
        if best is None or plan.step_time_ms < best.step_time_ms:
            best = plan
    if best is None:
        reasons = "; ".join(f"{k} {v}" for k, v in considered.items())
        raise PartitionError(f"--schedule auto: no schedule fits: {reasons}")
    return ScheduleChoice(best, considered)
