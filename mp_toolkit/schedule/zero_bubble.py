"""ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1, the handcrafted
memory-efficient schedule), and ZB-drain, 1F1B that splits only the backwards its drain waits on.

The backward of a micro-batch is split in two: ``I`` computes the gradient with respect to
the stage's input — the upstream stage waits for it, so it stays on the critical path — and
``W`` the gradient with respect to the weights, which nothing downstream waits for. ZB-H1
runs 1F1B's order of forwards and input-gradients, and defers the ``W`` passes of stage ``s``
by ``s`` micro-batches so that they fill the bubbles 1F1B leaves at the end of the pipeline.

With ``T_F``, ``T_I``, ``T_W`` the per-stage times, 1F1B idles ``(p-1)(T_F + T_I + T_W)`` per
rank and ZB-H1 ``(p-1)(T_F + T_I - T_W)``: a third of 1F1B's when the three are equal.
Peak memory is that of 1F1B: stage ``s`` runs at most ``p-s`` forwards ahead of its
input-gradients (as 1F1B runs ahead of its backwards) and at most ``p`` ahead of its weight
gradients, 1F1B's peak on stage 0. Every stage runs F, I and W in ascending micro-batch
order, so weight gradients accumulate in single-process order.

A split is not free: ``I`` and ``W`` together run longer than the backward they replace (``W``
re-reads its operands after other work has evicted them from cache; `SPLIT_OVERHEAD` in the
planner), and ZB-H1 pays that on every micro-batch of every stage but the first. Its steady
state gains nothing from the deferral when the stages are balanced — every stage is busy either
way — so with two stages the whole gain is the drain: the last stage sends its final input
gradient before computing its weight gradient. ZB-drain (`zb_drain`) keeps exactly that: 1F1B's
order, with stage ``s`` splitting only its last ``s`` backwards and running their ``W`` after its
last ``I``. With two stages and ``F = I = W`` it idles 1F1B's bubble less one ``W`` (steps of
``3m+2`` against 1F1B's ``3m+3`` and ZB-H1's ``3m+1``) at one split instead of ``m``. ZB-H1 also
shortens the warm-up (its first backward wave runs I only), which is worth more with more stages or
unequal ones; the planner (`mp_toolkit.partition.auto_schedule`) weighs the two with the split's cost.
"""
from __future__ import annotations

import functools

from mp_toolkit.names import SCHEDULE_TITLES

from .actions import Action, Kind, Schedule
from .interleaved import insert_comms
from .vshape import dualpipev

__all__ = ["zbh1", "zb_drain", "split_share", "SPLIT_SCHEDULES"]

SPLIT_SCHEDULES = ("zbh1", "zbdrain", "zbv", "dualpipev")
"""The schedules (`run.config` names) that run backwards (all, or some) as ``I`` then ``W``."""


def zbh1(num_stages: int, microbatches: int) -> Schedule:
    """ZB-H1 with stage ``s`` on rank ``s``; comm actions as in :func:`insert_comms`
    (``RECV_B`` before ``I``, ``SEND_B`` right after it)."""
    return _one_stage_per_rank(SCHEDULE_TITLES["zbh1"], num_stages, microbatches, _stage_compute_order)


def zb_drain(num_stages: int, microbatches: int) -> Schedule:
    """1F1B in which stage ``s`` runs its last ``min(s, m)`` backwards as ``I`` (``SEND_B`` right
    after it) and their ``W`` after its last ``I``; comm actions as in :func:`insert_comms`.

    Weight gradients still accumulate in ascending micro-batch order (``B`` of the first ones,
    then the deferred ``W``). Activations for ``I``: 1F1B's (``min(p-s, m)`` micro-batches on
    stage ``s``); counting what the deferred ``W`` keep, stage ``s`` holds at most
    ``max(p-s, s)`` micro-batches' worth, never more than ZB-H1's ``p``.
    """
    return _one_stage_per_rank(SCHEDULE_TITLES["zbdrain"], num_stages, microbatches, _drain_compute_order)


def _one_stage_per_rank(name: str, p: int, m: int, compute_order) -> Schedule:
    """Stage ``s`` on rank ``s`` running ``compute_order(s, p, m)``, comm actions inserted."""
    if p < 1:
        raise ValueError(f"num_stages must be at least 1, got {p}")
    if m < 1:
        raise ValueError(f"microbatches must be at least 1, got {m}")
    compute = [compute_order(s, p, m) for s in range(p)]
    return Schedule(name, p, m, tuple(range(p)), insert_comms(tuple(range(p)), compute))


def split_share(schedule: str, stage: int, microbatches: int, pp: int = 1) -> float:
    """The share of stage ``stage``'s backwards that ``schedule`` (a `run.config` name, over ``pp``
    ranks) runs as ``I`` then ``W``: the engine then records what ``W`` needs, and a recomputed layer
    is rebuilt in each of the two. The first stage never splits (its input is token ids: ``I`` has
    nothing to compute, ``W`` runs the whole backward)."""
    if stage == 0 or schedule not in SPLIT_SCHEDULES:
        return 0.0
    if schedule in ("zbh1", "zbv"):
        return 1.0
    if schedule == "dualpipev":  # the last backwards of each rank, counted off the schedule
        return _dualpipev_shares(pp, microbatches)[stage]
    return min(stage, microbatches) / microbatches  # zbdrain


@functools.lru_cache(maxsize=64)
def _dualpipev_shares(pp: int, microbatches: int) -> tuple[float, ...]:
    """Per stage, the share of its backwards DualPipeV runs as I then W (a planner asks per stage and layer)."""
    splits = [0] * (2 * pp)
    for acts in dualpipev(pp, microbatches).actions:
        for a in acts:
            splits[a.stage] += a.kind is Kind.I
    return tuple(n / microbatches for n in splits)


def _drain_compute_order(stage: int, p: int, m: int) -> list[Action]:
    """F/B/I/W actions of one stage of `zb_drain`: 1F1B's order (``min(p-s-1, m)`` warm-up
    forwards, then one forward and one backward, then the backwards left), the last
    ``min(s, m)`` backwards as ``I``, and their ``W`` at the end."""
    num_warmup = min(p - stage - 1, m)
    first_split = m - min(stage, m)
    order = [Action(stage, Kind.F, k) for k in range(num_warmup)]
    for k in range(m):
        if num_warmup + k < m:
            order.append(Action(stage, Kind.F, num_warmup + k))
        order.append(Action(stage, Kind.B if k < first_split else Kind.I, k))
    return order + [Action(stage, Kind.W, k) for k in range(first_split, m)]


def _stage_compute_order(stage: int, p: int, m: int) -> list[Action]:
    """F/I/W actions of one stage, in the four phases of the paper's ZB-H1.

    * warm-up: ``p-s-1`` forwards, as in 1F1B;
    * F-I: ``s`` steps of one forward and one input-gradient, with ``W`` deferred — the
      deeper the stage, the later its first ``I`` arrives upstream, so the more ``W`` work it
      saves for the drain;
    * F-I-W: the remaining forwards, each with an ``I`` and the oldest deferred ``W``;
    * cool-down: the remaining ``I`` passes, each followed by a ``W``, then the ``s``
      deferred ``W`` passes fill the time the stage would idle in 1F1B's drain.

    Phases shrink when ``m`` is small (fewer forwards than the warm-up wants).
    """
    num_warmup = min(p - stage - 1, m)
    num_fi = min(stage, m - num_warmup)
    f = i = w = 0  # next forward / input-gradient / weight-gradient micro-batch

    def run(kind: Kind) -> Action:
        nonlocal f, i, w
        mb = {Kind.F: f, Kind.I: i, Kind.W: w}[kind]
        f, i, w = f + (kind is Kind.F), i + (kind is Kind.I), w + (kind is Kind.W)
        return Action(stage, kind, mb)

    order = [run(Kind.F) for _ in range(num_warmup)]
    for _ in range(num_fi):
        order += [run(Kind.F), run(Kind.I)]
    while f < m:
        order += [run(Kind.F), run(Kind.I), run(Kind.W)]
    while i < m:
        order += [run(Kind.I), run(Kind.W)]
    while w < m:
        order.append(run(Kind.W))
    return order
