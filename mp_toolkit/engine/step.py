"""The optimizer step that closes a global batch, in the one order that keeps ranks in agreement.

    average gradients over data-parallel replicas (buckets posted during the schedule; wait)
      -> unscale (model grads -> fp32 master grads x 1/loss_scale)
      -> sum tied-weight gradients over their stages
      -> sum the sequence-parallel partial gradients over tp (replicated norms and biases that saw
         seq / tp of the tokens: `mp_toolkit.parallel.sequence_parallel`), in one all-reduce
      -> per-tensor gradient 2-norms, one pass (read again by the two steps below)
      -> overflow consensus: inf/nan in a gradient or the loss on any rank means every rank skips
         (in every precision: fp16's scaler then lowers the scale; fp32 / bf16 just skip)
      -> global gradient norm over all stages and tensor shards (tied weights and
         tensor-parallel-replicated ones counted once) -> clip
      -> optimizer step on the masters -> copy masters back into the model (fp16/bf16)
      -> loss scaler update

The data-parallel average comes first so that every replica holds the same gradients: from
there on each replica computes the same norm and takes the same step, with no further traffic
between replicas. The norm is agreed over the model-parallel group (pp x tp) of the replica.

ZeRO-1 (`mp_toolkit.engine.zero`): the average is a reduce-scatter, so each replica holds the
mean gradient of its pieces only; the masters are those pieces, the norm is summed over every
rank (`partitioned_grad_norm`), each replica steps its pieces and "copy back" all-gathers them.
The order above is unchanged.

DESIGN.md invariant 6: one global decision per step. A skipped step leaves every parameter and
optimizer state unchanged on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_toolkit.engine.ties import TiedGradients
from mp_toolkit.engine.zero import ShardedMasters
from mp_toolkit.optim.clip import (
    clip_by_global_norm,
    global_grad_norm,
    has_inf_or_nan,
    partitioned_grad_norm,
    tensor_norms,
)
from mp_toolkit.optim.loss_scaler import DynamicLossScaler
from mp_toolkit.optim.master import MasterWeights
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.data_parallel import DataParallelGrads
from mp_toolkit.parallel.sequence_parallel import is_sequence_parallel
from mp_toolkit.parallel.zero import ShardedGrads


@dataclass
class StepResult:
    """What the step decided: pre-clip global norm, whether it was skipped, the scale it used, and
    what was not finite on some rank ("gradients", "loss", "loss and gradients"; "" when all was)."""

    grad_norm: float
    skipped: bool
    loss_scale: float
    nonfinite: str = ""


def any_rank_true(flag, device: torch.device):
    """MAX all-reduce of a flag (or a tuple of flags, in one call) over every rank (a no-op in one process)."""
    flags = flag if isinstance(flag, tuple) else (flag,)
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out = tuple(bool(v > 0) for v in t.tolist())
    return out if isinstance(flag, tuple) else out[0]


class OptimizerStep:
    """Owns the masters, the optimizer and the loss scaler of this rank's stages.

    ``dp_grads`` averages the model gradients over the data-parallel group (None when dp == 1);
    under ZeRO-1 ``masters`` are `ShardedMasters` and ``dp_grads`` their `ShardedGrads`.
    ``stage_of``: per model parameter (by ``id``) the stage it first appears in, so that the global
    norm reduces the per-tensor norms in the unsplit model's order whatever the placement
    (`optim.clip.global_grad_norm`'s keys); None: in rank order.
    """

    def __init__(self, ctx: ParallelContext, masters: MasterWeights | ShardedMasters, optimizer: torch.optim.Optimizer,
                 ties: TiedGradients, clip_grad: float | None, scaler: DynamicLossScaler | None,
                 dp_grads: DataParallelGrads | ShardedGrads | None = None, stage_of: dict[int, int] | None = None):
        self.ctx, self.masters, self.optimizer, self.ties = ctx, masters, optimizer, ties
        self.clip_grad, self.scaler, self.dp_grads = clip_grad, scaler, dp_grads
        model = [p for p in masters.model if ties.counted_in_norm(p)]
        self.counted = [masters.of(p) for p in model]
        self.keys = None if stage_of is None else [stage_of[id(p)] for p in model]
        self.partial = [p for p in masters.model if is_sequence_parallel(p)]

    def _sum_partial_grads(self) -> None:
        """The sequence-parallel gradients summed over the tp group, flattened into one all-reduce
        (every tp rank lists the same parameters, and under ZeRO-1 the same pieces, in the same order)."""
        if not self.partial or self.ctx.tp_group is None:
            return
        masters = [self.masters.of(p) for p in self.partial]
        for m in masters:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        flat = torch.cat([m.grad.reshape(-1) for m in masters])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.ctx.tp_group)
        for m, part in zip(masters, flat.split([m.numel() for m in masters])):
            m.grad.copy_(part.view_as(m.grad))

    def _counted_norms(self, with_grad: list[torch.Tensor], norms: torch.Tensor) -> torch.Tensor:
        """The norms of the counted masters that have a gradient, in `global_grad_norm`'s order
        (an empty gradient's norm is 0)."""
        index = {id(m): i for i, m in enumerate(with_grad)}
        picked = [norms[index[id(m)]] if id(m) in index else torch.zeros((), dtype=norms.dtype, device=norms.device)
                  for m in self.counted if m.grad is not None]
        return torch.stack(picked) if picked else norms[:0]

    def _global_norm(self, with_grad: list[torch.Tensor], norms: torch.Tensor) -> torch.Tensor:
        counted = self._counted_norms(with_grad, norms)
        if isinstance(self.masters, ShardedMasters):
            return partitioned_grad_norm([m for m in self.counted if m.grad is not None], counted,
                                         count_replicated=self.ctx.tp_rank == 0, device=self.ctx.device)
        keys = None if self.keys is None else [k for m, k in zip(self.counted, self.keys) if m.grad is not None]
        return global_grad_norm(self.counted, group=self.ctx.model_group, device=self.ctx.device,
                                tp_group=self.ctx.tp_group, norms=counted, keys=keys)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def __call__(self, nonfinite_loss: bool = False) -> StepResult:
        """Close the batch; ``nonfinite_loss``: this rank's micro-batch losses were not all finite."""
        scale = self.loss_scale
        if self.dp_grads is not None:
            self.dp_grads.finish_grad_sync()
        self.masters.grads_to_master(1.0 / scale)
        self.ties.all_reduce(self.masters.of)
        self._sum_partial_grads()
        # One pass over the gradients: their 2-norms serve the inf/nan test and the global norm.
        with_grad = [m for m in self.masters.master if m.grad is not None and m.grad.numel() > 0]
        norms = tensor_norms([m.grad for m in with_grad])
        bad_grads, bad_loss = any_rank_true(
            (has_inf_or_nan([m.grad for m in with_grad], norms), nonfinite_loss), self.ctx.device)
        overflow = bad_grads or bad_loss
        norm = float("nan")
        if not overflow:
            total = self._global_norm(with_grad, norms)
            norm = float(total)
            if self.clip_grad is not None:
                clip_by_global_norm(self.masters.master, total, self.clip_grad)
            self.optimizer.step()
            self.masters.copy_back()
        self.masters.zero_grad()
        if self.scaler is not None:
            self.scaler.update(overflow)
        what = " and ".join(w for w, bad in (("loss", bad_loss), ("gradients", bad_grads)) if bad)
        return StepResult(grad_norm=norm, skipped=overflow, loss_scale=scale, nonfinite=what)
