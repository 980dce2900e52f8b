"""The training loop every rank runs: build model, shard and cut it, feed micro-batches, step, log.

Entry point (each rank)::

    torchrun --nproc_per_node 2 -m mp_toolkit.cli train --model gpt-small-cpu --pp 2 --schedule 1f1b
    torchrun --nproc_per_node 8 -m mp_toolkit.cli train --model gpt-small-cpu --pp 2 --tp 2 --dp 2
    mpt train --model gpt-small-cpu --pp 2 --tp 2   # starts the 4 ranks itself
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from model_zoo.gpt import GPT, TP_PLAN, get_config, lm_loss
from mp_toolkit.config import ConfigError, TrainConfig, parse_boundaries
from mp_toolkit.engine.pipeline import PipelineEngine
from mp_toolkit.launch import LaunchEnv, init_distributed
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.factory import build_optimizer
from mp_toolkit.optim.loss_scaler import DynamicLossScaler
from mp_toolkit.optim.lr import WarmupDecay, set_lr
from mp_toolkit.optim.master import resolve_precision
from mp_toolkit.memstats import map_large_blocks, peak_rss_bytes, release_free_memory, reset_peak, rss_bytes, warm_runtime
from mp_toolkit.parallel.context import ParallelContext, build_context
from mp_toolkit.parallel.tensor_parallel import apply_tensor_parallel, check_tensor_parallel, vocab_parallel_cross_entropy
from mp_toolkit.partition import PartitionError, by_parameters, explicit, uniform
from mp_toolkit.schedule import get_schedule


def model_config(cfg: TrainConfig):
    """The GPT config named by ``cfg.model``, with the sequence length checked against it."""
    try:
        gpt = get_config(cfg.model)
    except (OSError, ValueError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    if cfg.seq_len > gpt.n_positions:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's n_positions {gpt.n_positions}: use at most {gpt.n_positions}")
    return gpt


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


def validate(cfg: TrainConfig) -> None:
    """Every check that needs no process group: fail before any rank starts."""
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
    for name in ("warmup_steps", "loss_scale_window", "hysteresis", "initial_scale_power"):
        if getattr(cfg, name) < (0 if name in ("warmup_steps", "initial_scale_power") else 1):
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)} is out of range")
    if cfg.min_lr > cfg.lr:
        raise ConfigError(f"--min-lr {cfg.min_lr} exceeds --lr {cfg.lr}: the decay must end at or below the peak")
    if cfg.data not in ("stdlib", "synthetic"):
        path = Path(cfg.data)
        if not path.exists() or not os.access(path, os.R_OK):
            raise ConfigError(f"--data {cfg.data!r} is not a readable file or folder (or use stdlib / synthetic)")
    gpt = model_config(cfg)
    try:
        check_tensor_parallel(cfg.tp, n_head=gpt.n_head, hidden=gpt.n_embd, inner=gpt.inner_size, vocab=gpt.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    with torch.device("meta"):
        layers = LayerList.from_model(GPT(gpt))
    plan_boundaries(layers, cfg.pp, cfg.partition, cfg.chunks)
    try:
        get_schedule(cfg.schedule, cfg.pp, cfg.microbatches, num_chunks=cfg.chunks)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def loss_function(ctx: ParallelContext):
    """The last stage's loss: cross-entropy of full logits, or, with tp > 1, its vocab-parallel
    form on the local (B, T, V / tp) logits (never gathered)."""
    if ctx.tp_group is None:
        return lm_loss
    return functools.partial(vocab_parallel_cross_entropy, group=ctx.tp_group)


def build_engine(cfg: TrainConfig, ctx: ParallelContext, model: GPT) -> PipelineEngine:
    """Compose the parallelisms over a plain single-device GPT, for this rank. The order matters:

    1. Plan the pipeline cut on the *unsplit* layer list (boundaries are data), so every tp degree
       cuts the model at the same layers.
    2. Tensor parallelism: `apply_tensor_parallel` swaps the modules TP_PLAN names for this rank's
       shards over the whole list at once, so the tied embedding and LM head, which may land on
       different stages, are split alike (and stay one Parameter where one stage holds both).
       It must come before the cut: a stage is a slice of whatever modules the list holds.
    3. Pipeline: the engine keeps this rank's stages of the sharded list; the others are freed
       with ``model`` once the caller drops it.
    4. Data parallelism last: the engine averages each stage's gradients over ``ctx.dp_group``
       once its backward is done; nothing is wrapped, the modules stay plain.

    ``model`` must be built identically on every rank (same seed): each keeps its own slice.
    """
    layers = LayerList.from_model(model)
    boundaries = plan_boundaries(layers, cfg.pp, cfg.partition, cfg.chunks)  # 1
    layers = apply_tensor_parallel(layers, ctx, TP_PLAN)  # 2
    tp_group = ctx.tp_group  # LAMB / LARS: whole-tensor norms of the shards in their trust ratios
    return PipelineEngine(  # 3 and 4
        layers, ctx, boundaries, cfg.microbatches, cfg.schedule,
        optimizer=lambda named: build_optimizer(cfg.optimizer, named, cfg.lr, cfg.weight_decay, tp_group=tp_group),
        loss_fn=loss_function(ctx), clip_grad=cfg.clip_grad, precision=cfg.precision, loss_scaler=loss_scaler(cfg),
        chunks=cfg.chunks, dp_bucket_bytes=max(1, int(cfg.dp_bucket_mb * 2**20)),
    )


def loss_scaler(cfg: TrainConfig) -> DynamicLossScaler | None:
    """fp16 scales the loss (static when --loss-scale > 0); fp32 and bf16 need no scaling."""
    if cfg.precision != "fp16":
        return None
    return DynamicLossScaler(
        initial_scale_power=cfg.initial_scale_power, loss_scale_window=cfg.loss_scale_window,
        hysteresis=cfg.hysteresis, min_loss_scale=cfg.min_loss_scale,
        static_scale=cfg.loss_scale if cfg.loss_scale > 0 else None,
    )


def _dataset(cfg: TrainConfig, vocab_size: int, rank: int):
    """Rank 0 builds first (training and caching the tokenizer); the others then load the cache."""
    from mp_toolkit.data import build_lm_dataset  # datasets is slow to import; validation needs none of it

    build = lambda: build_lm_dataset(cfg.data, vocab_size, cfg.seq_len, cfg.seed, cfg.cache_dir)
    distributed = dist.is_initialized()
    ds = build() if rank == 0 else None
    if distributed:
        dist.barrier()
    return ds if ds is not None else build()


class MetricsLog:
    """Rank 0's per-step record: JSON lines, progress bar, loss plot."""

    def __init__(self, cfg: TrainConfig, enabled: bool):
        self.cfg, self.enabled, self.rows = cfg, enabled, []
        self.file = open(cfg.metrics, "w") if enabled and cfg.metrics else None
        self.bar = None
        if enabled and cfg.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=cfg.steps, desc="train", file=sys.stderr, dynamic_ncols=True)

    def step(self, row: dict) -> None:
        if not self.enabled:
            return
        self.rows.append(row)
        if self.file:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.bar:
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
            self.bar.update(1)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar:
            self.bar.close()
        if self.file:
            self.file.close()
        if self.cfg.plot and self.rows:
            plot_losses(self.rows, self.cfg.plot)
        first, last = self.rows[0], self.rows[-1]
        timed = self.rows[1:] or self.rows  # the first step includes the one-time shape pass
        tok_s = sum(r["tokens_per_s"] for r in timed) / len(timed)
        skipped = sum(bool(r.get("skipped")) for r in self.rows)
        print(f"loss {first['loss']:.4f} -> {last['loss']:.4f} over {len(self.rows)} steps, "
              f"{tok_s:.0f} tokens/s, {skipped} skipped, loss scale {last['loss_scale']:g}")
        for t in last.get("trust_ratio", []):
            print(f"  stage {t['stage']} trust ratio min {t['min']:.4g} median {t['median']:.4g} max {t['max']:.4g}")
        if self.cfg.metrics:
            print(f"metrics: {self.cfg.metrics}")
        if self.cfg.plot:
            print(f"loss plot: {self.cfg.plot}")


def _gather_ints(value: int) -> list[int]:
    """``value`` of every rank, in rank order (a plain list on one process)."""
    mine = torch.tensor([value], dtype=torch.int64)
    if not dist.is_initialized():
        return [value]
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [int(r.item()) for r in rows]


def plot_losses(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_training(cfg: TrainConfig, env: LaunchEnv) -> list[dict]:
    """Train on this rank; returns the per-step rows on rank 0 (empty elsewhere)."""
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // env.local_world_size))
    device = init_distributed(env, cfg.timeout_s)
    try:
        return _train(cfg, env, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, env: LaunchEnv, device: torch.device) -> list[dict]:
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, device))
    if env.rank == 0:
        print(f"precision {cfg.precision}, optimizer {cfg.optimizer}, schedule {cfg.schedule}, "
              f"pp {cfg.pp}, tp {cfg.tp}, dp {cfg.dp}")
    ctx = build_context(cfg.pp, cfg.tp, cfg.dp, device=device)
    gpt = model_config(cfg)
    from mp_toolkit.data import DataError, MicroBatches

    try:
        # every rank of a data-parallel replica (its tp and pp ranks) reads the same shard
        data = MicroBatches(_dataset(cfg, gpt.vocab_size, env.rank), cfg.micro_batch,
                            dp_rank=ctx.dp_rank, dp_size=ctx.dp, seed=cfg.seed)
    except DataError as e:
        raise ConfigError(str(e)) from None
    map_large_blocks()  # RSS then follows live tensors: freed blocks go back to the system
    warm_runtime()  # torch's one-time costs (lazy imports, kernel set-up) before the baseline
    base_rss = rss_bytes()  # what the model, its activations and optimizer add is measured from here
    torch.manual_seed(cfg.seed)  # every rank builds the same full model, then keeps its shard of its stage
    engine = build_engine(cfg, ctx, GPT(gpt))
    schedule = WarmupDecay(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.lr_decay, cfg.min_lr)
    release_free_memory()
    reset_peak()
    log = MetricsLog(cfg, enabled=env.rank == 0)
    for step in range(1, cfg.steps + 1):
        lr = schedule(step)
        set_lr(engine.optimizer, lr)
        t0 = time.perf_counter()
        stats = engine.train_batch(data)
        dt = time.perf_counter() - t0
        row = {"step": step, "loss": stats.loss, "lr": lr, "grad_norm": stats.grad_norm,
               "tokens_per_s": cfg.tokens_per_step / dt, "step_time_s": dt,
               "loss_scale": stats.loss_scale, "skipped": stats.skipped}
        trust = engine.trust_ratio_stats()
        if trust is not None:
            row["trust_ratio"] = trust
        if step == cfg.steps:
            row["peak_memory_bytes"] = _gather_ints(peak_rss_bytes() - base_rss)
        if step == 1:  # steady state: later steps' peak (the first adds one-time shape agreement)
            reset_peak()
        log.step(row)
    log.close()
    return log.rows
