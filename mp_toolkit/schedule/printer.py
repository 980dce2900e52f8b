"""Text views of a schedule: a ranks x time-steps grid and the raw per-rank action lists.

Time steps come from a unit-cost simulation: every compute action takes one step, comm
actions take none, a rank runs its list in order, and a receive completes no earlier than
the step at which its matching send was posted. For example
``format_schedule(one_f_one_b(2, 3))`` gives::

    time    0  1  2  3  4  5  6  7
    rank 0 F0 F1  . B0 F2 B1  . B2
    rank 1  . F0 B0 F1 B1 F2 B2  .

The last stage's backward gates every upstream one, hence the idle steps (the bubble).
"""
from __future__ import annotations

from .actions import Action, Schedule
from .validate import simulate_order

__all__ = ["unit_time_steps", "makespan", "format_schedule", "format_actions"]


def unit_time_steps(schedule: Schedule) -> dict[tuple[int, int], int]:
    """Map ``(rank, position)`` of every action to its time step under unit compute cost.

    A compute action occupies step ``t``; a comm action gets the time ``t`` at which it
    happens (a send right after the compute before it, a receive when both its rank has
    reached it and its send has been posted). Raises ``ScheduleError`` on deadlock.
    """
    clock = [0] * schedule.num_ranks
    posted: dict[tuple[int, object, int], int] = {}  # send key -> time it was posted
    times: dict[tuple[int, int], int] = {}
    for rank, pos in simulate_order(schedule):
        a = schedule.actions[rank][pos]
        if a.kind.is_compute:
            times[(rank, pos)] = clock[rank]
            clock[rank] += 1
        elif a.kind.is_send:
            times[(rank, pos)] = clock[rank]
            posted[(a.stage, a.kind, a.microbatch)] = clock[rank]
        else:
            send = a.matching()
            clock[rank] = max(clock[rank], posted[(send.stage, send.kind, send.microbatch)])
            times[(rank, pos)] = clock[rank]
    return times


def makespan(schedule: Schedule) -> int:
    """Number of unit time steps until the last compute action finishes."""
    times = unit_time_steps(schedule)
    ends = [
        t + 1 for (r, i), t in times.items() if schedule.actions[r][i].kind.is_compute
    ]
    return max(ends, default=0)


def _label(a: Action, short: bool) -> str:
    return f"{a.kind.value}{a.microbatch}" if short else str(a)


def format_schedule(schedule: Schedule, comms: bool = False) -> str:
    """Render a ranks x time-steps grid; idle steps are ``.``.

    Cells are ``F3`` / ``B2`` (the stage is implied by the rank; when a rank owns several
    stages the full spelling ``2F3`` is used). With ``comms=True`` comm actions are joined
    with ``+`` into the cell of a neighbouring compute action in the rank's list: a send
    beside the compute before it, a receive beside the compute after it, e.g.
    ``RECV_F1+F1+SEND_F1``.
    """
    times = unit_time_steps(schedule)
    short = all(len(schedule.stages_of(r)) == 1 for r in range(schedule.num_ranks))
    num_steps = makespan(schedule)
    grid = [[[] for _ in range(num_steps)] for _ in range(schedule.num_ranks)]
    for rank, acts in enumerate(schedule.actions):
        for pos, step in enumerate(_cell_steps(acts, times, rank)):
            if step is not None and (comms or acts[pos].kind.is_compute):
                grid[rank][step].append(_label(acts[pos], short))
    cells = [["+".join(c) or "." for c in row] for row in grid]
    width = max([len(c) for row in cells for c in row] + [len(str(max(num_steps - 1, 0)))])
    labels = [f"rank {r}" for r in range(schedule.num_ranks)]
    label_width = max(len(x) for x in labels + ["time"])
    lines = ["time".ljust(label_width) + "".join(f" {t:>{width}}" for t in range(num_steps))]
    for label, row in zip(labels, cells):
        lines.append(label.ljust(label_width) + "".join(f" {c:>{width}}" for c in row))
    return "\n".join(lines)


def _cell_steps(acts, times, rank) -> list[int | None]:
    """Step whose cell shows each action: its own step for compute; a send goes beside the
    compute before it, a receive beside the compute after it (list order, not wall time)."""
    compute = [times[(rank, i)] if a.kind.is_compute else None for i, a in enumerate(acts)]
    steps: list[int | None] = list(compute)
    last = None
    for i in range(len(acts)):  # sends (and trailing receives) look backwards
        if compute[i] is not None:
            last = compute[i]
        else:
            steps[i] = last
    following = None
    for i in range(len(acts) - 1, -1, -1):  # receives (and leading sends) look forwards
        if compute[i] is not None:
            following = compute[i]
        elif (acts[i].kind.is_recv or steps[i] is None) and following is not None:
            steps[i] = following
    return steps


def format_actions(schedule: Schedule) -> str:
    """One line per rank with its raw action strings, e.g. ``rank 0: 0F0 0SEND_F0 ...``."""
    return "\n".join(
        f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(schedule.actions)
    )
