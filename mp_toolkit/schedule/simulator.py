"""Turn a schedule plus per-action costs into a timeline: step time, bubble, peak activations.

The model is the one the executor implements (see ``actions``):

* each rank runs its list in order; a compute action (F, B, I, W) takes its cost;
* a send is posted at the sender's current time and costs the sender nothing (async);
* a receive completes at ``max(now, arrival)`` where the message arrives
  ``p2p_latency + message_bytes / p2p_bandwidth`` after its send is posted. Messages on one
  (src rank, dst rank) link are transmitted one after another (FIFO), so with a finite
  bandwidth a message may also wait for the one before it;
* stages that share a rank hand activations over locally, for free.

Bubble fraction is idle over total time summed over ranks,
``1 - sum(busy) / (ranks * step_time)``; with ``p`` equal stages GPipe and 1F1B give
``(p-1)/(m+p-1)``, interleaved 1F1B with ``v`` chunks ``(p-1)/(v*m+p-1)``.

In-flight activations: ``peak_inflight[s]`` is the most micro-batches whose forward on stage
``s`` has run but whose input-gradient backward (``B`` or ``I``) has not — the activations a
stage must keep to compute the gradient it sends upstream. Zero-bubble schedules keep part of
them (the layer inputs the weight gradient needs) until ``W``; ``peak_inflight_w`` counts
forwards done minus ``B``/``W`` done, the stricter measure. Per-rank values sum the stages
on a rank, in units of one stage's micro-batch (for interleaved schedules one chunk's share).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Union

from .actions import Action, Kind, Schedule
from .validate import simulate_order

__all__ = ["Timeline", "Event", "Prepared", "simulate", "prepare", "cost_function", "complete_kinds", "DEFAULT_COSTS"]

CostSpec = Union[Callable[[Action], float], Mapping]
DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
"""Unit costs: backward twice the forward, split evenly into input and weight gradients."""


@dataclass(frozen=True)
class Event:
    """One action on one rank: ``start``/``end`` in the units of the costs.

    Compute actions last their cost; a send has ``start == end`` (posted, free); a receive
    starts when its rank reaches it and ends when the message has arrived (the wait)."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` predicts for one global batch."""

    schedule: Schedule
    events: tuple[tuple[Event, ...], ...]
    """``events[r]``: rank ``r``'s actions in list order with their times."""
    step_time: float
    """Time until the last action on any rank ends (every rank starts at 0)."""
    busy: tuple[float, ...]
    """Compute time per rank (waiting in receives and idling are not busy)."""
    peak_inflight: tuple[int, ...]
    """Per stage: max over time of forwards done minus B/I done."""
    peak_inflight_rank: tuple[int, ...]
    """Per rank: the same count summed over the rank's stages."""
    peak_inflight_w: tuple[int, ...]
    """Per stage: max over time of forwards done minus B/W done (what ZB keeps until W)."""
    peak_held_w: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per stage: the (activations, recorded gradients) micro-batch counts it holds while each of its
    compute actions runs (`_held_counts`), those no other pair covers in both: a stage's peak is the
    largest ``a * A + r * R + workspace`` over them for any per-micro-batch bytes ``A``, ``R``."""
    rank_held: tuple[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]], ...] = ()
    """Per rank holding several stages: ``(its stages, count vectors)``, the micro-batches of
    activations each of its stages holds at once while one of its compute actions runs, the vectors
    no other covers: a rank's peak is the largest ``sum(count[j] * A[j])`` over them."""

    @property
    def num_ranks(self) -> int:
        return len(self.events)

    @property
    def bubble_fraction(self) -> float:
        """``1 - sum(busy) / (ranks * step_time)``: the idle share of all rank-time."""
        if self.step_time <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_ranks * self.step_time)

    @property
    def idle_time(self) -> float:
        """Idle rank-time summed over ranks: ``ranks * step_time - sum(busy)``."""
        return self.num_ranks * self.step_time - sum(self.busy)

    def compute_events(self, rank: int) -> list[Event]:
        return [e for e in self.events[rank] if e.action.kind.is_compute]


def cost_function(costs: CostSpec | None) -> Callable[[Action], float]:
    """Normalise a cost spec to ``action -> seconds`` (or whatever unit the numbers are in).

    Accepted: ``None`` (:data:`DEFAULT_COSTS`); a callable; a dict by kind name
    ``{"F": 1.0, "B": 2.0}``; or a dict by stage ``{0: {"F": ...}, 1: {...}}``. In a kind
    dict a missing ``B`` is ``I + W``, and missing ``I``/``W`` are half of ``B`` each.
    """
    if costs is None:
        costs = DEFAULT_COSTS
    if callable(costs):
        return costs
    if costs and all(isinstance(k, int) for k in costs):
        per_stage = {s: complete_kinds(c) for s, c in costs.items()}

        def by_stage(a: Action) -> float:
            if a.stage not in per_stage:
                raise ValueError(f"costs give no entry for stage {a.stage} (action {a})")
            return _lookup(per_stage[a.stage], a)

        return by_stage
    table = complete_kinds(costs)
    return lambda a: _lookup(table, a)


def complete_kinds(costs: Mapping) -> dict[str, float]:
    """A kind -> cost table (keys "F", "B", ...; `Kind` members too) with B = I + W or I = W = B / 2 filled in."""
    table = {str(getattr(k, "value", k)): float(v) for k, v in costs.items()}
    if "B" not in table and "I" in table and "W" in table:
        table["B"] = table["I"] + table["W"]
    if "B" in table:
        table.setdefault("I", table["B"] / 2)
        table.setdefault("W", table["B"] / 2)
    return table


def _lookup(table: Mapping[str, float], a: Action) -> float:
    try:
        return table[a.kind.value]
    except KeyError:
        raise ValueError(
            f"costs give no duration for {a.kind.value} actions (needed by {a}); "
            f"pass e.g. {{'F': 1.0, 'B': 2.0, 'I': 1.0, 'W': 1.0}}"
        ) from None


def simulate(
    schedule: Schedule,
    costs: CostSpec | None = None,
    p2p_latency: float = 0.0,
    p2p_bandwidth: float | None = None,
    message_bytes: float | Callable[[Action], float] | None = None,
    transfer: Callable[[Action], tuple[float, float]] | None = None,
    prepared: "Prepared | None" = None,
) -> Timeline:
    """Simulate ``schedule``; see the module docstring for the model.

    ``message_bytes`` is a number or ``send_action -> bytes``; the transfer term
    ``bytes / p2p_bandwidth`` is used only when both are given. Raises ``ScheduleError``
    when the schedule deadlocks. ``transfer`` (``send -> (latency, wire time)``), when given, replaces
    the three: messages crossing links of different speeds (a cluster's nodes). ``prepared``
    (`prepare`): what depends on the schedule alone, computed once for many simulations of it.
    """
    prepared = prepared or prepare(schedule)
    cost = cost_function(costs)
    transfer = transfer or _transfer_function(p2p_latency, p2p_bandwidth, message_bytes)
    owner = schedule.stage_to_rank
    clock = [0.0] * schedule.num_ranks
    busy = [0.0] * schedule.num_ranks
    link_free: dict[tuple[int, int], float] = {}
    arrival: dict[Action, float] = {}  # receive action -> time its message arrives
    events: list[dict[int, Event]] = [{} for _ in range(schedule.num_ranks)]
    for rank, pos in prepared.order:  # every send is visited before its receive
        a = schedule.actions[rank][pos]
        start = clock[rank]
        if a.kind.is_compute:
            clock[rank] = start + cost(a)
            busy[rank] += cost(a)
        elif a.kind.is_send:
            link = (rank, owner[a.peer_stage])
            latency, wire = transfer(a)
            sent = max(start, link_free.get(link, 0.0)) + wire
            link_free[link] = sent
            arrival[a.matching()] = sent + latency
        else:
            clock[rank] = max(start, arrival.pop(a))
        events[rank][pos] = Event(a, start, clock[rank])
    per_rank = tuple(tuple(ev[i] for i in range(len(ev))) for ev in events)
    step_time = max((e.end for evs in per_rank for e in evs), default=0.0)
    return Timeline(schedule, per_rank, step_time, tuple(busy), *prepared.held)


@dataclass(frozen=True)
class Prepared:
    """What `simulate` needs of a schedule whatever its costs: the order in which it visits the actions
    (`validate.simulate_order`) and what the stages hold (`_held_counts`)."""

    order: tuple
    held: tuple


def prepare(schedule: Schedule) -> Prepared:
    return Prepared(tuple(simulate_order(schedule)), _held_counts(schedule))


def _transfer_function(latency, bandwidth, message_bytes):
    """``send -> (latency, wire time)``: bytes/bandwidth only when both are given."""
    def transfer(a: Action) -> tuple[float, float]:
        if bandwidth is None or message_bytes is None:
            return latency, 0.0
        size = message_bytes(a) if callable(message_bytes) else message_bytes
        return latency, float(size) / bandwidth
    return transfer


def _undominated(counts: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The count vectors no other vector covers in every position, sorted. A vector's coverers sort
    before it in descending order, so one pass against those kept so far suffices (GPipe's m
    distinct counts leave one)."""
    kept: list[tuple[int, ...]] = []
    for c in sorted(counts, reverse=True):
        if not any(all(x >= y for x, y in zip(d, c)) for d in kept):
            kept.append(c)
    return tuple(sorted(kept))


def _held_counts(schedule: Schedule):
    """What the stages hold, from one walk over each rank's compute actions (a rank's list order is
    its time order, so no clock is needed): per stage the peak of forwards done minus ``B``/``I``
    done and of forwards done minus ``B``/``W`` done, per rank the peak of the first summed over its
    stages, and the count pairs and vectors of `Timeline.peak_held_w` and `Timeline.rank_held`.

    While an action runs, a stage holds the activations of the micro-batches forwarded and not yet
    through ``B`` or ``W`` (the running one's included) and the gradients an ``I`` recorded for a
    ``W`` still to come -- not the running action's own: an ``I`` records them inside its backward's
    workspace, and a ``W`` consumes them inside its own. A rank of several stages (interleaved
    chunks) holds each stage's count at once; the chunks peak at different times (the first in the
    warm-up, the last in the steady state), so its peak is below the sum of theirs."""
    n = schedule.num_stages
    stage_peak, stage_peak_w, rank_peak = [0] * n, [0] * n, [0] * schedule.num_ranks
    pairs: list[set[tuple[int, int]]] = [set() for _ in range(n)]
    rank_held = []
    for rank, acts in enumerate(schedule.actions):
        stages = schedule.stages_of(rank)
        live, live_w, pending = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0), dict.fromkeys(stages, 0)
        vectors: set[tuple[int, ...]] = set()
        for a in acts:
            s, kind = a.stage, a.kind
            if not kind.is_compute:
                continue
            if kind is Kind.F:
                live[s] += 1
                live_w[s] += 1
                stage_peak[s] = max(stage_peak[s], live[s])
                stage_peak_w[s] = max(stage_peak_w[s], live_w[s])
                rank_peak[rank] = max(rank_peak[rank], sum(live.values()))
            elif kind is Kind.W:
                pending[s] -= 1
            pairs[s].add((live_w[s], pending[s]))
            if len(stages) > 1:
                vectors.add(tuple(live_w[t] for t in stages))
            if kind is Kind.I:
                pending[s] += 1
            if kind in (Kind.B, Kind.I):
                live[s] -= 1
            if kind in (Kind.B, Kind.W):
                live_w[s] -= 1
        if len(stages) > 1:
            rank_held.append((stages, _undominated(vectors)))
    return (tuple(stage_peak), tuple(rank_peak), tuple(stage_peak_w), tuple(_undominated(p) for p in pairs),
            tuple(rank_held))
