"""Gradient norm over every stage and tensor shard of the model, clipping by it, and the overflow
test (`has_inf_or_nan`) that reuses its per-tensor norms (DESIGN.md invariant 6).

The arithmetic is `torch.nn.utils.clip_grad_norm_`'s, spread over ranks: each rank takes the
2-norm of each of its gradients (`tensor_norms`, one multi-tensor pass that the step's inf/nan
test reuses), the per-tensor norms of all ranks are gathered and put in stage order (each norm
keyed by its stage; a rank's parameters follow the unsplit model's order within its stages, and a
rank may hold stages far apart: interleaved chunks, the V schedules), and every rank reduces that
same vector the same way, so all ranks hold the same norm and, for pipeline-only runs, the very
bits `clip_grad_norm_` computes on the unsplit model. The coefficient is
``clamp(max_norm / (norm + 1e-6), max=1)`` in fp32, as torch's.

Tensor parallelism (``tp_group`` given): a shard's norm becomes its whole tensor's norm,
``sqrt(sum over tp ranks of ||shard||^2)`` (squares summed in fp64, one all-reduce for all
shards), and only tensor-parallel rank 0 then reports its per-tensor norms: the other tp ranks
hold the same whole-tensor norms of the shards and bitwise copies of the replicated tensors
(LayerNorms, row-parallel biases, position embeddings), which must be counted once. The
gathered vector is then the unsplit model's per-tensor norms, up to the rounding of the shards'
sums.

The caller passes only the parameters this rank *counts* for ties: a weight tied across stages
is counted on one stage (`mp_toolkit.engine.ties`); every tp rank passes the same list.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from mp_toolkit.optim.groups import allreduce_sharded_squares, is_tensor_parallel


def gather_ragged(norms: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's 1-D ``norms`` (per-tensor norms, trust ratios) in group-rank order
    (counts may differ)."""
    size = dist.get_world_size(group)
    count = torch.tensor([norms.numel()], dtype=torch.int64, device=norms.device)
    counts = [torch.empty_like(count) for _ in range(size)]
    dist.all_gather(counts, count, group=group)
    longest = int(max(c.item() for c in counts))
    padded = torch.zeros(longest, dtype=norms.dtype, device=norms.device)
    padded[: norms.numel()] = norms
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[: int(c.item())] for g, c in zip(gathered, counts)])


def whole_tensor_norms(norms: torch.Tensor, sharded: list[bool], tp_group) -> torch.Tensor:
    """(n,) per-tensor norms of this rank -> what it reports for the unsplit model.

    Shards' squared norms are summed over ``tp_group`` (every tp rank lists the same shards in the
    same order, as Megatron's layers guarantee); tp rank 0 returns all n whole-tensor norms, the
    other tp ranks none, so replicated tensors are counted once.
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return norms
    squares = norms.double().square().unsqueeze(1)  # (n, 1): fp64, so the sum adds no rounding of note
    whole = allreduce_sharded_squares(squares, sharded, tp_group).squeeze(1).sqrt().to(norms.dtype)
    return whole if dist.get_rank(tp_group) == 0 else whole[:0]


def tensor_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(n,) fp32 2-norms of ``tensors`` from one multi-tensor reduction (on CPU bitwise
    ``vector_norm`` per tensor, on CUDA the kernel `clip_grad_norm_` uses)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    norms = torch._foreach_norm(tensors, 2.0)
    return torch.stack([n.float().to(norms[0].device) for n in norms])


def global_grad_norm(counted: Iterable[torch.Tensor], group=None, device=None, tp_group=None,
                     norms: torch.Tensor | None = None, keys: Sequence[int] | None = None) -> torch.Tensor:
    """The 2-norm of all counted gradients of every rank in ``group`` (None: this rank alone).

    ``group`` is the model-parallel group (pp x tp) of this replica; ``tp_group`` this rank's
    tensor-parallel group, or None without tensor parallelism (the pipeline-only path is bitwise
    `clip_grad_norm_`'s). ``norms``: the `tensor_norms` of the counted gradients (of the tensors
    that have one, in order) when the caller already took them, so no second pass reads them.
    ``keys``: per counted gradient with a norm, its stage: the gathered norms are reduced in key order
    (stable), the unsplit model's; None: in rank order.
    """
    params = [p for p in counted if p.grad is not None]
    device = device or (params[0].grad.device if params else torch.device("cpu"))
    if norms is None:
        norms = tensor_norms([p.grad for p in params])
    if len(norms) != len(params):
        raise ValueError(f"global_grad_norm: {len(norms)} norms for {len(params)} gradients")
    norms = whole_tensor_norms(norms.to(device), [is_tensor_parallel(p) for p in params], tp_group)
    order = None if keys is None else torch.tensor(list(keys), dtype=torch.float64, device=device)[:len(norms)]
    if group is not None:
        norms = gather_ragged(norms, group)
        order = None if order is None else gather_ragged(order, group)
    if order is not None:
        norms = norms[torch.argsort(order, stable=True)]
    return torch.linalg.vector_norm(norms, 2.0)


def partitioned_grad_norm(params: list[torch.Tensor], norms: torch.Tensor, count_replicated: bool,
                          device=None) -> torch.Tensor:
    """ZeRO-1: the global 2-norm when every element of the model's gradient lies on exactly one
    rank's pieces (``params``, their `tensor_norms` ``norms``; the counted ones for ties).

    Pieces of one data-parallel rank are disjoint from every other's, stages from each other; a
    tensor-parallel-replicated tensor's pieces are alike on every tp rank and are counted where
    ``count_replicated`` (tp rank 0), a shard's everywhere. The squares are summed in fp64 and in
    one all-reduce over every rank; the sum runs in another order than `global_grad_norm`'s, a
    rounding apart.
    """
    device = device or norms.device
    keep = torch.tensor([count_replicated or is_tensor_parallel(p) for p in params], dtype=torch.bool)
    total = norms.double().square().cpu()[keep].sum().reshape(1).to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.sqrt().float()[0]


def clip_by_global_norm(params: Iterable[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale every gradient by clamp(max_norm / (total_norm + 1e-6), max=1); return the coefficient."""
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return coef


def has_inf_or_nan(tensors: Iterable[torch.Tensor | None], norms: torch.Tensor | None = None) -> bool:
    """True when any element of any tensor is inf or nan.

    One multi-tensor 2-norm per tensor (or ``norms``: the `tensor_norms` the caller already took
    of the same non-empty tensors, in order, for clipping), then one host sync: inf and nan
    propagate into a 2-norm, so a finite one proves its tensor finite. A tensor whose 2-norm is
    not finite is scanned element by element, because squares of large finite values overflow
    (|x| > ~1.8e19 in fp32): large finite gradients are not mistaken for overflow. ``None`` and
    empty tensors are skipped.
    """
    ts = [t for t in tensors if t is not None and t.numel() > 0]
    if not ts:
        return False
    if norms is None:
        norms = tensor_norms(ts)
    if len(norms) != len(ts):
        raise ValueError(f"has_inf_or_nan: {len(norms)} norms for {len(ts)} tensors")
    finite = torch.isfinite(norms)
    if bool(finite.all()):
        return False
    return any(not bool(torch.isfinite(ts[i]).all()) for i in (~finite).nonzero().flatten().tolist())
