"""Gradient norm over every stage of the model, and clipping by it (DESIGN.md invariant 6).

Each rank sums the squares of its own gradients (fp32), one all-reduce over the ranks that hold the
model adds the stages together, and every rank applies the same coefficient. The caller passes
only the parameters this rank *counts*: a weight tied across stages is counted on one stage.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def global_grad_norm(counted: Iterable[torch.Tensor], group=None, device=None) -> torch.Tensor:
    """sqrt(sum of squared gradients) over all ranks of ``group`` (None: this process alone)."""
    grads = [p.grad for p in counted if p.grad is not None]
    device = device or (grads[0].device if grads else torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        total += g.detach().float().pow(2).sum()
    if group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.sqrt()


def clip_by_global_norm(params: Iterable[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> float:
    """Scale every gradient by min(1, max_norm / (total_norm + 1e-6)); return the coefficient."""
    coef = min(1.0, max_norm / (float(total_norm) + 1e-6))
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return coef
