"""What the engine reports, agreed over the (pp, tp, dp) grid: the global mean loss, trust ratios.

Which group carries what, and why:

* loss: only the last pipeline stage computes it; under tensor parallelism every tp rank of that
  stage holds the same value (`vocab_parallel_cross_entropy` all-reduces), so a broadcast over
  ``pp_group`` from the last stage reaches every stage of the replica; an all-reduce over
  ``dp_group`` then averages the replicas, which saw different micro-batches.
* trust ratios: each optimizer computes whole-tensor norms of its shards (LAMB / LARS take the
  tp group), so every tp rank and, after the data-parallel gradient average, every dp replica
  holds the same ratios; gathering over ``pp_group`` alone gives one row per pipeline rank. Under
  ZeRO-1 a replica holds the ratios of its pieces only: each tensor's ratio is reported by the
  piece that holds its first element and the replicas' lists are gathered over ``dp_group`` first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mp_toolkit.optim.clip import gather_ragged
from mp_toolkit.parallel.context import ParallelContext


def global_mean_loss(losses: Sequence[torch.Tensor], ctx: ParallelContext, last_stage_rank: int,
                     size: int | None = None) -> float | list[float]:
    """The mean loss of the global batch, on every rank.

    ``losses`` are this replica's micro-batch losses already divided by m (empty off the last
    stage); their sum is the replica's mean, and the mean of the dp replicas' means is the global
    batch's mean (every replica runs m micro-batches of the same size). ``size``: each "loss" is a
    vector of that many values (`PipelineEngine.eval_metrics`), averaged alike; a list comes back.
    """
    total = torch.zeros(() if size is None else (size,), dtype=torch.float32, device=ctx.device)
    for loss in losses:  # ascending micro-batch order, as single-process accumulation adds them
        total += loss.detach().float()
    if ctx.pp_group is not None:
        dist.broadcast(total, src=last_stage_rank, group=ctx.pp_group)
    if ctx.grad_group is not None:  # dp replicas, and cp slices (each loss scaled to its share: see loss)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.grad_group)
        total /= ctx.grad_size
    return total.item() if size is None else total.tolist()


def _adapted_ratios(optimizer) -> list[float]:
    """Last step's trust ratios of the tensors that layer adaptation applies to: not the 1.0s of
    biases and norms that ``adapt=False`` excludes (our LAMB and LARS), but every tensor under
    DeepSpeed's FusedLamb rule, 1-D ones included. Under ZeRO-1, once per tensor (its first piece)."""
    adapted = {id(p) for g in optimizer.param_groups if g.get("adapt", True) for p in g["params"]
               if getattr(p, "zero_piece", None) is None or p.zero_piece.first}
    return [float(v) for p, v in optimizer.last_trust_ratios().items() if id(p) in adapted]


def trust_ratio_rows(optimizer, ctx: ParallelContext) -> list[dict] | None:
    """Per pipeline rank min / median / max of the last step's trust ratios (LAMB, LARS), on every
    rank, with the rule they follow (``optimizer.trust_rule``: "mp_toolkit" or "deepspeed" for LAMB,
    "lars") and how many tensors they cover; None for optimizers without trust ratios."""
    if not hasattr(optimizer, "last_trust_ratios"):
        return None
    ratios = torch.tensor(_adapted_ratios(optimizer), dtype=torch.float32)
    partitioned = any(hasattr(p, "zero_piece") for g in optimizer.param_groups for p in g["params"])
    if partitioned and ctx.grad_group is not None:
        ratios = gather_ragged(ratios.to(ctx.device), ctx.grad_group).cpu()
    count = torch.tensor(float(ratios.numel()))
    ratios = ratios if ratios.numel() else torch.tensor([float("nan")])
    mine = torch.stack([ratios.min(), ratios.median(), ratios.max(), count]).float().to(ctx.device)
    rows = [mine]
    if ctx.pp_group is not None:
        rows = [torch.empty_like(mine) for _ in range(ctx.pp)]
        dist.all_gather(rows, mine, group=ctx.pp_group)
    rule = getattr(optimizer, "trust_rule", type(optimizer).__name__.lower())
    return [{"stage": i, "rule": rule, "tensors": int(r[3].item()), "min": r[0].item(), "median": r[1].item(),
             "max": r[2].item()} for i, r in enumerate(rows)]
