"""Tensor-parallel shards of HF's ``Conv1D`` (GPT-2's c_attn / c_proj / c_fc), in Conv1D's layout.

``Conv1D`` is a linear layer with the weight transposed: ``y = x W + b`` with W (in, out), computed
as ``addmm(b, x, W)``. Its shards keep that layout, so a gathered shard *is* the HF weight and a
layout-independent checkpoint stores the same (in, out) tensor whatever tp wrote it:

* column-parallel: W's output *columns* split, ``partition_dim = 1`` (bias dim 0); ``stride = 3``
  on the fused ``c_attn`` [q | k | v] columns, so rank r keeps q, k and v of its own heads;
* row-parallel: W's input *rows* split, ``partition_dim = 0``; the partial products are summed
  (Megatron's ``g``) and the replicated bias is added once, after the sum.

Same communication regions as `mp_toolkit.parallel.tensor_parallel`'s Linear shards: a column
shard opens with ``f`` (identity forward, all-reduce of the input gradient backward), a row shard
closes with ``g`` (all-reduce forward). Under sequence parallelism (`mp_toolkit.parallel.sequence_parallel`)
a column shard's input is already whole (no ``f``) and a row shard reduce-scatters along the sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.tensor_parallel import mark_tensor_parallel, shard_full
from mp_toolkit.parallel.tp_comms import copy_to_tensor_model_parallel_region, gathered_projection, row_parallel_sum


def _shard(full: torch.Tensor, dim: int, stride: int, ctx: ParallelContext) -> nn.Parameter:
    n = full.shape[dim]
    if n % (ctx.tp * stride):
        raise ValueError(f"Conv1D dim {dim} of size {n} is not divisible by tp*stride = {ctx.tp}*{stride}: "
                         f"choose a tp that divides {n // stride}")
    shard = shard_full(full.detach(), (dim, stride), ctx.tp_rank, ctx.tp).clone()
    return mark_tensor_parallel(nn.Parameter(shard, requires_grad=full.requires_grad), dim, stride)


class Conv1DColumnParallel(nn.Module):
    """(.., in) replicated -> (.., out / tp) local; weight (in, out / tp), bias (out / tp,)."""

    tp_region = "open"
    sequence_parallel = False

    def __init__(self, conv: nn.Module, ctx: ParallelContext, stride: int = 1):
        super().__init__()
        self.nx, self.nf, self.stride, self.tp_group = conv.nx, conv.nf, stride, ctx.tp_group
        self.weight = _shard(conv.weight, 1, stride, ctx)
        self.bias = _shard(conv.bias, 0, stride, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)  # f
        return gathered_projection(x, self.weight, self.bias, conv1d=True)  # (N, in) @ (in, out / tp)

    def extra_repr(self) -> str:
        return f"nx={self.nx}, nf={self.nf} (local {self.weight.shape[1]}), stride={self.stride}"


class Conv1DRowParallel(nn.Module):
    """(.., in / tp) local -> (.., out) replicated; weight (in / tp, out), bias (out,) replicated."""

    tp_region = "close"
    sequence_parallel = False

    def __init__(self, conv: nn.Module, ctx: ParallelContext):
        super().__init__()
        self.nx, self.nf, self.tp_group = conv.nx, conv.nf, ctx.tp_group
        self.weight = _shard(conv.weight, 0, 1, ctx)
        self.bias = conv.bias  # the same Parameter, unmarked: replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.mm(x.reshape(-1, x.shape[-1]), self.weight)  # (N, in / tp) @ (in / tp, out)
        partial = partial.view(*x.shape[:-1], -1)
        return row_parallel_sum(partial, self.tp_group, self.sequence_parallel) + self.bias  # g: sum over ranks

    def extra_repr(self) -> str:
        return f"nx={self.nx} (local {self.weight.shape[0]}), nf={self.nf}"
