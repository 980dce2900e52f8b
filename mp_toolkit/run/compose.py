"""Compose the parallelisms over a plain model for this rank: our `PipelineEngine`, or DeepSpeed's
behind the same `TrainEngine` interface (``--engine deepspeed``)."""

from __future__ import annotations

import contextlib

import torch

from mp_toolkit.engine.deepspeed_bridge import DeepSpeedPipeline
from mp_toolkit.engine.interface import TrainEngine
from mp_toolkit.engine.pipeline import PipelineEngine
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.factory import build_optimizer
from mp_toolkit.optim.loss_scaler import DynamicLossScaler
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.materialize import is_meta, materialize, rank_layers
from mp_toolkit.run.config import TrainConfig
from mp_toolkit.run.cut import CutWorkload, config_of, plan_boundaries
from mp_toolkit.run.engines import deepspeed_pipeline
from mp_toolkit.run.families import loss_function, tensor_parallel
from mp_toolkit.run.plan import RunPlan
from mp_toolkit.run.recompute_plan import apply_choices, describe


def build_engine(run: RunPlan, ctx: ParallelContext, model: torch.nn.Module, values: bool = True) -> PipelineEngine:
    """Compose the parallelisms over a plain single-device GPT, BERT or HF model, for this rank.
    The order matters:

    1. The pipeline cut of the *unsplit* layer list (boundaries are data, planned once in ``run``,
       `run.plan`), so every tp degree cuts the model at the same layers; with it, which block layers
       of each stage recompute their activations (``--recompute``; auto: chosen with the cut by the
       planner). A ``--partition time`` cut is measured here, on rank 0, and broadcast.
    2. Tensor parallelism: `apply_tensor_parallel` (an HF model: `apply_hf_tensor_parallel`) swaps
       the modules the model's TP plan names for this rank's shards over the whole list at once,
       so the tied embedding and LM head (MLM decoder), which may land on different stages, are
       split alike (and stay one Parameter where one stage holds both). It must come before the
       cut: a stage is a slice of whatever modules the list holds. A model built on the meta
       device is split on meta: shapes only.
    3. Materialise (a meta-built model only): this rank gives its own stages' layers real storage,
       each parameter its tensor-parallel share (`own_layers`, DESIGN.md invariant 9): our GPT and
       BERT draw it from a generator seeded by the parameter's name, an HF directory reads it
       from its safetensors as slices. Every other layer stays on meta and is never allocated.
    4. Pipeline: the engine keeps this rank's stages of the sharded list; the others stay on meta
       (a model built for real: they are freed with ``model`` once the caller drops it).
    5. Data parallelism last: the engine averages each stage's gradients over ``ctx.dp_group``
       once its backward is done (``--zero 1``: reduce-scatters them, each replica steps its
       piece of the masters and optimizer state, and all-gathers the parameters); nothing is
       wrapped, the modules stay plain.
    Recomputation is data on the layers (their ``recompute`` attribute, set after the split, on
    whatever modules the list then holds; `mp_toolkit.recompute`).

    ``model`` must be built identically on every rank (same seed): each keeps its own slice.
    ``values=False`` (a run that resumes): step 3 gives storage only, the checkpoint fills it.
    """
    cfg = run.cfg
    layers = LayerList.from_model(model)
    boundaries = cut_of(run, layers, model, ctx)  # 1
    recompute = list(run.recompute)
    on_meta = is_meta(model)
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        layers = tensor_parallel(model, layers, ctx, cfg.parallel.sequence_parallel,  # 2: shapes only on meta
                                 cfg.parallel.cp_attention)
    apply_choices(layers, boundaries, recompute)
    if cfg.recomputation.recompute != "none" and ctx.rank == 0:
        print(f"--recompute {cfg.recomputation.recompute}: {describe(layers, boundaries, recompute)}", flush=True)
    own_layers(model, layers, rank_layers(boundaries, run.stages_of(ctx.pp_rank)), ctx, values)  # 3
    tp_group = ctx.tp_group  # LAMB / LARS: whole-tensor norms of the shards in their trust ratios
    par = cfg.parallel
    return PipelineEngine(  # 4 and 5
        layers, ctx, boundaries, cfg.batch.microbatches, run.schedule,
        optimizer=lambda named: build_optimizer(cfg.optim, named, tp_group=tp_group),
        loss_fn=loss_function(model, ctx), clip_grad=cfg.optim.clip_grad, precision=cfg.numerics.precision,
        loss_scaler=loss_scaler(cfg), chunks=par.chunks, dp_bucket_bytes=max(1, int(par.dp_bucket_mb * 2**20)),
        zero=par.zero,
    )


def deepspeed_engine(run: RunPlan, ctx: ParallelContext, model: torch.nn.Module,
                     values: bool = True) -> DeepSpeedPipeline:
    """``--engine deepspeed``: DeepSpeed's PipelineEngine handed the cut `build_engine` plans for ours (a
    "time" cut is measured on rank 0 and broadcast over ``ctx``), the same loss and optimizer
    (`mp_toolkit.engine.deepspeed_bridge`; DeepSpeed is imported only then). No tensor parallelism (`check_engine`)."""
    cfg = run.cfg
    layers = LayerList.from_model(model)
    boundaries = cut_of(run, layers, model, ctx)
    keep = rank_layers(boundaries, [ctx.pp_rank])  # its PipelineModule's stage, and whole tie groups (TiedLayers)
    held = {layers.names[i] for i in keep}
    tied = [layers.names.index(name) for group in layers.tie_groups if any(m in held for m, _ in group)
            for name, _ in group]
    own_layers(model, layers, sorted({*keep, *tied}), ctx, values)
    return deepspeed_pipeline(cfg, ctx, layers, boundaries, loss_function(model, ctx))


def make_engine(run: RunPlan, ctx: ParallelContext, model: torch.nn.Module, values: bool = True) -> TrainEngine:
    """The engine ``run.cfg.engine`` names, over ``model`` (built alike on every rank); ``values=False``
    when a checkpoint will fill every parameter (`own_layers`)."""
    make = build_engine if run.cfg.engine == "mp_toolkit" else deepspeed_engine
    return make(run, ctx, model, values)


def cut_of(run: RunPlan, layers: LayerList, model: torch.nn.Module, ctx: ParallelContext) -> list[int]:
    """The run's cut: the plan's, or under ``--partition time`` the one rank 0 measures now and broadcasts."""
    if run.boundaries[-1] != len(layers):
        raise ValueError(f"the run plan cuts {run.boundaries[-1]} layers but the model has {len(layers)}: "
                         "plan the run for the model it trains")
    if not run.measured_cut:
        return list(run.boundaries)
    par = run.cfg.parallel
    return plan_boundaries(layers, par.pp, par.partition, par.chunks, CutWorkload.of(run.cfg, config_of(model), ctx),
                           par.schedule)


def own_layers(model: torch.nn.Module, layers: LayerList, keep: list[int], ctx: ParallelContext,
               values: bool = True) -> None:
    """When ``model`` was built on meta (`mp_toolkit.parallel.materialize`): give the layers at ``keep``
    real storage on ``ctx.device``, each parameter its share of ``model.initial_value``, or of
    ``model.shard_value`` where the model reads its shares directly (an HF directory's safetensors,
    `mp_toolkit.hf.model.HFModel`). The other layers stay on meta and are never allocated.
    ``values=False``: storage only, for a run that resumes -- its checkpoint fills every parameter,
    so nothing is drawn or read from the HF files first."""
    if any(p.is_meta for p in layers.parameters()):
        if not values:
            materialize(layers, keep, None, ctx, ctx.device)
        else:
            materialize(layers, keep, model.initial_value, ctx, ctx.device,
                        shard_value=getattr(model, "shard_value", None))


def loss_scaler(cfg: TrainConfig) -> DynamicLossScaler | None:
    """fp16 scales the loss (static when --loss-scale > 0); fp32 and bf16 need no scaling."""
    if cfg.numerics.precision != "fp16":
        return None
    return cfg.numerics.scaler()
