"""V-shape schedules: ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", section 6)
and DualPipeV (DeepSeek-V3's DualPipe, Liu et al. 2024, cut in half).

Both cut the model into ``2p`` stages and place them in a V (`v_placement`): rank ``r`` holds stage
``r`` on the way down and stage ``2p-1-r`` on the way back, so rank ``p-1`` hands its first stage's
output to its second locally, and rank 0 holds both the embedding and the LM head (a tied embedding
is one local weight, no cross-stage all-reduce). A micro-batch's forward visits each rank twice and
its backward twice, in opposite directions: every rank has work at both ends of the pipeline, which
is what lets these schedules fill the fill and drain.

Each rank's list is written in phases (below) as compute actions; `insert_comms` adds the messages.
Every stage runs its forwards, and its weight gradients (``B`` or ``W``), in ascending micro-batch
order, so gradients accumulate in single-process order (the oracle holds bitwise, as for ZB-H1).

Memory, in one stage's (half a rank's layers) micro-batches of activations: 1F1B's rank 0 holds
``p`` whole-rank micro-batches = ``2p`` stage micro-batches; ZB-V's rank 0 holds at most ``2p`` too
(the controllable-memory paper's point: zero bubble at 1F1B's activation memory); DualPipeV ``2p+1``
(its README: PP+1, in rank-shares).
"""
from __future__ import annotations

from collections import deque

from mp_toolkit.names import SCHEDULE_TITLES

from .actions import Action, Kind, Schedule
from .interleaved import insert_comms

__all__ = ["v_placement", "zbv", "dualpipev"]


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """``stage -> rank`` of the V: stages ``0..p-1`` on ranks ``0..p-1``, stages ``p..2p-1`` back on
    ranks ``p-1..0``."""
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


class _Counter:
    """A rank's next micro-batch per (stage, kind), and the I passes whose W is still to run."""

    def __init__(self):
        self.next: dict[tuple[int, Kind], int] = {}
        self.pending_w: deque[tuple[int, int]] = deque()
        self.order: list[Action] = []

    def run(self, stage: int, kind: Kind) -> None:
        """The stage's next ``kind`` (a ``B`` or ``I`` counts as its backward; an ``I`` queues its W)."""
        key = (stage, Kind.I if kind is Kind.B else kind)
        mb = self.next.get(key, 0)
        self.next[key] = mb + 1
        self.order.append(Action(stage, kind, mb))
        if kind is Kind.I:
            self.pending_w.append((stage, mb))

    def weight(self, stage: int | None = None) -> None:
        """The oldest deferred W (of ``stage``, or of either): a stage's W passes run in the order of its
        I passes. None left: nothing."""
        found = next((sm for sm in self.pending_w if stage is None or sm[0] == stage), None)
        if found is not None:
            self.pending_w.remove(found)
            self.order.append(Action(found[0], Kind.W, found[1]))

    def count(self, stage: int, kind: Kind) -> int:
        return self.next.get((stage, kind), 0)


def _check(name: str, p: int, m: int, least: int) -> None:
    if p < 1:
        raise ValueError(f"{name} needs num_ranks (--pp) >= 1, got {p}")
    if m < least:
        raise ValueError(f"{name} needs --microbatches >= {least} at --pp {p} (2 stages per rank in a V), "
                         f"got {m}")


def zbv(num_ranks: int, microbatches: int) -> Schedule:
    """ZB-V over ``num_ranks`` ranks, two stages each in the V placement; backwards split into I and W.

    Rank ``r`` with its down stage ``x = r`` and its up stage ``y = 2p-1-r``:

    * warm-up: ``2(p-r)-1`` forwards of ``x``; then ``r`` pairs ``F(y) F(x)``; then ``p-r`` triples
      ``F(y) I(y) W(y)`` -- the up stage's first backwards run as soon as the micro-batch turns;
    * steady: ``F(x) I(x) W(x) F(y) I(y) W(y)`` (``F(x)`` while micro-batches remain);
    * cool-down: ``r`` pairs ``I(x) I(y)`` with their W deferred, ``p-r`` pairs ``I(x) W``, then the
      deferred W passes fill the drain.

    With equal per-stage ``F = I = W`` and ``m >= 2p`` a rank idles only the ``p-1`` forwards the first
    micro-batch takes to reach it and come back: step ``6m + p - 1`` against 1F1B's ``6(m + p - 1)`` of
    the same model, at 1F1B's activation memory (``2p`` stage micro-batches on every rank; the paper's
    "zero bubble at 1F1B's memory"; `tests/test_vshape.py` holds the simulated golden cases). Fewer than
    ``2p-1`` micro-batches: the phases are written for ``2p-1`` and the actions of the micro-batches
    that do not exist are left out (every dependency is within a micro-batch, so what remains is still
    complete and ordered).
    """
    p, m = num_ranks, microbatches
    _check("ZB-V", p, m, 1)
    n = max(m, 2 * p - 1)
    compute = []
    for r in range(p):
        x, y = r, 2 * p - 1 - r
        c = _Counter()
        for _ in range(2 * (p - r) - 1):
            c.run(x, Kind.F)
        for _ in range(r):
            c.run(y, Kind.F)
            c.run(x, Kind.F)
        for _ in range(p - r):
            c.run(y, Kind.F)
            c.run(y, Kind.I)
            c.weight()
        while c.count(y, Kind.F) < c.count(x, Kind.F) or c.count(x, Kind.F) < n:
            if c.count(x, Kind.F) < n:
                c.run(x, Kind.F)
            c.run(x, Kind.I)
            c.weight()
            c.run(y, Kind.F)
            c.run(y, Kind.I)
            c.weight()
        for _ in range(r):
            c.run(x, Kind.I)
            c.run(y, Kind.I)
        for _ in range(p - r):
            c.run(x, Kind.I)
            c.weight(x)
        for stage in (y, x):  # the deferred W left: the up stage's, then the down stage's
            while any(s == stage for s, _ in c.pending_w):
                c.weight(stage)
        compute.append([a for a in c.order if a.microbatch < m])
    placement = v_placement(p)
    return Schedule(SCHEDULE_TITLES["zbv"], 2 * p, m, placement, insert_comms(placement, compute))


def dualpipev(num_ranks: int, microbatches: int) -> Schedule:
    """DualPipeV over ``num_ranks`` ranks, two stages each in the V placement; needs ``m >= 2p``.

    Rank ``r`` with its down stage ``x = r`` and its up stage ``y = 2p-1-r``, in DualPipe's eight steps:

    1. ``2(p-r-1)`` forwards of ``x``;
    2. ``r+1`` pairs ``F(x) F(y)``;
    3. ``p-r-1`` triples ``I(y) W(y) F(y)`` (zero-bubble backwards while the pipe fills);
    4. ``m-2p+r+1`` times ``F(x) B(y)`` then ``F(y) B(x)``: DualPipe overlaps each forward with a
       backward of the other stage (on a GPU their communication hides behind the other's compute; here
       they run one after the other);
    5. ``p-r-1`` times ``B(y)`` then ``F(y) B(x)``;
    6. ``r+1`` pairs of backwards ``y, x``, from the middle pair on split into I (W deferred);
    7. ``p-r-1`` times a deferred W then ``I(x)``;
    8. the ``r+1`` deferred W passes left.

    Bubble (DualPipe's README, with ``F``, ``B``, ``W`` per stage and ``F&B`` an overlapped pair):
    ``(p-1)(F&B + B - 3W)`` per rank; activations ``2p+1`` stage micro-batches on rank 0.
    """
    p, m = num_ranks, microbatches
    _check("DualPipeV", p, m, 2 * p)
    compute = []
    for r in range(p):
        x, y = r, 2 * p - 1 - r
        c = _Counter()
        for _ in range(2 * (p - r - 1)):
            c.run(x, Kind.F)
        for _ in range(r + 1):
            c.run(x, Kind.F)
            c.run(y, Kind.F)
        for _ in range(p - r - 1):
            c.run(y, Kind.I)
            c.weight()
            c.run(y, Kind.F)
        for _ in range(m - 2 * p + r + 1):
            c.run(x, Kind.F)
            c.run(y, Kind.B)
            c.run(y, Kind.F)
            c.run(x, Kind.B)
        for _ in range(p - r - 1):
            c.run(y, Kind.B)
            c.run(y, Kind.F)
            c.run(x, Kind.B)
        split = False
        for i in range(r + 1):  # the split starts at the middle pair: before y's on odd ranks, x's on even
            split |= i == (r + 1) // 2 and r % 2 == 1
            c.run(y, Kind.I if split else Kind.B)
            split |= i == (r + 1) // 2 and r % 2 == 0
            c.run(x, Kind.I if split else Kind.B)
        for _ in range(p - r - 1):
            c.weight()
            c.run(x, Kind.I)
        for _ in range(r + 1):
            c.weight()
        compute.append(c.order)
    placement = v_placement(p)
    return Schedule(SCHEDULE_TITLES["dualpipev"], 2 * p, m, placement, insert_comms(placement, compute))
