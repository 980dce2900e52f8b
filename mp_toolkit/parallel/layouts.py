"""Where each piece of a tensor-parallel parameter lives: full <-> shard, and padding.

Every sharded Parameter carries Megatron's attributes ``tensor_model_parallel = True``,
``partition_dim`` and ``partition_stride``; replicated ones (LayerNorm, row-parallel bias) carry
none. A vocabulary split over tp ranks is padded (`mp_toolkit.parallel.vocab_parallel`): its
shards then also carry ``unpadded_size``, the length of ``partition_dim`` in the real full tensor;
the rows past it exist only in the shards (zero, never trained). `gather_full` strips them and
`shard_full` adds them back, so the full form -- checkpoints, `mpt export`, tests -- always has the
model's own shape, whatever the tp degree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mp_toolkit.optim.groups import is_tensor_parallel
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.tp_comms import all_gather, group_size

TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "unpadded_size", "sequence_parallel")
"""The sharding attributes a tensor laid out like a sharded parameter (its fp32 master) must carry too;
``sequence_parallel``: a replicated parameter whose gradient is a partial sum over tp
(`mp_toolkit.parallel.sequence_parallel`)."""


def mark_tensor_parallel(param: nn.Parameter, dim: int, stride: int = 1,
                         unpadded_size: int | None = None) -> nn.Parameter:
    """Set Megatron's sharding attributes on ``param`` (read by optimizers, clipping, checkpoints);
    ``unpadded_size``: the real length of ``dim`` when the full tensor was padded before the split."""
    if unpadded_size is not None and stride != 1:
        raise ValueError(f"a padded dim is split with stride 1, not {stride}")
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = stride
    if unpadded_size is not None:
        param.unpadded_size = unpadded_size
    return param


def full_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    """The shape `gather_full` returns for ``param`` on ``tp`` ranks, without communication."""
    shape = list(param.shape)
    if is_tensor_parallel(param):
        shape[param.partition_dim] = getattr(param, "unpadded_size", shape[param.partition_dim] * tp)
    return tuple(shape)


def pad_dim(full: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``full`` with zeros appended along ``dim`` up to ``size`` (``full`` itself when already that long)."""
    extra = size - full.shape[dim]
    if extra < 0:
        raise ValueError(f"dim {dim} of size {full.shape[dim]} is longer than its padded size {size}")
    if extra == 0:
        return full
    return F.pad(full, [0, 0] * (full.dim() - 1 - dim % full.dim()) + [0, extra])


def shard_full(full: torch.Tensor, layout, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of ``full``. ``layout`` is a sharded parameter (its ``partition_dim`` /
    ``partition_stride``) or a ``(dim, stride)`` pair; a replicated parameter returns ``full``.

    The dim is cut into ``tp * stride`` equal chunks and rank r keeps chunks r, r + tp, ... . With
    stride 3 on a fused (3C, C) qkv weight the chunks are q_0..q_{tp-1}, k_0.., v_0.., so rank r
    keeps [q_r; k_r; v_r] (Megatron's strided split). A padded parameter's unpadded ``full`` (the
    form `gather_full` returns) is first padded with zero rows to ``tp`` times the shard's length.
    """
    if isinstance(layout, torch.Tensor):
        if not is_tensor_parallel(layout):
            return full
        if full.shape[layout.partition_dim] == getattr(layout, "unpadded_size", None):
            full = pad_dim(full, layout.partition_dim, layout.shape[layout.partition_dim] * tp)
        layout = (layout.partition_dim, layout.partition_stride)
    dim, stride = layout
    ranges = shard_ranges(full.shape[dim], stride, tp_rank, tp, dim)
    return torch.cat([full.narrow(dim, start, stop - start) for start, stop in ranges], dim=dim)


def shard_ranges(n: int, stride: int, tp_rank: int, tp: int, dim: int = 0) -> list[tuple[int, int]]:
    """The [start, stop) ranges of a size-``n`` dim that rank ``tp_rank`` keeps, in order: chunks
    r, r + tp, ... of ``tp * stride`` equal chunks (`shard_full`; a file is read as these slices)."""
    if n % (tp * stride) != 0:
        raise ValueError(f"dim {dim} of size {n} is not divisible by tp*stride = {tp}*{stride}")
    size = n // (tp * stride)
    return [(k * size, (k + 1) * size) for k in range(tp_rank, tp * stride, tp)]


def gather_full(param: torch.Tensor, group, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The full (unsharded, unpadded) tensor of a sharded parameter, on every rank of ``group``.

    ``tensor`` (default: ``param`` itself) is anything laid out like ``param``, e.g. ``param.grad``.
    Replicated parameters, or ``group=None``, return ``tensor`` as it is. Not differentiable.
    """
    t = param if tensor is None else tensor
    if not is_tensor_parallel(param) or group_size(group) == 1:
        return t
    dim, stride = param.partition_dim, param.partition_stride
    # shards[r] = [chunk r, chunk r + tp, ...]; the full tensor lists chunk 0, 1, 2, ... in order
    pieces = [s.chunk(stride, dim=dim) for s in all_gather(t.detach(), group)]
    full = torch.cat([p[s] for s in range(stride) for p in pieces], dim=dim)
    unpadded = getattr(param, "unpadded_size", None)
    return full if unpadded is None else full.narrow(dim, 0, unpadded)


def shard_parameter(full: torch.Tensor, dim: int, stride: int, ctx: ParallelContext,
                    padded_size: int | None = None) -> nn.Parameter:
    """This rank's shard of ``full`` as a new marked Parameter; ``padded_size`` (stride 1 only)
    first appends zero rows along ``dim`` so that every rank holds ``padded_size / tp`` of them."""
    unpadded, requires_grad = None, full.requires_grad
    if padded_size is not None and padded_size != full.shape[dim]:
        unpadded, full = full.shape[dim], pad_dim(full.detach(), dim, padded_size)
    shard = shard_full(full.detach(), (dim, stride), ctx.tp_rank, ctx.tp).clone()
    return mark_tensor_parallel(nn.Parameter(shard, requires_grad=requires_grad), dim, stride, unpadded)


__all__ = ["TP_ATTRIBUTES", "mark_tensor_parallel", "full_shape", "pad_dim", "shard_full", "gather_full",
           "shard_parameter"]
