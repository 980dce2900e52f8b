"""PipelineEngine: one global batch = every micro-batch of a schedule, then one optimizer step.

Micro-batching *is* gradient accumulation: each micro-batch loss is multiplied by 1/m before its
backward (DESIGN.md invariant 5), so after the schedule the gradients are those of the mean loss
over the global batch, exactly as single-process accumulation over the same micro-batches.

After the schedule, `mp_toolkit.engine.step.OptimizerStep` closes the batch (unscale, tied
gradients, overflow consensus, global-norm clip, step, copy back) in the order written there.

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
from mp_toolkit.engine.step import OptimizerStep
from mp_toolkit.engine.ties import TiedGradients
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.loss_scaler import DynamicLossScaler
from mp_toolkit.optim.master import MasterWeights, precision_dtype
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.p2p import P2P
from mp_toolkit.schedule import Kind, Schedule, get_schedule, validate


def _adapted_ratios(optimizer) -> list[float]:
    """Last step's trust ratios of the tensors that layer adaptation applies to (not the 1.0s of
    biases and norms, which ``adapt=False`` excludes)."""
    adapted = {id(p) for g in optimizer.param_groups if g.get("adapt", True) for p in g["params"]}
    return [float(v) for p, v in optimizer.last_trust_ratios().items() if id(p) in adapted]


def forward_only(schedule: Schedule) -> tuple[tuple, ...]:
    """Each rank's actions without backward or gradient traffic (evaluation)."""
    keep = {Kind.F, Kind.SEND_F, Kind.RECV_F}
    return tuple(tuple(a for a in acts if a.kind in keep) for acts in schedule.actions)


@dataclass
class StepStats:
    """What one `train_batch` measured and decided."""

    loss: float
    """Mean loss over the global batch (unscaled)."""
    grad_norm: float
    """Global gradient norm before clipping (nan when the step was skipped)."""
    skipped: bool = False
    """True when inf/nan gradients on any rank made every rank skip the step."""
    loss_scale: float = 1.0
    """The loss scale this batch used."""


class PipelineEngine:
    """Trains the stages of a LayerList that this rank holds (one, or v under interleaving).

    Args:
        layer_list: the whole model as a LayerList (every rank builds it identically).
        ctx: this rank's ParallelContext.
        boundaries: partition ``[0, b1, ..., len(layer_list)]`` with ``ctx.pp * chunks`` stages.
        num_microbatches: m, micro-batches per global batch.
        schedule: schedule name ("gpipe", "1f1b", "interleaved", "zbh1").
        optimizer: callable([(name, param), ...]) -> torch.optim.Optimizer over this stage's
            (fp32 master) parameters, named as in the unsplit LayerList.
        loss_fn: (last stage output, labels) -> mean loss of one micro-batch.
        clip_grad: max global gradient norm, or None for no clipping.
        precision: "fp32", "fp16" or "bf16": the dtype the stage computes and communicates in;
            the optimizer always holds fp32 masters.
        loss_scaler: scaler of the loss before backward (fp16); None means a scale of 1.
        chunks: model chunks per rank (interleaved 1F1B); stage s runs on pipeline rank s % pp.
    """

    def __init__(self, layer_list: LayerList, ctx: ParallelContext, boundaries: Sequence[int],
                 num_microbatches: int, schedule: str, optimizer: Callable, loss_fn: Callable,
                 clip_grad: float | None = None, precision: str = "fp32",
                 loss_scaler: DynamicLossScaler | None = None, chunks: int = 1):
        if ctx.tp != 1 or ctx.dp != 1:
            raise NotImplementedError("the pipeline engine supports tp=1 and dp=1 so far")
        self.schedule = get_schedule(schedule, ctx.pp, num_microbatches, num_chunks=chunks)
        validate(self.schedule)
        n_stages = self.schedule.num_stages
        if len(boundaries) != n_stages + 1:
            raise ValueError(f"partition {list(boundaries)} has {len(boundaries) - 1} stages, expected {n_stages}"
                             f" (--pp {ctx.pp} x --chunks {chunks})")
        self.ctx, self.boundaries, self.m = ctx, list(boundaries), num_microbatches
        dtype = precision_dtype(precision)
        self.stages = {s: layer_list.slice(boundaries[s], boundaries[s + 1], s).to(ctx.device, dtype)
                       for s in self.schedule.stages_of(ctx.pp_rank)}
        self.stage = self.stages[min(self.stages)]  # the first (with one chunk: the only) stage
        self.ties = TiedGradients(layer_list, boundaries, ctx, self.stages, self.schedule.stage_to_rank)
        self.p2p = P2P(ctx.device) if ctx.pp > 1 else None
        self.stage_to_rank = [ctx.stage_rank(i) for i in self.schedule.stage_to_rank]
        self.loss_fn = loss_fn
        named = self.named_parameters()
        self.masters = MasterWeights([p for _, p in named])
        self.optimizer = optimizer([(n, m) for (n, _), m in zip(named, self.masters.master)])
        self.step = OptimizerStep(ctx, self.masters, self.optimizer, self.ties, clip_grad, loss_scaler)
        self.executor: Executor | None = None

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters over all its stages, named as in the unsplit LayerList."""
        seen, out = set(), []
        for index in sorted(self.stages):
            for name, p in self.stages[index].named_layer_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def _next_global_batch(self, data_iter: Iterator) -> list:
        mbs = list(itertools.islice(data_iter, self.m))
        if len(mbs) < self.m:
            raise ValueError(f"data iterator ran out after {len(mbs)} of {self.m} micro-batches")
        dev = self.ctx.device
        move = lambda x: tuple(t.to(dev) for t in x) if isinstance(x, tuple) else x.to(dev)
        return [(move(x), move(y)) for x, y in mbs]

    def _executor(self, sample_inputs) -> Executor:
        if self.executor is None:  # shapes are agreed once, on the first batch, and cached
            specs = agree_specs(self.stages, self.stage_to_rank, self.ctx.rank, self.p2p, sample_inputs)
            self.executor = Executor(self.stages, self.stage_to_rank, self.ctx.rank, self.p2p, specs, self.loss_fn)
        return self.executor

    def _mean_loss(self, losses: list[torch.Tensor]) -> float:
        """Sum of the 1/m-scaled micro-batch losses on the last stage, shared with every stage."""
        total = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for loss in losses:  # ascending micro-batch order, as single-process accumulation adds them
            total += loss.detach().float()
        if self.ctx.pp_group is not None:
            dist.broadcast(total, src=self.stage_to_rank[-1], group=self.ctx.pp_group)
        return total.item()

    def train_batch(self, data_iter: Iterator) -> StepStats:
        """Run every micro-batch of one global batch and take one optimizer step."""
        for stage in self.stages.values():
            stage.train()
        mbs = self._next_global_batch(data_iter)
        actions = self.schedule.rank_actions(self.ctx.pp_rank)
        losses = self._executor(mbs[0][0]).run(actions, mbs, loss_divisor=self.m, loss_scale=self.step.loss_scale)
        result = self.step()
        return StepStats(loss=self._mean_loss(losses), grad_norm=result.grad_norm,
                         skipped=result.skipped, loss_scale=result.loss_scale)

    def trust_ratio_stats(self) -> list[dict] | None:
        """Per stage min / median / max of the last step's trust ratios (LAMB, LARS), on every rank."""
        if not hasattr(self.optimizer, "last_trust_ratios"):
            return None
        ratios = torch.tensor(_adapted_ratios(self.optimizer) or [float("nan")])
        mine = torch.stack([ratios.min(), ratios.median(), ratios.max()]).float().to(self.ctx.device)
        rows = [mine]
        if self.ctx.pp_group is not None:
            rows = [torch.empty_like(mine) for _ in range(self.ctx.pp)]
            dist.all_gather(rows, mine, group=self.ctx.pp_group)
        return [{"stage": i, "min": r[0].item(), "median": r[1].item(), "max": r[2].item()} for i, r in enumerate(rows)]

    def eval_batch(self, data_iter: Iterator) -> float:
        """Mean loss of one global batch, forward only, no step."""
        for stage in self.stages.values():
            stage.eval()
        mbs = self._next_global_batch(data_iter)
        actions = forward_only(self.schedule)[self.ctx.pp_rank]
        losses = self._executor(mbs[0][0]).run(actions, mbs, loss_divisor=self.m, grad=False)
        return self._mean_loss(losses)
