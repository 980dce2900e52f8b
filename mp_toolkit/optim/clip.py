"""Gradient norm over every stage of the model, and clipping by it (DESIGN.md invariant 6).

The arithmetic is `torch.nn.utils.clip_grad_norm_`'s, spread over ranks: each rank takes the
2-norm of each of its gradients, the per-tensor norms of all ranks are gathered in rank order
(= stage order, as the stages' parameters follow the unsplit model's order), and every rank
reduces that same vector the same way, so all ranks hold the same norm and, for pipeline-only
runs, the very bits `clip_grad_norm_` computes on the unsplit model. The coefficient is
``clamp(max_norm / (norm + 1e-6), max=1)`` in fp32, as torch's.

The caller passes only the parameters this rank *counts*: a weight tied across stages is counted
on one stage, a tensor-parallel-replicated one on tensor-parallel rank 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def _gather_norms(norms: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's per-tensor norms in group-rank order (counts may differ)."""
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


def global_grad_norm(counted: Iterable[torch.Tensor], group=None, device=None) -> torch.Tensor:
    """The 2-norm of all counted gradients of every rank in ``group`` (None: this rank alone)."""
    grads = [p.grad for p in counted if p.grad is not None]
    device = device or (grads[0].device if grads else torch.device("cpu"))
    if grads:
        norms = torch.stack([torch.linalg.vector_norm(g, 2.0).float() for g in grads]).to(device)
    else:
        norms = torch.zeros(0, dtype=torch.float32, device=device)
    if group is not None:
        norms = _gather_norms(norms, group)
    return torch.linalg.vector_norm(norms, 2.0)


def clip_by_global_norm(params: Iterable[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale every gradient by clamp(max_norm / (total_norm + 1e-6), max=1); return the coefficient."""
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return coef
