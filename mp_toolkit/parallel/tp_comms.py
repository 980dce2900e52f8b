"""The communication regions of tensor parallelism (Megatron-LM, Shoeybi et al. 2019, section 3).

Each region is an ``autograd.Function`` pairing a forward collective with its adjoint backward:

================================  =================  ==================
region                            forward            backward
================================  =================  ==================
copy_to (paper's ``f``)           identity           all-reduce
reduce_from (paper's ``g``)       all-reduce         identity
gather_from                       all-gather, dim -1 split, keep own
scatter_to                        split, keep own    all-gather, dim -1
================================  =================  ==================

A column-parallel linear opens with ``f`` (its input is replicated, so the partial input
gradients of every shard must be summed) and a row-parallel linear closes with ``g`` (every rank
holds a partial product that must be summed). An MLP or attention block therefore costs one
all-reduce forward and one backward.

The tensor-parallel group is always an argument (STYLE.md 3). ``group=None`` (tp == 1) makes every
region the identity with no communication (STYLE.md 9), so the same layer code runs on one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Number of ranks in ``group``; 1 for ``None``."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank inside ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def all_reduce(t: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """Out-of-place all-reduce (``op`` "sum" or "max"); the input is never modified."""
    out = t.contiguous().clone()
    if group_size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return out


def all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's copy of ``t`` (same shape on each rank), in group-rank order."""
    t = t.contiguous()
    if group_size(group) == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(group_size(group))]
    dist.all_gather(parts, t, group=group)
    return parts


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of the last dim: (..., H) -> (..., H / tp)."""
    n = group_size(group)
    if x.shape[-1] % n != 0:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by the tensor-parallel size {n}")
    return x.chunk(n, dim=-1)[group_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's slice along the last dim: (..., H / tp) -> (..., H)."""
    return torch.cat(all_gather(x, group), dim=-1)


class _CopyToRegion(torch.autograd.Function):
    """Megatron's ``f`` operator: identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)  # a new autograd node; the data is shared, nothing is copied

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron's ``g`` operator: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along the last dim forward; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    """Split along the last dim and keep this rank's slice forward; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """``f``: pass a replicated input into a sharded computation."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """``g``: sum the partial results of every shard into a replicated output."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """(..., H / tp) on each rank -> (..., H) on every rank."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """(..., H) replicated -> (..., H / tp), rank r keeping slice r."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group)


__all__ = [
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region",
    "all_reduce", "all_gather", "group_size", "group_rank",
]
