"""The communication regions of tensor parallelism (Megatron-LM, Shoeybi et al. 2019, section 3).

Each region is an ``autograd.Function`` pairing a forward collective with its adjoint backward:

================================  =================  ==================
region                            forward            backward
================================  =================  ==================
copy_to (paper's ``f``)           identity           all-reduce
reduce_from (paper's ``g``)       all-reduce         identity
gather_from                       all-gather, dim -1 split, keep own
scatter_to                        split, keep own    all-gather, dim -1
gather_sequence                   all-gather, dim 1  reduce-scatter, dim 1
gather_sequence (whole grads)     all-gather, dim 1  split, keep own
reduce_scatter_sequence           reduce-scatter, 1  all-gather, dim 1
scatter_sequence                  split, keep own    all-gather, dim 1
================================  =================  ==================

A column-parallel linear opens with ``f`` (its input is replicated, so the partial input
gradients of every shard must be summed) and a row-parallel linear closes with ``g`` (every rank
holds a partial product that must be summed). An MLP or attention block therefore costs one
all-reduce forward and one backward.

The last four are sequence parallelism's (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4.2.2): between the column/row pairs each rank
holds ``T / tp`` of the sequence (dim 1 of a batch-first (B, T, ...) tensor), an all-gather opens
a column-parallel region instead of ``f`` and a reduce-scatter closes a row-parallel one instead
of ``g`` -- the same bytes as the all-reduce they replace. ``gather_sequence`` reduce-scatters the
gradient where the region's input gradient is a partial sum (column-parallel consumers); with
``whole_grad=True`` it keeps its slice of a gradient every rank already holds whole (a replicated
consumer, such as BERT's heads).

The tensor-parallel group is always an argument (STYLE.md 3). ``group=None`` (tp == 1) makes every
region the identity with no communication (STYLE.md 9), so the same layer code runs on one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


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


def _split_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of dim 1: (B, T, ...) -> (B, T / tp, ...)."""
    n = group_size(group)
    if x.shape[1] % n != 0:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the tensor-parallel size {n}: "
                         "sequence parallelism splits every micro-batch's tokens evenly over the tp ranks")
    return x.chunk(n, dim=1)[group_rank(group)].contiguous()


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's slice along dim 1: (B, T / tp, ...) -> (B, T, ...)."""
    return torch.cat(all_gather(x, group), dim=1)


def _reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group and keep this rank's slice of dim 1, in one collective."""
    n = group_size(group)
    if x.shape[1] % n != 0:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the tensor-parallel size {n}")
    parts = [c.contiguous() for c in x.chunk(n, dim=1)]
    out = torch.empty_like(parts[group_rank(group)])
    dist.reduce_scatter(out, parts, group=group)
    return out


def region_function(name: str, forward, backward, doc: str) -> type:
    """An ``autograd.Function`` applying ``forward(x, group)`` to its input and ``backward(grad, group)``
    to its gradient: each region of the module docstring's table is one pair."""
    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd),
                                                   "__doc__": doc})


_CopyToRegion = region_function("_CopyToRegion", lambda x, group: x.view_as(x), all_reduce,
                        "Megatron's ``f``: identity forward (a new autograd node sharing the data), all-reduce "
                        "(sum) of the gradient backward.")
_ReduceFromRegion = region_function("_ReduceFromRegion", all_reduce, lambda grad, group: grad,
                            "Megatron's ``g``: all-reduce (sum) forward, identity backward.")
_GatherFromRegion = region_function("_GatherFromRegion", _gather_last, _split_last,
                            "All-gather along the last dim forward; backward keeps this rank's slice of the gradient.")
_ScatterToRegion = region_function("_ScatterToRegion", _split_last, _gather_last,
                           "Keep this rank's slice of the last dim forward; backward all-gathers the gradient.")
_GatherSequence = region_function("_GatherSequence", _gather_sequence, _reduce_scatter_sequence,
                          "All-gather dim 1 forward; backward reduce-scatters the (partial) gradient.")
_GatherSequenceWhole = region_function("_GatherSequenceWhole", _gather_sequence, _split_sequence,
                               "All-gather dim 1 forward; backward keeps this rank's slice of a whole gradient.")
_ReduceScatterSequence = region_function("_ReduceScatterSequence", _reduce_scatter_sequence, _gather_sequence,
                                 "Reduce-scatter dim 1 forward (a row-parallel output); backward all-gathers the "
                                 "gradient.")
_ScatterSequence = region_function("_ScatterSequence", _split_sequence, _gather_sequence,
                           "Keep this rank's slice of dim 1 forward; backward all-gathers the gradient.")


class _ProjectGathered(torch.autograd.Function):
    """A column-parallel projection of a sequence-gathered input that keeps the input's local slice,
    not the gathered whole, for its backward, and gathers the slices again there (Megatron's
    sequence-parallel linear). ``conv1d``: HF's Conv1D layout, ``x W + b`` with W (in, out); else
    ``x W^T + b``. The gradients are the very products autograd's linear / addmm backward computes."""

    @staticmethod
    def forward(ctx, x, weight, bias, local, group, conv1d):
        ctx.save_for_backward(local, weight)
        ctx.group, ctx.conv1d, ctx.has_bias, ctx.shape = group, conv1d, bias is not None, x.shape
        if conv1d:
            return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], -1)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        local, weight = ctx.saved_tensors
        x = _gather_sequence(local, ctx.group).reshape(-1, local.shape[-1])  # the input again
        g = grad.reshape(-1, grad.shape[-1])
        if ctx.conv1d:  # y = x W + b: addmm's backward
            grad_x, grad_w = g.mm(weight.t()), x.t().mm(g)
        else:  # y = x W^T + b: the transposed weight is column-major, so its gradient is g^T x
            grad_x, grad_w = g.mm(weight), g.t().mm(x)
        grad_b = g.sum(0) if ctx.has_bias else None
        return grad_x.view(ctx.shape), grad_w, grad_b, None, None, None


def gathered_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        conv1d: bool = False) -> torch.Tensor:
    """A column-parallel projection of ``x``: when ``x`` is a sequence-parallel region's gathered input
    (`mark_gathered`), one that keeps only the local slice for the backward (`_ProjectGathered`);
    otherwise the plain product."""
    local = getattr(x, "sequence_local", None)
    if local is not None and torch.is_grad_enabled():
        return _ProjectGathered.apply(x, weight, bias, *local, conv1d)
    if conv1d:
        return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], -1)
    return F.linear(x, weight, bias)


def mark_gathered(whole: torch.Tensor, local: torch.Tensor, group) -> torch.Tensor:
    """Tag a sequence-gathered tensor with its local slice, for `gathered_projection`."""
    whole.sequence_local = (local, group)
    return whole


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


def gather_sequence(x: torch.Tensor, group, whole_grad: bool = False) -> torch.Tensor:
    """(B, T / tp, ...) on each rank -> (B, T, ...) on every rank (the module docstring's table)."""
    if group_size(group) == 1:
        return x
    return (_GatherSequenceWhole if whole_grad else _GatherSequence).apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Partial (B, T, ...) on each rank -> this rank's (B, T / tp, ...) slice of their sum."""
    return x if group_size(group) == 1 else _ReduceScatterSequence.apply(x, group)


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Replicated (B, T, ...) -> this rank's (B, T / tp, ...) slice, rank r keeping slice r."""
    return x if group_size(group) == 1 else _ScatterSequence.apply(x, group)


def row_parallel_sum(partial: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Close a row-parallel projection: ``g`` (all-reduce), or under sequence parallelism the
    reduce-scatter along dim 1 that leaves each rank its slice of the sum."""
    if sequence_parallel:
        return reduce_scatter_sequence(partial, group)
    return reduce_from_tensor_model_parallel_region(partial, group)


__all__ = [
    "gather_sequence", "row_parallel_sum", "region_function", "gathered_projection", "mark_gathered",
    "reduce_scatter_sequence",
    "scatter_sequence",
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region",
    "all_reduce", "all_gather", "group_size", "group_rank",
]
