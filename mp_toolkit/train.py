"""The training loop every rank runs: build model, shard and cut it, feed micro-batches, step, log, save.

Entry point (each rank)::

    torchrun --nproc_per_node 2 -m mp_toolkit.cli train --model gpt-small-cpu --pp 2 --schedule 1f1b
    torchrun --nproc_per_node 8 -m mp_toolkit.cli train --model gpt-small-cpu --pp 2 --tp 2 --dp 2
    deepspeed --num_gpus 8 recipes/bert_pretrain/train.py --deepspeed_config recipes/bert_pretrain/ds_config.json
    mpt train --model bert-tiny --seq-len 64 --pp 2 --save-dir runs/bert --save-every 50   # starts the ranks itself
    mpt train --model bert-tiny --seq-len 64 --pp 1 --tp 2 --save-dir runs/bert --resume latest  # another layout
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mp_toolkit.config import ConfigError, TrainConfig, parse_boundaries
from mp_toolkit.engine.pipeline import PipelineEngine
from mp_toolkit.launch import LaunchEnv, init_distributed
from mp_toolkit.layers import LayerList
from mp_toolkit.memstats import map_large_blocks, peak_rss_bytes, release_free_memory, reset_peak, rss_bytes, warm_runtime
from mp_toolkit.metrics_log import MetricsLog, gather_ints
from mp_toolkit.optim.factory import OptimizerOptions, build_optimizer, check_optimizer_options
from mp_toolkit.optim.loss_scaler import DynamicLossScaler
from mp_toolkit.optim.lr import WarmupDecay, set_lr
from mp_toolkit.optim.master import resolve_precision
from mp_toolkit.parallel.context import ParallelContext, build_context
from mp_toolkit.parallel.tensor_parallel import apply_tensor_parallel, check_tensor_parallel
from mp_toolkit.partition import PartitionError, by_parameters, explicit, uniform
from mp_toolkit.schedule import get_schedule
from mp_toolkit.train_models import TP_PLANS, ModelSpec, family_of, loss_function, micro_batches, resolve_model
from mp_toolkit.train_state import ModelNames, Progress, find_checkpoint, load_state, manifest, save_state

__all__ = ["MetricsLog", "build_engine", "plan_boundaries", "run_training", "validate"]


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The model ``cfg.model`` names, with the sequence length checked against it."""
    spec = resolve_model(cfg.model)
    if cfg.seq_len > spec.positions:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds {cfg.model}'s {spec.positions} positions: "
                          f"use at most {spec.positions}")
    return spec


def plan_boundaries(layer_list: LayerList, pp: int, partition: str, chunks: int = 1) -> list[int]:
    """Boundaries of ``pp * chunks`` stages by method name or explicit ``0,3,7`` text."""
    n = len(layer_list)
    if pp * chunks > n:
        what = f"--pp {pp}" if chunks == 1 else f"--pp {pp} x --chunks {chunks} = {pp * chunks} stages"
        raise ConfigError(f"{what} exceeds the model's {n} layers ({', '.join(layer_list.names)}): use at most {n}")
    pp = pp * chunks
    given = parse_boundaries(partition)
    try:
        if given is not None:
            return explicit(given, n, pp)
        if partition == "uniform":
            return uniform(n, pp)
        return by_parameters(layer_list.layer_parameter_counts(), pp)
    except PartitionError as e:
        raise ConfigError(f"--partition {partition}: {e}") from None


def _validate_numbers(cfg: TrainConfig) -> None:
    for name in ("pp", "tp", "dp", "microbatches", "micro_batch", "seq_len", "steps"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)} must be at least 1")
    for name in ("lr", "min_lr", "weight_decay", "loss_scale", "min_loss_scale"):
        value = getattr(cfg, name)
        if not (value >= 0 and math.isfinite(value)) or (name == "lr" and value == 0):
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be a {'positive' if name == 'lr' else 'non-negative'} finite number")
    if not (cfg.dp_bucket_mb > 0 and math.isfinite(cfg.dp_bucket_mb)):
        raise ConfigError(f"--dp-bucket-mb {cfg.dp_bucket_mb} must be a positive finite number")
    if cfg.clip_grad is not None and not (cfg.clip_grad > 0 and math.isfinite(cfg.clip_grad)):
        raise ConfigError(f"--clip-grad {cfg.clip_grad} must be a positive finite number (or none)")
    for name in ("warmup_steps", "loss_scale_window", "hysteresis", "initial_scale_power", "save_every"):
        if getattr(cfg, name) < (0 if name in ("warmup_steps", "initial_scale_power", "save_every") else 1):
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)} is out of range")
    if cfg.min_lr > cfg.lr:
        raise ConfigError(f"--min-lr {cfg.min_lr} exceeds --lr {cfg.lr}: the decay must end at or below the peak")
    try:
        check_optimizer_options(cfg.optimizer, OptimizerOptions.of(cfg))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _validate_paths(cfg: TrainConfig) -> None:
    if cfg.data not in ("stdlib", "synthetic"):
        path = Path(cfg.data)
        if not path.exists() or not os.access(path, os.R_OK):
            raise ConfigError(f"--data {cfg.data!r} is not a readable file or folder (or use stdlib / synthetic)")
    if cfg.keep is not None and cfg.keep < 1:
        raise ConfigError(f"--keep {cfg.keep} must be at least 1 (0 keeps every checkpoint)")
    if cfg.resume == "latest" and cfg.save_dir is None:
        raise ConfigError("--resume latest needs --save-dir (the checkpoint root it resumes from), or give --resume DIR")
    if cfg.resume not in (None, "latest") and not Path(cfg.resume).is_dir():
        raise ConfigError(f"--resume {cfg.resume}: no such checkpoint directory")
    if cfg.save_every and cfg.save_dir is None:
        raise ConfigError(f"--save-every {cfg.save_every} needs --save-dir")


def validate(cfg: TrainConfig) -> None:
    """Every check that needs no process group: fail before any rank starts."""
    _validate_numbers(cfg)
    _validate_paths(cfg)
    spec = model_spec(cfg)
    try:
        check_tensor_parallel(cfg.tp, **spec.tp_sizes())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    with torch.device("meta"):
        layers = LayerList.from_model(spec.build())
    plan_boundaries(layers, cfg.pp, cfg.partition, cfg.chunks)
    try:
        get_schedule(cfg.schedule, cfg.pp, cfg.microbatches, num_chunks=cfg.chunks)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_engine(cfg: TrainConfig, ctx: ParallelContext, model: torch.nn.Module) -> PipelineEngine:
    """Compose the parallelisms over a plain single-device GPT or BERT, for this rank. The order matters:

    1. Plan the pipeline cut on the *unsplit* layer list (boundaries are data), so every tp degree
       cuts the model at the same layers.
    2. Tensor parallelism: `apply_tensor_parallel` swaps the modules the model's TP plan names for
       this rank's shards over the whole list at once, so the tied embedding and LM head (MLM
       decoder), which may land on different stages, are split alike (and stay one Parameter where
       one stage holds both). It must come before the cut: a stage is a slice of whatever modules
       the list holds.
    3. Pipeline: the engine keeps this rank's stages of the sharded list; the others are freed
       with ``model`` once the caller drops it.
    4. Data parallelism last: the engine averages each stage's gradients over ``ctx.dp_group``
       once its backward is done; nothing is wrapped, the modules stay plain.

    ``model`` must be built identically on every rank (same seed): each keeps its own slice.
    """
    family = family_of(model)
    layers = LayerList.from_model(model)
    boundaries = plan_boundaries(layers, cfg.pp, cfg.partition, cfg.chunks)  # 1
    layers = apply_tensor_parallel(layers, ctx, TP_PLANS[family])  # 2
    tp_group = ctx.tp_group  # LAMB / LARS: whole-tensor norms of the shards in their trust ratios
    options = OptimizerOptions.of(cfg)
    return PipelineEngine(  # 3 and 4
        layers, ctx, boundaries, cfg.microbatches, cfg.schedule,
        optimizer=lambda named: build_optimizer(cfg.optimizer, named, cfg.lr, cfg.weight_decay, tp_group=tp_group,
                                                options=options),
        loss_fn=loss_function(family, ctx), clip_grad=cfg.clip_grad, precision=cfg.precision,
        loss_scaler=loss_scaler(cfg), chunks=cfg.chunks, dp_bucket_bytes=max(1, int(cfg.dp_bucket_mb * 2**20)),
    )


def loss_scaler(cfg: TrainConfig) -> DynamicLossScaler | None:
    """fp16 scales the loss (static when --loss-scale > 0); fp32 and bf16 need no scaling."""
    if cfg.precision != "fp16":
        return None
    return DynamicLossScaler(
        initial_scale_power=cfg.initial_scale_power, loss_scale_window=cfg.loss_scale_window,
        hysteresis=cfg.hysteresis, min_loss_scale=cfg.min_loss_scale,
        consecutive_hysteresis=cfg.consecutive_hysteresis,
        static_scale=cfg.loss_scale if cfg.loss_scale > 0 else None,
    )


def lr_at(cfg: TrainConfig, progress: Progress, step: int) -> float:
    """The rate of optimizer step ``step``. A DeepSpeed schedule counts applied steps only (its engine
    does not step the scheduler after an fp16 overflow); WarmupDecay counts every step."""
    if cfg.lr_schedule is not None:
        return cfg.lr_schedule(progress.applied + 1)
    return WarmupDecay(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.lr_decay, cfg.min_lr)(step)


def run_training(cfg: TrainConfig, env: LaunchEnv) -> list[dict]:
    """Train on this rank; returns the per-step rows on rank 0 (empty elsewhere)."""
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // env.local_world_size))
    device = init_distributed(env, cfg.timeout_s)
    try:
        return _train(cfg, env, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _resume(cfg: TrainConfig, engine, ctx, names, data, spec, log_rank0: bool) -> Progress:
    """Progress after restoring ``--resume``'s checkpoint (a fresh Progress without one)."""
    path = find_checkpoint(cfg) if cfg.resume else None
    if path is None:
        if cfg.resume and log_rank0:
            print(f"--resume latest: {cfg.save_dir} holds no committed checkpoint yet, starting from step 0")
        return Progress()
    resumed = load_state(path, cfg, engine, ctx, names, data, spec)
    if log_rank0:
        print(f"resumed from {resumed.path} at step {resumed.progress.step}")
        for note in resumed.notes:
            print(f"  {note}")
    return resumed.progress


def _train(cfg: TrainConfig, env: LaunchEnv, device: torch.device) -> list[dict]:
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, device))
    rank0 = env.rank == 0
    spec = model_spec(cfg)
    if rank0:
        print(f"model {cfg.model} ({spec.family}), precision {cfg.precision}, optimizer {cfg.optimizer}, "
              f"schedule {cfg.schedule}, pp {cfg.pp}, tp {cfg.tp}, dp {cfg.dp}", flush=True)
    ctx = build_context(cfg.pp, cfg.tp, cfg.dp, device=device)
    data, spec = micro_batches(spec, cfg, ctx, env.rank)  # BERT: the model's padding id is the corpus's
    map_large_blocks()  # RSS then follows live tensors: freed blocks go back to the system
    warm_runtime()  # torch's one-time costs (lazy imports, kernel set-up) before the baseline
    base_rss = rss_bytes()  # what the model, its activations and optimizer add is measured from here
    torch.manual_seed(cfg.seed)  # every rank builds the same full model, then keeps its shard of its stage
    model = spec.build()
    names = ModelNames.of(model)
    engine = build_engine(cfg, ctx, model)
    del model
    progress = _resume(cfg, engine, ctx, names, data, spec, rank0)
    if progress.step >= cfg.steps:
        if rank0:
            print(f"the checkpoint is at step {progress.step}, --steps is {cfg.steps}: nothing to train")
        return []
    release_free_memory()
    reset_peak()
    log = MetricsLog(cfg, enabled=rank0, start_step=progress.step)
    first = progress.step + 1
    for step in range(first, cfg.steps + 1):
        lr = lr_at(cfg, progress, step)
        set_lr(engine.optimizer, lr)
        t0 = time.perf_counter()
        stats = engine.train_batch(data)
        dt = time.perf_counter() - t0
        progress.step, progress.applied = step, progress.applied + (not stats.skipped)
        row = {"step": step, "loss": stats.loss, "lr": lr, "grad_norm": stats.grad_norm,
               "tokens_per_s": cfg.tokens_per_step / dt, "step_time_s": dt,
               "loss_scale": stats.loss_scale, "skipped": stats.skipped}
        trust = engine.trust_ratio_stats()
        if trust is not None:
            row["trust_ratio"] = trust
        if step == cfg.steps:
            row["peak_memory_bytes"] = gather_ints(peak_rss_bytes() - base_rss, ctx.device)
        if step == first:  # steady state: later steps' peak (the first adds one-time shape agreement)
            reset_peak()
        log.step(row)
        if cfg.save_dir is not None and (step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0)):
            meta = manifest(cfg, engine, ctx, data, progress, spec, lr) if rank0 else None
            save_state(cfg.save_dir, meta, engine, ctx, names, step, cfg.keep)
            log.note(f"saved step {step} to {cfg.save_dir}")
    log.close()
    return log.rows
