"""Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", section 2.2.2), and the comm insertion it shares with ZB-H1.

Each of the ``p`` ranks holds ``v`` model chunks: the model is cut into ``p*v`` stages and
stage ``s`` runs on rank ``s % p`` (Megatron's virtual pipeline: rank ``r`` holds chunks
``r, r+p, r+2p, ...``). A micro-batch visits every rank ``v`` times, so each pipeline fill
and drain costs a chunk's time instead of a whole rank's. With equal stages the bubble
fraction is ``(p-1)/(v*m + p-1)`` — ``v`` times smaller than 1F1B's ``(p-1)/(m+p-1)`` — in
exchange for ``v`` times more point-to-point messages.

Megatron's order (``get_model_chunk_id``): a rank runs its ``m*v`` chunk micro-batches in
groups of ``p`` micro-batches; forwards go chunk 0, 1, ..., v-1 through a group, backwards go
chunk v-1, ..., 0. So every stage sees micro-batches in ascending order, forward and backward,
and gradients accumulate in the same order as one process.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

from mp_toolkit.names import SCHEDULE_TITLES

from .actions import Action, Kind, Schedule

__all__ = ["interleaved_1f1b", "insert_comms"]


def interleaved_1f1b(num_ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B over ``num_ranks`` ranks with ``chunks`` chunks each.

    Returns a Schedule with ``num_ranks * chunks`` stages, stage ``s`` on rank
    ``s % num_ranks``. Megatron needs the micro-batch count to be a multiple of the pipeline
    degree when ``v > 1`` (micro-batches move in groups of ``p``); ``v == 1`` is plain 1F1B
    and takes any ``m``. Bubble ``(p-1)/(v*m + p-1)``; rank ``r`` holds at most
    ``2*(p-r-1) + (v-1)*p + 1`` chunk micro-batches of activations (capped at ``m*v``): with a
    chunk being 1/v of the rank's layers, rank 0 holds ``p + (p-1)/v`` rank-shares, against
    1F1B's ``p`` (Megatron's and torch's order; ``_rank_compute_order`` says why).
    """
    p, m, v = num_ranks, microbatches, chunks
    for value, what in ((p, "num_ranks (--pp)"), (m, "microbatches"), (v, "chunks")):
        if value < 1:
            raise ValueError(f"interleaved 1F1B needs {what} >= 1, got {value}")
    if v > 1 and m % p != 0:
        raise ValueError(
            f"interleaved 1F1B needs --microbatches a multiple of --pp (got m={m}, p={p}); "
            f"try m={(m // p + 1) * p}"
        )
    stage_to_rank = tuple(s % p for s in range(p * v))
    compute = [_rank_compute_order(r, p, m, v) for r in range(p)]
    actions = insert_comms(stage_to_rank, compute)
    return Schedule(SCHEDULE_TITLES["interleaved"], p * v, m, stage_to_rank, actions)


def _chunk_microbatch(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """The (chunk, micro-batch) of a rank's ``k``-th forward or backward.

    Megatron's ``get_model_chunk_id``: within each group of ``p*v`` steps, ``p`` micro-batches
    go through chunk 0, then 1, ...; backwards take the chunks in reverse."""
    group, in_group = divmod(k, p * v)
    chunk = in_group // p
    if not forward:
        chunk = v - 1 - chunk
    return chunk, group * p + in_group % p


def _rank_compute_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    """The F/B actions of one rank, in three phases (1F1B when ``v == 1``).

    * warm-up: ``2*(p-rank-1) + (v-1)*p`` forwards (capped at ``m*v``; 1F1B's ``p-rank-1`` when
      ``v == 1``), Megatron's and torch's count. The first ``(v-1)*p`` push a whole group of
      micro-batches through the first ``v-1`` chunks; the rest fill the pipe below this rank.
      With equal chunks and async sends ``(p-rank-1) + (v-1)*p`` would give the same bubble with
      one chunk micro-batch less in flight per stage of depth below; with unequal ones (a chunk
      that holds the LM head) the extra forwards are the slack that keeps a rank from waiting
      on its neighbour (issue-8 workload, this machine's layer times, simulated: 1,684 ms against
      1,766 ms a step);
    * steady: each remaining forward is followed by the oldest backward (one F, one B);
    * cool-down: the backwards still in flight.
    """
    total = m * v
    num_warmup = min((p - rank - 1) * (2 if v > 1 else 1) + (v - 1) * p, total)

    def act(k: int, kind: Kind) -> Action:
        chunk, mb = _chunk_microbatch(k, p, v, forward=kind is Kind.F)
        return Action(chunk * p + rank, kind, mb)

    order = [act(k, Kind.F) for k in range(num_warmup)]
    for k in range(total - num_warmup):
        order += [act(num_warmup + k, Kind.F), act(k, Kind.B)]
    order += [act(k, Kind.B) for k in range(total - num_warmup, total)]
    return order


def insert_comms(
    stage_to_rank: Sequence[int], compute: Sequence[Sequence[Action]]
) -> tuple[tuple[Action, ...], ...]:
    """Add SEND/RECV actions to per-rank compute orders (F, B, I, W only).

    A send goes right after the compute that produces it (``SEND_F`` after ``F``,
    ``SEND_B`` after ``B`` or ``I``: the input gradient is ready then); a receive goes as
    late as possible, right before the compute that needs it. Messages on a (src, dst)
    link are matched in FIFO order, so when a compute needs a message that was sent after
    others not yet received on that link, those earlier ones are received first — they were
    posted before the needed one, so this never adds a wait. Stages on one rank talk locally.
    """
    num_stages = len(stage_to_rank)
    owner = stage_to_rank

    def send_of(a: Action) -> Action | None:
        if a.kind is Kind.F and a.stage < num_stages - 1 and owner[a.stage + 1] != owner[a.stage]:
            return Action(a.stage, Kind.SEND_F, a.microbatch)
        if a.kind in (Kind.B, Kind.I) and a.stage > 0 and owner[a.stage - 1] != owner[a.stage]:
            return Action(a.stage, Kind.SEND_B, a.microbatch)
        return None

    # Receives each link will deliver, in the order the sender posts them.
    pending: dict[tuple[int, int], deque[Action]] = {}
    for rank, acts in enumerate(compute):
        for a in acts:
            send = send_of(a)
            if send is not None:
                pending.setdefault((rank, owner[send.peer_stage]), deque()).append(send.matching())

    out = []
    for rank, acts in enumerate(compute):
        row: list[Action] = []
        received: set[Action] = set()  # the receives already in ``row`` (a set: rows hold thousands)
        for a in acts:
            need = _needed_receive(a, owner, num_stages)
            if need is not None and need not in received:
                fifo = pending[(owner[need.peer_stage], rank)]
                while True:  # receive everything posted before `need` on this link
                    got = fifo.popleft()
                    row.append(got)
                    received.add(got)
                    if got == need:
                        break
            row.append(a)
            send = send_of(a)
            if send is not None:
                row.append(send)
        out.append(tuple(row))
    return tuple(out)


def _needed_receive(a: Action, owner: Sequence[int], num_stages: int) -> Action | None:
    """The receive a compute action waits for, if its input comes from another rank."""
    s, k = a.stage, a.microbatch
    if a.kind is Kind.F and s > 0 and owner[s - 1] != owner[s]:
        return Action(s, Kind.RECV_F, k)
    if a.kind in (Kind.B, Kind.I) and s < num_stages - 1 and owner[s + 1] != owner[s]:
        return Action(s, Kind.RECV_B, k)
    return None
