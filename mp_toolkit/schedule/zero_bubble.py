"""ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1, the handcrafted
memory-efficient schedule).

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
"""
from __future__ import annotations

from .actions import Action, Kind, Schedule
from .interleaved import insert_comms

__all__ = ["zbh1"]


def zbh1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 with stage ``s`` on rank ``s``; comm actions as in :func:`insert_comms`
    (``RECV_B`` before ``I``, ``SEND_B`` right after it)."""
    p, m = num_stages, num_microbatches
    if p < 1:
        raise ValueError(f"num_stages must be at least 1, got {p}")
    if m < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {m}")
    compute = [_stage_compute_order(s, p, m) for s in range(p)]
    actions = insert_comms(tuple(range(p)), compute)
    return Schedule("ZBH1", p, m, tuple(range(p)), actions)


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
