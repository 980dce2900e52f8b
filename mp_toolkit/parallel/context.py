"""The rank grid: which pipeline stage, tensor shard, context slice and data replica this process is.

Axis order (fixed, validated): **tp varies fastest, then cp, then dp, then pp**, as in Megatron-LM::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so tensor-parallel peers are neighbouring ranks (one node in practice), context-parallel peers next,
and pipeline stages are the slowest axis. The cp ranks of a replica read the same micro-batches (each
keeps its slice of every sequence, `mp_toolkit.parallel.context_parallel`) and hold the same
parameters: their gradients are averaged with the data-parallel replicas' over ``grad_group``
(dp x cp ranks, Megatron's data-parallel group with context parallelism). A `ParallelContext` is
frozen and passed as an argument; nothing here is global. Groups of size 1 are kept as ``None`` so
callers skip communication (STYLE.md 9).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


class GridError(ValueError):
    """A (pp, tp, dp) grid that does not fit the world."""


def grid_coords(rank: int, pp: int, tp: int, dp: int, cp: int = 1) -> tuple[int, int, int]:
    """(pp_rank, tp_rank, dp_rank) of ``rank`` under the tp-fastest order (its cp_rank: `cp_coord`)."""
    return rank // (tp * cp * dp), rank % tp, (rank // (tp * cp)) % dp


def cp_coord(rank: int, tp: int, cp: int) -> int:
    """The cp_rank of ``rank``."""
    return (rank // tp) % cp


def grid_rank(pp_rank: int, tp_rank: int, dp_rank: int, tp: int, dp: int, cp_rank: int = 0, cp: int = 1) -> int:
    """Inverse of `grid_coords` and `cp_coord`."""
    return tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))


def check_grid(world_size: int, pp: int, tp: int = 1, dp: int = 1, cp: int = 1) -> None:
    """Raise GridError with a readable message when pp*tp*cp*dp != world_size."""
    for name, value in (("pp", pp), ("tp", tp), ("dp", dp), ("cp", cp)):
        if not isinstance(value, int) or value < 1:
            raise GridError(f"--{name} {value!r} is not a positive integer")
    if pp * tp * cp * dp != world_size:
        what, n = (("pp*tp*dp", f"{pp}*{tp}*{dp}") if cp == 1 else ("pp*tp*cp*dp", f"{pp}*{tp}*{cp}*{dp}"))
        size = pp * tp * cp * dp
        raise GridError(f"{what} = {n} = {size} does not match the world size {world_size}:"
                        f" launch {size} processes or change the degrees")


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in the (pp, tp, dp) grid, with its process groups.

    Fields:
        rank, world_size: global rank and number of processes.
        pp, tp, dp, cp: pipeline, tensor, data and context parallel degrees (product == world_size).
        pp_rank, tp_rank, dp_rank, cp_rank: this rank's coordinates.
        device: where this rank computes (cuda:LOCAL_RANK under NCCL, else cpu).
        pp_group, tp_group, dp_group, cp_group: process groups along each axis, None when of size 1.
        grad_group: the dp x cp ranks holding the same parameters, over which gradients are averaged
            (the dp group when cp == 1). None when of size 1.
        model_group: every rank that holds a different part of one model replica (pp x tp);
            overflow and clipping decisions are agreed over it. None when of size 1.
    """

    rank: int = 0
    world_size: int = 1
    pp: int = 1
    tp: int = 1
    dp: int = 1
    pp_rank: int = 0
    tp_rank: int = 0
    dp_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    pp_group: Any = None
    tp_group: Any = None
    dp_group: Any = None
    model_group: Any = None
    cp: int = 1
    cp_rank: int = 0
    cp_group: Any = None
    grad_group: Any = None

    @property
    def grad_size(self) -> int:
        """Ranks holding the same parameters: dp x cp."""
        return self.dp * self.cp

    @property
    def grad_rank(self) -> int:
        """This rank's place in `grad_group` (ordered by dp_rank, then cp_rank, as global ranks are)."""
        return self.cp_rank + self.cp * self.dp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank holding pipeline stage ``pp_rank`` with this rank's tp/dp coordinates."""
        return grid_rank(pp_rank, self.tp_rank, self.dp_rank, self.tp, self.dp, self.cp_rank, self.cp)

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first_stage else self.stage_rank(self.pp_rank - 1)

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.stage_rank(self.pp_rank + 1)

    @property
    def pp_ranks(self) -> tuple[int, ...]:
        """Global ranks of every stage of this rank's pipeline, in stage order."""
        return tuple(self.stage_rank(s) for s in range(self.pp))


def _axis_groups(pp: int, tp: int, dp: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """All rank lists along each axis; every rank must create every group (torch requires it)."""
    ranks = range(pp * tp * cp * dp)
    by = {"pp": {}, "tp": {}, "dp": {}, "model": {}, "cp": {}, "grad": {}}
    for r in ranks:
        p, t, d = grid_coords(r, pp, tp, dp, cp)
        c = cp_coord(r, tp, cp)
        by["pp"].setdefault((t, c, d), []).append(r)
        by["tp"].setdefault((p, c, d), []).append(r)
        by["dp"].setdefault((p, t, c), []).append(r)
        by["model"].setdefault((c, d), []).append(r)
        by["cp"].setdefault((p, t, d), []).append(r)
        by["grad"].setdefault((p, t), []).append(r)
    if cp == 1:  # the same ranks as the dp groups: one group, not two
        del by["cp"], by["grad"]
    return {axis: list(groups.values()) for axis, groups in by.items()}


def build_context(pp: int, tp: int = 1, dp: int = 1, device: torch.device | None = None,
                  cp: int = 1) -> ParallelContext:
    """Build the context of this process from an initialised default process group.

    Without an initialised group (plain single-process use) it returns the 1x1x1 context.
    """
    if not dist.is_available() or not dist.is_initialized():
        check_grid(1, pp, tp, dp, cp)
        return ParallelContext(device=device or torch.device("cpu"))
    world, rank = dist.get_world_size(), dist.get_rank()
    check_grid(world, pp, tp, dp, cp)
    mine: dict[str, Any] = {}
    for axis, groups in _axis_groups(pp, tp, dp, cp).items():
        for ranks in groups:
            # new_group is collective over the whole world, even for groups this rank is not in.
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine[axis] = group
    pp_rank, tp_rank, dp_rank = grid_coords(rank, pp, tp, dp, cp)
    return ParallelContext(
        rank=rank, world_size=world, pp=pp, tp=tp, dp=dp,
        pp_rank=pp_rank, tp_rank=tp_rank, dp_rank=dp_rank,
        device=device or torch.device("cpu"),
        pp_group=mine["pp"], tp_group=mine["tp"], dp_group=mine["dp"], model_group=mine["model"],
        cp=cp, cp_rank=cp_coord(rank, tp, cp), cp_group=mine.get("cp"),
        grad_group=mine.get("grad", mine["dp"]),
    )
