"""PipelineEngine: one global batch = every micro-batch of a schedule, then one optimizer step.

Micro-batching *is* gradient accumulation: each micro-batch loss is multiplied by 1/m before its
backward (DESIGN.md invariant 5), so after the schedule the gradients are those of the mean loss
over the replica's micro-batches, exactly as single-process accumulation over the same
micro-batches.

On the (pp, tp, dp) grid (`mp_toolkit.parallel.context`, tp fastest, then dp, then pp):

* tensor parallelism is applied by the caller before the layer list reaches the engine
  (``apply_tensor_parallel(layer_list, ctx, TP_PLAN)``); the engine cuts the sharded list into
  stages like any other. Activations between stages are replicated (B, T, C) on every tp rank,
  so each rank exchanges them only with the neighbouring stages of its own (tp_rank, dp_rank)
  (`ParallelContext.stage_rank`). The last stage's loss_fn is then
  ``vocab_parallel_cross_entropy`` over ``ctx.tp_group``, on local (B, T, V / tp) logits.
* data parallelism: each replica runs m micro-batches of its own with the loss scaled by 1/m;
  the gradients are then averaged over ``ctx.dp_group`` (`mp_toolkit.parallel.data_parallel`,
  bucketed, each stage's buckets posted as soon as its last backward has run), so the step acts on
  the gradient of the global batch's mean loss: dp x m micro-batches.

After the schedule, `mp_toolkit.engine.step.OptimizerStep` closes the batch (data-parallel
average, unscale, tied gradients, overflow consensus, global-norm clip, step, copy back) in the
order written there.

Launch (each rank runs the same program)::

    torchrun --nproc_per_node 8 -m mp_toolkit.cli train --model gpt-tiny --pp 2 --tp 2 --dp 2
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

import torch

from mp_toolkit.engine.embedding_rows import accumulate_by_rows
from mp_toolkit.engine.executor import Executor, final_weight_grad_actions
from mp_toolkit.engine.interface import StepStats
from mp_toolkit.engine.reductions import global_mean_loss, trust_ratio_rows
from mp_toolkit.engine.shapes import ShapePass
from mp_toolkit.engine.step import OptimizerStep
from mp_toolkit.engine.ties import TiedGradients
from mp_toolkit.engine.zero import ShardedMasters
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.groups import is_tensor_parallel
from mp_toolkit.optim.loss_scaler import DynamicLossScaler
from mp_toolkit.optim.master import MasterWeights, precision_dtype
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.data_parallel import BUCKET_BYTES, DataParallelGrads
from mp_toolkit.parallel.host_staging import make_p2p
from mp_toolkit.parallel.layouts import TP_ATTRIBUTES
from mp_toolkit.parallel.zero import ShardedGrads, sharded_buckets
from mp_toolkit.schedule import Kind, Schedule, get_schedule, validate
from mp_toolkit.schedule.completion import send_waits


def forward_only(schedule: Schedule) -> tuple[tuple, ...]:
    """Each rank's actions without backward or gradient traffic (evaluation)."""
    keep = {Kind.F, Kind.SEND_F, Kind.RECV_F}
    return tuple(tuple(a for a in acts if a.kind in keep) for acts in schedule.actions)


def carry_tp_attributes(masters: MasterWeights) -> None:
    """Give each fp32 master its model parameter's sharding attributes: clipping and LAMB / LARS
    read them from the tensors they see, which under fp16 / bf16 are the masters."""
    for p, m in zip(masters.model, masters.master):
        if m is not p:
            for name in TP_ATTRIBUTES:
                if hasattr(p, name):
                    setattr(m, name, getattr(p, name))


class PipelineEngine:
    """Trains the stages of a LayerList that this rank holds (one, or v under interleaving).

    Args:
        layer_list: the whole model as a LayerList (built alike on every rank; the layers of other
            ranks' stages may stay on the meta device, `mp_toolkit.parallel.materialize`), already
            tensor-parallel (this rank's shards) when ``ctx.tp > 1``.
        ctx: this rank's ParallelContext.
        boundaries: partition ``[0, b1, ..., len(layer_list)]`` with ``ctx.pp * chunks`` stages.
        microbatches: m, micro-batches per global batch on each data-parallel replica.
        schedule: schedule name ("gpipe", "1f1b", "interleaved", "zbh1", "zbdrain", "zbv", "dualpipev"), or the
            `Schedule` itself (``microbatches`` and ``chunks`` must be its own). The schedule's ``stage_to_rank``
            places the stages: this rank builds those on its pipeline rank, a neighbour on the same rank takes
            its activations and gradients locally, the loss is reported from the last stage's rank.
        optimizer: callable([(name, param), ...]) -> torch.optim.Optimizer over this stage's
            (fp32 master) parameters, named as in the unsplit LayerList (LAMB / LARS built with
            ``tp_group=ctx.tp_group``, so their trust ratios use whole-tensor norms).
        loss_fn: (last stage output, labels) -> mean loss of one micro-batch (with tp > 1,
            ``vocab_parallel_cross_entropy`` over ``ctx.tp_group``).
        clip_grad: max global gradient norm, or None for no clipping.
        precision: "fp32", "fp16" or "bf16": the dtype the stage computes and communicates in;
            the optimizer always holds fp32 masters.
        loss_scaler: scaler of the loss before backward (fp16); None means a scale of 1.
        chunks: stages per rank (`mp_toolkit.names.stages_per_rank`; None: the schedule's default):
            interleaved 1F1B's model chunks (stage s on pipeline rank s % pp), 2 for the V schedules.
        dp_bucket_bytes: size of the data-parallel gradient buckets (fp32 bytes).
        free_sent_outputs: free a stage output's storage once its send to the next stage's rank
            has completed, keeping its autograd graph for the backward (Megatron-LM's
            ``deallocate_output_tensor``; which outputs qualify: `mp_toolkit.engine.free_sent`).
            Gradients are bitwise those of False, where each sent output's storage lives until
            its backward and, through its send buffer, until the end of the step.
        zero: ZeRO stage, 0 or 1. 1: the fp32 masters and the optimizer state are partitioned over
            ``ctx.dp_group`` (`mp_toolkit.engine.zero`): gradients reduce-scattered in the same
            buckets, each replica steps its pieces, parameters all-gathered. The optimizer is then
            built over this rank's 1-D pieces, named after their parameters. No effect at dp 1.
    """

    def __init__(self, layer_list: LayerList, ctx: ParallelContext, boundaries: Sequence[int],
                 microbatches: int, schedule: str | Schedule, optimizer: Callable, loss_fn: Callable,
                 clip_grad: float | None = None, precision: str = "fp32",
                 loss_scaler: DynamicLossScaler | None = None, chunks: int | None = None,
                 dp_bucket_bytes: int = BUCKET_BYTES, free_sent_outputs: bool = True, zero: int = 0):
        if ctx.tp > 1 and not any(is_tensor_parallel(p) for p in layer_list.parameters()):
            raise ValueError(f"tp={ctx.tp} but no parameter of the layer list is tensor-parallel: "
                             "apply_tensor_parallel(layer_list, ctx, plan) before building the engine")
        self.schedule = (schedule if isinstance(schedule, Schedule)  # built once by the caller (`run.plan`)
                         else get_schedule(schedule, ctx.pp, microbatches, chunks=chunks))
        validate(self.schedule)
        n_stages = self.schedule.num_stages
        if len(boundaries) != n_stages + 1:
            raise ValueError(f"partition {list(boundaries)} has {len(boundaries) - 1} stages, expected {n_stages}"
                             f" (--pp {ctx.pp} x {n_stages // ctx.pp} stages per rank)")
        self.ctx, self.boundaries, self.microbatches = ctx, list(boundaries), microbatches
        dtype = precision_dtype(precision)
        self.stages = {s: layer_list.slice(boundaries[s], boundaries[s + 1], s).to(ctx.device, dtype)
                       for s in self.schedule.stages_of(ctx.pp_rank)}
        for stage in self.stages.values():  # embedding gradients without a dense (V, C) temporary per micro-batch
            accumulate_by_rows(stage)
        self.stage = self.stages[min(self.stages)]  # the first (with one chunk: the only) stage
        self.ties = TiedGradients(layer_list, boundaries, ctx, self.stages, self.schedule.stage_to_rank)
        self.p2p = make_p2p(ctx.device) if ctx.pp > 1 else None  # CUDA over gloo: staged through the host
        self.stage_to_rank = [ctx.stage_rank(i) for i in self.schedule.stage_to_rank]
        self.loss_fn = loss_fn
        named = self.named_parameters()
        if zero not in (0, 1):
            raise ValueError(f"zero={zero}: ZeRO stage 0 (off) or 1 (optimizer state partitioned) only")
        # the gradients of the ranks holding the same parameters -- dp replicas, and context-parallel
        # slices of the same sequences -- are averaged over grad_group (the dp group without cp)
        self.zero = zero if ctx.grad_group is not None else 0
        if self.zero:
            tied = [self.ties.members[g] for g in self.ties.groups]  # a bucket each: pieces line up over stages
            buckets = sharded_buckets(self._dp_param_sets(), ctx.grad_size, dp_bucket_bytes, alone=tied)
            self.dp_grads = ShardedGrads(buckets, ctx.grad_group)
            self.masters = ShardedMasters([p for _, p in named], buckets, self.dp_grads, ctx.grad_group)
            self.optimizer = optimizer(self.masters.named(named))
        else:
            self.masters = MasterWeights([p for _, p in named])
            carry_tp_attributes(self.masters)
            self.optimizer = optimizer([(n, m) for (n, _), m in zip(named, self.masters.master)])
            self.dp_grads = (DataParallelGrads(self._dp_param_sets(), ctx.grad_group, dp_bucket_bytes)
                             if ctx.grad_group is not None else None)
        stage_of: dict[int, int] = {}
        for index in sorted(self.stages):  # a parameter of two local stages (a tie) counts at the first
            for _, p in self.stages[index].named_layer_parameters():
                stage_of.setdefault(id(p), index)
        self.step = OptimizerStep(ctx, self.masters, self.optimizer, self.ties, clip_grad, loss_scaler,
                                  self.dp_grads, stage_of)
        self.free_sent_outputs = free_sent_outputs
        # what each stage receives, agreed per shape of the first stage's inputs (micro-batches may
        # differ in length, within a run and across runs: `mp_toolkit.engine.shapes`)
        self.shapes = ShapePass(self.stages, self.stage_to_rank, ctx.rank, self.p2p)
        self.executor = Executor(self.stages, self.stage_to_rank, ctx.rank, self.p2p, self.shapes, loss_fn,
                                 free_sent_outputs=free_sent_outputs)
        # when this rank may wait for each of its forward sends (pure data, from the whole schedule)
        self._send_waits = send_waits(self.schedule)[ctx.pp_rank] if ctx.pp > 1 and free_sent_outputs else None

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters over all its stages, named as in the unsplit LayerList."""
        seen, out = set(), []
        for index in sorted(self.stages):
            for name, p in self.stages[index].named_layer_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def _dp_param_sets(self) -> dict[int, list[torch.nn.Parameter]]:
        """Stage -> the parameters whose gradients are complete once that stage's last backward has
        run: a parameter two local stages share (a tie within this rank) goes with the later one."""
        done_at = {s: i for i, s in final_weight_grad_actions(self.schedule.rank_actions(self.ctx.pp_rank)).items()}
        owner: dict[int, int] = {}
        for s in sorted(self.stages, key=lambda s: done_at.get(s, -1)):
            for _, p in self.stages[s].named_layer_parameters():
                owner[id(p)] = s  # a later-finishing stage overwrites
        sets: dict[int, list[torch.nn.Parameter]] = {s: [] for s in sorted(self.stages)}
        for _, p in self.named_parameters():
            sets[owner[id(p)]].append(p)
        return sets

    def _next_global_batch(self, data_iter: Iterator) -> list:
        mbs = list(itertools.islice(data_iter, self.microbatches))
        if len(mbs) < self.microbatches:
            raise ValueError(f"data iterator ran out after {len(mbs)} of {self.microbatches} micro-batches")
        dev = self.ctx.device
        move = lambda x: tuple(t.to(dev) for t in x) if isinstance(x, tuple) else x.to(dev)
        return [(move(x), move(y)) for x, y in mbs]

    def train_batch(self, data_iter: Iterator) -> StepStats:
        """Run every micro-batch of one global batch and take one optimizer step.

        ``data_iter`` yields this data-parallel replica's micro-batches (the same on every tp and
        pp rank of the replica); the reported loss is the mean over all replicas. Micro-batches may
        differ in length (sequence length, or any shape of the first stage's inputs): each new
        shape is agreed by the pipeline's ranks once, then cached (`mp_toolkit.engine.shapes`).
        """
        for stage in self.stages.values():
            stage.train()
        mbs = self._next_global_batch(data_iter)
        actions = self.schedule.rank_actions(self.ctx.pp_rank)
        post = self.dp_grads.start_grad_sync if self.dp_grads is not None else None
        losses = self.executor.run(actions, mbs, microbatches=self.microbatches, loss_scale=self.step.loss_scale,
                                               on_grads_final=post, send_waits=self._send_waits)
        result = self.step(nonfinite_loss=bool(losses) and not bool(torch.stack(losses).isfinite().all()))
        return StepStats(loss=global_mean_loss(losses, self.ctx, self.stage_to_rank[-1]), grad_norm=result.grad_norm,
                         skipped=result.skipped, loss_scale=result.loss_scale, nonfinite=result.nonfinite)

    def trust_ratio_stats(self) -> list[dict] | None:
        """Per pipeline rank min / median / max of the last step's trust ratios (LAMB, LARS), on every rank."""
        return trust_ratio_rows(self.optimizer, self.ctx)

    @property
    def scaler(self) -> DynamicLossScaler | None:
        """The fp16 loss scaler (None: fp32 / bf16, a scale of 1)."""
        return self.step.scaler

    def master_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 master the optimizer steps for model parameter ``p`` (``p`` itself in fp32);
        under ZeRO-1 this rank's 1-D piece of it (`ShardedMasters.of`)."""
        return self.masters.of(p)

    def layer_names(self) -> list[str]:
        """The layers of this rank's stages, in stage order."""
        return [name for index in sorted(self.stages) for name in self.stages[index].names]

    def copy_back(self) -> None:
        """Masters -> model parameters (after loading masters from a checkpoint)."""
        self.masters.copy_back()

    def eval_batch(self, data_iter: Iterator) -> float:
        """Mean loss of one global batch (all data-parallel replicas), forward only, no step."""
        return global_mean_loss(self._forward_only(data_iter), self.ctx, self.stage_to_rank[-1])

    def eval_metrics(self, data_iter: Iterator, metrics_fn: Callable, size: int) -> list[float]:
        """`eval_batch` with ``metrics_fn(last stage output, labels)`` -> a (size,) fp32 tensor per
        micro-batch in place of the loss, each value averaged over the global batch as the loss is
        (validation's MLM / NSP losses and MLM accuracy, `mp_toolkit.run.validation`)."""
        return global_mean_loss(self._forward_only(data_iter, metrics_fn), self.ctx, self.stage_to_rank[-1], size)

    def _forward_only(self, data_iter: Iterator, metrics_fn: Callable | None = None) -> list[torch.Tensor]:
        """One global batch forward through this rank's forward actions; the last stage's values / m."""
        for stage in self.stages.values():
            stage.eval()
        mbs = self._next_global_batch(data_iter)
        actions = forward_only(self.schedule)[self.ctx.pp_rank]
        executor = self.executor
        loss_fn = executor.loss_fn
        executor.loss_fn = metrics_fn or loss_fn
        try:
            return executor.run(actions, mbs, microbatches=self.microbatches, grad=False)
        finally:
            executor.loss_fn = loss_fn
