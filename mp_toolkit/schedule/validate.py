"""Prove a schedule is runnable: dependencies hold, sends and receives match, no deadlock.

``validate(schedule)`` runs static checks first (placement, completeness, per-rank order,
send/receive pairing in FIFO order), then simulates the ranks under the semantics in
``actions``: compute and sends never block, a receive blocks until its matching send has
been posted, and each (src rank, dst rank) channel delivers in FIFO order. Every failure
raises :class:`ScheduleError` naming the rank, the position in that rank's list and the
action.
"""
from __future__ import annotations

from collections import deque

from mp_toolkit.errors import ScheduleError

from .actions import Action, Kind, Schedule

__all__ = ["ScheduleError", "validate", "simulate_order"]

Key = tuple[int, Kind, int]  # (stage, kind, microbatch)


def _where(rank: int, pos: int, action: Action) -> str:
    return f"rank {rank}, position {pos}: {action}"


def _key(a: Action) -> Key:
    return (a.stage, a.kind, a.microbatch)


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete, ordered and deadlock-free."""
    _check_placement(schedule)
    where = _index_actions(schedule)
    _check_complete(schedule, where)
    _check_dependencies(schedule, where)
    _check_matching(schedule, where)
    simulate_order(schedule)


def _check_placement(schedule: Schedule) -> None:
    """Stages and micro-batches in range, each action on its stage's rank, sane comm peers."""
    p, m, owner = schedule.num_stages, schedule.microbatches, schedule.stage_to_rank
    for rank, acts in enumerate(schedule.actions):
        for pos, a in enumerate(acts):
            here = _where(rank, pos, a)
            if not 0 <= a.stage < p:
                raise ScheduleError(f"{here}: stage {a.stage} is outside 0..{p - 1}")
            if not 0 <= a.microbatch < m:
                raise ScheduleError(f"{here}: micro-batch {a.microbatch} is outside 0..{m - 1}")
            if owner[a.stage] != rank:
                raise ScheduleError(
                    f"{here}: stage {a.stage} runs on rank {owner[a.stage]}, not rank {rank}"
                )
            if a.kind.is_comm:
                peer = a.peer_stage
                if not 0 <= peer < p:
                    raise ScheduleError(f"{here}: stage {a.stage} has no stage {peer} to talk to")
                if owner[peer] == rank:
                    raise ScheduleError(
                        f"{here}: stages {a.stage} and {peer} share rank {rank}; activations "
                        f"pass locally, so remove this comm action"
                    )


def _index_actions(schedule: Schedule) -> dict[Key, tuple[int, int]]:
    """Map each action to (rank, position); any action appearing twice is an error."""
    where: dict[Key, tuple[int, int]] = {}
    for rank, acts in enumerate(schedule.actions):
        for pos, a in enumerate(acts):
            if _key(a) in where:
                r0, p0 = where[_key(a)]
                raise ScheduleError(
                    f"{_where(rank, pos, a)}: duplicate of the same action at rank {r0}, "
                    f"position {p0}"
                )
            where[_key(a)] = (rank, pos)
    return where


def _check_complete(schedule: Schedule, where: dict[Key, tuple[int, int]]) -> None:
    """Each (stage, micro-batch) has one F and either one B or one I and one W."""
    for s in range(schedule.num_stages):
        rank = schedule.stage_to_rank[s]
        for k in range(schedule.microbatches):
            has = {kind for kind in (Kind.F, Kind.B, Kind.I, Kind.W) if (s, kind, k) in where}
            what = f"rank {rank}: stage {s} micro-batch {k}"
            if Kind.F not in has:
                raise ScheduleError(f"{what} has no forward {Action(s, Kind.F, k)}")
            if Kind.B in has and has & {Kind.I, Kind.W}:
                raise ScheduleError(f"{what} has both a full backward B and a split I/W backward")
            if Kind.B not in has and has & {Kind.I, Kind.W} != {Kind.I, Kind.W}:
                missing = "B" if not has & {Kind.I, Kind.W} else ("I" if Kind.I not in has else "W")
                raise ScheduleError(f"{what} has no backward {s}{missing}{k}")


def _check_dependencies(schedule: Schedule, where: dict[Key, tuple[int, int]]) -> None:
    """Per-rank order: inputs before compute, compute before the send of its result."""
    p, owner = schedule.num_stages, schedule.stage_to_rank
    for rank, acts in enumerate(schedule.actions):
        for pos, a in enumerate(acts):
            s, k = a.stage, a.microbatch
            needs: list[Key] = []
            if a.kind is Kind.F and s > 0:
                # Input comes from a RECV_F, or straight from stage s-1 if it shares the rank.
                needs.append((s, Kind.RECV_F, k) if owner[s - 1] != rank else (s - 1, Kind.F, k))
            if a.kind in (Kind.B, Kind.I):
                needs.append((s, Kind.F, k))
                if s < p - 1:
                    if owner[s + 1] != rank:
                        needs.append((s, Kind.RECV_B, k))
                    else:
                        up = Kind.B if (s + 1, Kind.B, k) in where else Kind.I
                        needs.append((s + 1, up, k))
            if a.kind is Kind.W:
                needs.append((s, Kind.I, k))
            if a.kind is Kind.SEND_F:
                needs.append((s, Kind.F, k))
            if a.kind is Kind.SEND_B:
                needs.append((s, Kind.B if (s, Kind.B, k) in where else Kind.I, k))
            for need in needs:
                _require_before(rank, pos, a, need, where)


def _require_before(rank: int, pos: int, a: Action, need: Key,
                    where: dict[Key, tuple[int, int]]) -> None:
    need_action = Action(*need)
    found = where.get(need)
    if found is None:
        raise ScheduleError(f"{_where(rank, pos, a)}: needs {need_action}, which is missing")
    if found[0] != rank or found[1] > pos:
        raise ScheduleError(
            f"{_where(rank, pos, a)}: needs {need_action} earlier on rank {rank}, but it is at "
            f"rank {found[0]}, position {found[1]}"
        )


def _check_matching(schedule: Schedule, where: dict[Key, tuple[int, int]]) -> None:
    """Every send has its receive and vice versa, received in FIFO order per channel."""
    owner = schedule.stage_to_rank
    sends: dict[tuple[int, int], list[Action]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, Action]]] = {}
    for rank, acts in enumerate(schedule.actions):
        for pos, a in enumerate(acts):
            if a.kind.is_comm and _key(a.matching()) not in where:
                raise ScheduleError(
                    f"{_where(rank, pos, a)}: no matching {a.matching()} on rank "
                    f"{owner[a.peer_stage]}"
                )
            if a.kind.is_send:
                sends.setdefault((rank, owner[a.peer_stage]), []).append(a)
            elif a.kind.is_recv:
                recvs.setdefault((owner[a.peer_stage], rank), []).append((pos, a))
    for (src, dst), received in recvs.items():
        for i, ((pos, got), sent) in enumerate(zip(received, sends[(src, dst)])):
            if sent.matching() != got:
                raise ScheduleError(
                    f"{_where(dst, pos, got)}: message {i} from rank {src} to rank {dst} is "
                    f"{sent} (FIFO order), so it must be received by {sent.matching()}"
                )


def simulate_order(schedule: Schedule) -> list[tuple[int, int]]:
    """One global execution order as ``(rank, position)`` pairs, or raise on deadlock.

    Ranks run their lists in order; compute and sends never block; a send appends to the
    FIFO of its (src rank, dst rank) channel; a receive waits until that channel is non-empty
    and must match its head. Sweeps the ranks round-robin until all finish or none can move.
    """
    owner = schedule.stage_to_rank
    cursor = [0] * schedule.num_ranks
    channels: dict[tuple[int, int], deque[Action]] = {}
    order: list[tuple[int, int]] = []
    progressed = True
    while progressed:
        progressed = False
        for rank, acts in enumerate(schedule.actions):
            while cursor[rank] < len(acts):
                pos = cursor[rank]
                a = acts[pos]
                if a.kind.is_send:
                    channels.setdefault((rank, owner[a.peer_stage]), deque()).append(a)
                elif a.kind.is_recv:
                    fifo = channels.get((owner[a.peer_stage], rank))
                    if not fifo:
                        break  # blocked: the matching send has not been posted yet
                    if fifo[0].matching() != a:
                        raise ScheduleError(
                            f"{_where(rank, pos, a)}: the next message from rank "
                            f"{owner[a.peer_stage]} is {fifo[0]}, which this receive does not match"
                        )
                    fifo.popleft()
                order.append((rank, pos))
                cursor[rank] += 1
                progressed = True
    blocked = [r for r, acts in enumerate(schedule.actions) if cursor[r] < len(acts)]
    if blocked:
        waits = "; ".join(
            f"{_where(r, cursor[r], schedule.actions[r][cursor[r]])} waits for "
            f"{schedule.actions[r][cursor[r]].matching()} on rank "
            f"{owner[schedule.actions[r][cursor[r]].peer_stage]}"
            for r in blocked
        )
        raise ScheduleError(f"deadlock: ranks {blocked} are blocked ({waits})")
    return order
