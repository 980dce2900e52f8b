"""PipelineEngine: one global batch = every micro-batch of a schedule, then one optimizer step.

Micro-batching *is* gradient accumulation: each micro-batch loss is multiplied by 1/m before its
backward (DESIGN.md invariant 5), so after the schedule the gradients are those of the mean loss
over the global batch, exactly as single-process accumulation over the same micro-batches.

The order of the step, in one place::

    run schedule actions -> sum tied-weight gradients over their stages
        -> global gradient norm over all stages (tied weights counted once) -> optional clip
        -> optimizer step -> zero gradients

Launch (each rank runs the same program)::

    torchrun --nproc_per_node 2 -m mp_toolkit.cli train --model gpt-tiny --pp 2
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_toolkit.engine.executor import Executor, agree_specs
from mp_toolkit.engine.ties import TiedGradients
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.clip import clip_by_global_norm, global_grad_norm
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.p2p import P2P
from mp_toolkit.schedule import Kind, Schedule, get_schedule, validate


def forward_only(schedule: Schedule) -> tuple[tuple, ...]:
    """Each rank's actions without backward or gradient traffic (evaluation)."""
    keep = {Kind.F, Kind.SEND_F, Kind.RECV_F}
    return tuple(tuple(a for a in acts if a.kind in keep) for acts in schedule.actions)


@dataclass
class StepStats:
    """What one `train_batch` measured: mean loss and pre-clip global gradient norm."""

    loss: float
    grad_norm: float


class PipelineEngine:
    """Trains the stage of a LayerList that this rank holds.

    Args:
        layer_list: the whole model as a LayerList (every rank builds it identically).
        ctx: this rank's ParallelContext.
        boundaries: partition ``[0, b1, ..., len(layer_list)]`` with ``ctx.pp`` stages.
        num_microbatches: m, micro-batches per global batch.
        schedule: schedule name ("1f1b", "gpipe").
        optimizer: callable(params) -> torch.optim.Optimizer for this stage's parameters.
        loss_fn: (last stage output, labels) -> mean loss of one micro-batch.
        clip_grad: max global gradient norm, or None for no clipping.
    """

    def __init__(self, layer_list: LayerList, ctx: ParallelContext, boundaries: Sequence[int],
                 num_microbatches: int, schedule: str, optimizer: Callable, loss_fn: Callable,
                 clip_grad: float | None = None):
        if len(boundaries) != ctx.pp + 1:
            raise ValueError(f"partition {list(boundaries)} has {len(boundaries) - 1} stages, expected --pp {ctx.pp}")
        if ctx.tp != 1 or ctx.dp != 1:
            raise NotImplementedError("the pipeline engine supports tp=1 and dp=1 so far")
        self.ctx, self.boundaries, self.m = ctx, list(boundaries), num_microbatches
        s = ctx.pp_rank
        self.stage = layer_list.slice(boundaries[s], boundaries[s + 1], s).to(ctx.device)
        self.schedule = get_schedule(schedule, ctx.pp, num_microbatches)
        validate(self.schedule)
        self.ties = TiedGradients(layer_list, boundaries, ctx, self.stage)
        self.p2p = P2P(ctx.device) if ctx.pp > 1 else None
        self.stage_to_rank = [ctx.stage_rank(i) for i in self.schedule.stage_to_rank]
        self.loss_fn, self.clip_grad = loss_fn, clip_grad
        self.optimizer = optimizer(list(self.stage.parameters()))
        self.executor: Executor | None = None

    def _next_global_batch(self, data_iter: Iterator) -> list:
        mbs = list(itertools.islice(data_iter, self.m))
        if len(mbs) < self.m:
            raise ValueError(f"data iterator ran out after {len(mbs)} of {self.m} micro-batches")
        dev = self.ctx.device
        move = lambda x: tuple(t.to(dev) for t in x) if isinstance(x, tuple) else x.to(dev)
        return [(move(x), move(y)) for x, y in mbs]

    def _executor(self, sample_inputs) -> Executor:
        if self.executor is None:  # shapes are agreed once, on the first batch, and cached
            stages = {self.ctx.pp_rank: self.stage}
            specs = agree_specs(stages, self.stage_to_rank, self.ctx.rank, self.p2p, sample_inputs)
            self.executor = Executor(stages, self.stage_to_rank, self.ctx.rank, self.p2p, specs, self.loss_fn)
        return self.executor

    def _mean_loss(self, losses: list[torch.Tensor]) -> float:
        """Sum of the 1/m-scaled micro-batch losses on the last stage, shared with every stage."""
        total = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for loss in losses:  # ascending micro-batch order, as single-process accumulation adds them
            total += loss.detach().float()
        if self.ctx.pp_group is not None:
            dist.broadcast(total, src=self.ctx.stage_rank(self.ctx.pp - 1), group=self.ctx.pp_group)
        return total.item()

    def train_batch(self, data_iter: Iterator) -> StepStats:
        """Run every micro-batch of one global batch and take one optimizer step."""
        self.stage.train()
        mbs = self._next_global_batch(data_iter)
        actions = self.schedule.rank_actions(self.ctx.pp_rank)
        losses = self._executor(mbs[0][0]).run(actions, mbs, loss_divisor=self.m)
        self.ties.all_reduce()
        params = list(self.stage.parameters())
        counted = [p for p in params if self.ties.counted_in_norm(p)]
        norm = global_grad_norm(counted, group=self.ctx.model_group, device=self.ctx.device)
        if self.clip_grad is not None:
            clip_by_global_norm(params, norm, self.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(loss=self._mean_loss(losses), grad_norm=float(norm))

    def eval_batch(self, data_iter: Iterator) -> float:
        """Mean loss of one global batch, forward only, no step."""
        self.stage.eval()
        mbs = self._next_global_batch(data_iter)
        actions = forward_only(self.schedule)[self.ctx.pp_rank]
        losses = self._executor(mbs[0][0]).run(actions, mbs, loss_divisor=self.m, grad=False)
        return self._mean_loss(losses)
