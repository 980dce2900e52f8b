"""Schedule generators: GPipe and 1F1B (PipeDream-Flush), with comm actions inserted, and
the registry of every schedule by name (interleaved 1F1B, ZB-H1 and ZB-drain, ZB-V and DualPipeV live in their
own files).

Both put stage ``s`` on rank ``s``. With ``p`` stages, ``m`` micro-batches and equal forward
and backward cost per stage, both have bubble fraction ``(p-1)/(m+p-1)``; 1F1B holds at most
``min(p-s, m)`` micro-batches of activations on stage ``s`` instead of GPipe's ``m``.

Comm insertion rules for stage ``s`` of ``p`` (``last = p-1``), see ``actions`` for semantics:
``sRECV_F k`` before ``sF k`` (s > 0), ``sSEND_F k`` after it (s < last); ``sRECV_B k`` before
``sB k`` (s < last), ``sSEND_B k`` after it (s > 0).

Forwards and backwards run in ascending micro-batch order on every stage, so gradients
accumulate in the same order as single-process gradient accumulation.
"""
from __future__ import annotations

from typing import Callable

from mp_toolkit.names import SCHEDULE_TITLES, SCHEDULES, V_SCHEDULES, schedule_name, stages_per_rank

from .actions import Action, Kind, Schedule
from .interleaved import interleaved_1f1b
from .vshape import dualpipev, v_placement, zbv
from .zero_bubble import zb_drain, zbh1

__all__ = ["gpipe", "one_f_one_b", "get_schedule", "placement", "GENERATORS"]


def _forward(stage: int, mb: int, num_stages: int) -> list[Action]:
    """``[RECV_F] F [SEND_F]`` for one micro-batch on one stage."""
    acts = []
    if stage > 0:
        acts.append(Action(stage, Kind.RECV_F, mb))
    acts.append(Action(stage, Kind.F, mb))
    if stage < num_stages - 1:
        acts.append(Action(stage, Kind.SEND_F, mb))
    return acts


def _backward(stage: int, mb: int, num_stages: int) -> list[Action]:
    """``[RECV_B] B [SEND_B]`` for one micro-batch on one stage."""
    acts = []
    if stage < num_stages - 1:
        acts.append(Action(stage, Kind.RECV_B, mb))
    acts.append(Action(stage, Kind.B, mb))
    if stage > 0:
        acts.append(Action(stage, Kind.SEND_B, mb))
    return acts


def _check_sizes(num_stages: int, microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1, got {microbatches}")


def gpipe(num_stages: int, microbatches: int) -> Schedule:
    """GPipe: all forwards, then all backwards (Huang et al. 2019, "GPipe: Efficient
    Training of Giant Neural Networks using Pipeline Parallelism").

    Bubble fraction ``(p-1)/(m+p-1)``; every stage keeps the activations of all ``m``
    micro-batches alive until its first backward. Backwards run in ascending micro-batch
    order (as torch's ``ScheduleGPipe`` does) so accumulation order matches one process.
    """
    _check_sizes(num_stages, microbatches)
    per_rank = []
    for s in range(num_stages):
        acts: list[Action] = []
        for k in range(microbatches):
            acts += _forward(s, k, num_stages)
        for k in range(microbatches):
            acts += _backward(s, k, num_stages)
        per_rank.append(tuple(acts))
    stage_to_rank = tuple(range(num_stages))
    return Schedule(SCHEDULE_TITLES["gpipe"], num_stages, microbatches, stage_to_rank, tuple(per_rank))


def one_f_one_b(num_stages: int, microbatches: int) -> Schedule:
    """1F1B, the PipeDream-Flush schedule (Narayanan et al. 2021, "Memory-Efficient
    Pipeline-Parallel DNN Training"), written in picotron's three phases.

    Bubble fraction ``(p-1)/(m+p-1)``, the same as GPipe, but stage ``s`` holds at most
    ``min(p-s, m)`` micro-batches of activations.
    """
    _check_sizes(num_stages, microbatches)
    per_rank = [
        tuple(_one_f_one_b_stage(s, num_stages, microbatches)) for s in range(num_stages)
    ]
    stage_to_rank = tuple(range(num_stages))
    return Schedule(SCHEDULE_TITLES["1f1b"], num_stages, microbatches, stage_to_rank, tuple(per_rank))


def _one_f_one_b_stage(stage: int, p: int, m: int) -> list[Action]:
    """Actions of one stage of 1F1B.

    * warm-up: ``min(p-s-1, m)`` forwards fill the pipe below this stage;
    * steady: the remaining forwards, each followed by the backward of the oldest in-flight
      micro-batch. ``SEND_F k`` is immediately followed by ``RECV_B j`` (Megatron's
      ``send_forward_recv_backward``) and ``SEND_B j`` by the next ``RECV_F`` (its
      ``send_backward_recv_forward``), so the executor can batch each pair;
    * cool-down: the backwards of the micro-batches still in flight.
    """
    num_warmup = min(p - stage - 1, m)
    num_steady = m - num_warmup
    acts: list[Action] = []
    for k in range(num_warmup):
        acts += _forward(stage, k, p)
    for j in range(num_steady):
        acts += _forward(stage, num_warmup + j, p)
        acts += _backward(stage, j, p)
    for j in range(num_steady, m):
        acts += _backward(stage, j, p)
    return acts


GENERATORS: dict[str, Callable[..., Schedule]] = dict(
    zip(SCHEDULES, (gpipe, one_f_one_b, interleaved_1f1b, zb_drain, zbh1, zbv, dualpipev), strict=True))
"""Each schedule's generator, in `SCHEDULES`' order; each takes ``(num_stages, microbatches)``."""


def get_schedule(name: str, num_stages: int, microbatches: int, *, chunks: int | None = None) -> Schedule:
    """Build a schedule by torch's name (case-insensitive): ``GPipe``, ``1F1B``,
    ``Interleaved1F1B`` (alias ``interleaved``), ``ZBH1``, ``ZBDrain``, ``ZBVZeroBubble`` (alias ``zbv``)
    or ``DualPipeV``.

    ``num_stages`` is the pipeline degree ``p`` (ranks). For ``Interleaved1F1B`` each rank
    holds ``chunks`` (default 2) model chunks, so the Schedule has ``p * chunks`` stages with
    stage ``s`` on rank ``s % p``; the V schedules have ``2p`` stages, rank ``r`` holding ``r`` and
    ``2p-1-r``, and accept ``chunks`` of None or 2; every other schedule has ``p`` stages, one per
    rank, and accepts only ``chunks`` of None or 1.
    """
    key = schedule_name(name)
    if key is None:
        choices = ", ".join(SCHEDULE_TITLES.values())
        raise ValueError(f"unknown pipeline schedule {name!r}: choose one of {choices}")
    generator = GENERATORS[key]
    if key == "interleaved":
        return generator(num_stages, microbatches, stages_per_rank(key, chunks))
    if chunks not in (None, stages_per_rank(key)):
        held = "two stages per rank in a V" if key in V_SCHEDULES else "one stage per rank"
        raise ValueError(
            f"--chunks {chunks} applies only to Interleaved1F1B; {SCHEDULE_TITLES[key]} runs {held} "
            f"(drop --chunks or use --schedule interleaved)"
        )
    return generator(num_stages, microbatches)


def placement(name: str, num_ranks: int, chunks: int | None = None) -> tuple[int, ...]:
    """``stage -> rank`` of schedule ``name`` (a `SCHEDULES` name) over ``num_ranks`` ranks, without
    generating its actions: the V for the V schedules (`v_placement`), else stage ``s`` on rank
    ``s % num_ranks`` over ``num_ranks x stages_per_rank(name, chunks)`` stages. The same map as
    ``get_schedule(...).stage_to_rank``, for the planner's floors and the benches."""
    if name in V_SCHEDULES:
        return v_placement(num_ranks)
    return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank(name, chunks)))
