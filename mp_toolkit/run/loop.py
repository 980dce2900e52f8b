"""The training loop every rank runs: build model, shard and cut it, feed micro-batches, step, log, save.

Entry point (each rank)::

    torchrun --nproc_per_node 2 -m mp_toolkit.cli train --model gpt-small-cpu --pp 2 --schedule 1f1b
    torchrun --nproc_per_node 8 -m mp_toolkit.cli train --model gpt-small-cpu --pp 2 --tp 2 --dp 2
    deepspeed --num_gpus 8 recipes/bert_pretrain/train.py --deepspeed_config recipes/bert_pretrain/ds_config.json
    mpt train --model bert-tiny --seq-len 64 --pp 2 --save-dir runs/bert --save-every 50   # starts the ranks itself
    mpt train --model bert-tiny --seq-len 64 --pp 1 --tp 2 --save-dir runs/bert --resume latest  # another layout
    mpt train --model gpt-tiny --pp 2 --save-dir runs/x --save-every 20 --restarts 3   # survives dead ranks
    torchrun --nproc_per_node 2 --max-restarts 3 -m mp_toolkit.cli train --model gpt-tiny --pp 2 \
             --save-dir runs/x --save-every 20 --resume auto

A step whose loss or gradients are not finite on any rank is skipped by every rank, in every
precision, and logged; --max-skips such steps in a row stop the run (exit 3) and no checkpoint is
written at such a step, so `latest` stays on the last good one (RELIABILITY.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mp_toolkit.run.config import ConfigError, TrainConfig, parse_boundaries
from mp_toolkit.engine.pipeline import PipelineEngine
from mp_toolkit.checkpoint import latest_step
from mp_toolkit.run.launch import (
    LaunchEnv, PeerLost, Peers, RankStatus, comm_failure_line, init_distributed, is_comm_failure,
)
from mp_toolkit.layers import LayerList
from mp_toolkit.partition.memstats import (keep_freed_memory, peak_rss_bytes, release_free_memory, reset_peak, rss_bytes,
                                 warm_runtime)
from mp_toolkit.run.metrics import MetricsLog, gather_ints
from mp_toolkit.optim.factory import OptimizerOptions, build_optimizer, check_optimizer_options
from mp_toolkit.optim.loss_scaler import DynamicLossScaler
from mp_toolkit.optim.lr import WarmupDecay, set_lr
from mp_toolkit.optim.master import resolve_precision
from mp_toolkit.parallel.context import ParallelContext, build_context
from mp_toolkit.parallel.tensor_parallel import check_tensor_parallel
from mp_toolkit.partition import PartitionError, by_parameters, explicit, uniform
from mp_toolkit.partition.train_cut import CutWorkload, config_of, flops_cut, time_cut
from mp_toolkit.schedule import get_schedule
from mp_toolkit.run.families import ModelSpec, loss_function, micro_batches, resolve_model, tensor_parallel
from mp_toolkit.run.state import ModelNames, Progress, find_checkpoint, load_state, manifest, save_state

__all__ = ["Diverged", "MetricsLog", "build_engine", "plan_boundaries", "run_training", "validate"]


class Diverged(Exception):
    """--max-skips consecutive steps were skipped for non-finite values (every rank raises it; exit 3)."""


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The model ``cfg.model`` (or ``cfg.hf``) names, with the sequence length checked against it."""
    if cfg.hf is not None:
        from mp_toolkit.run.hf_family import check_hf, resolve_hf

        spec = resolve_hf(cfg.hf)
        check_hf(spec.config, cfg)  # seq-len, the HF tensor-parallel plan's sizes, the tokenizer
        return spec
    spec = resolve_model(cfg.model)
    if cfg.seq_len > spec.positions:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds {cfg.model}'s {spec.positions} positions: "
                          f"use at most {spec.positions}")
    return spec


def plan_boundaries(layer_list: LayerList, pp: int, partition: str, chunks: int = 1,
                    workload: CutWorkload | None = None) -> list[int]:
    """Boundaries of ``pp * chunks`` stages by method name or explicit ``0,3,7`` text. ``flops`` and
    ``time`` need ``workload`` (the model's config and batch; for ``time`` the context whose rank 0
    measures and broadcasts the cut, `mp_toolkit.partition.train_cut`)."""
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
        if partition in ("flops", "time"):
            if workload is None:
                raise PartitionError("needs the model's config and batch (a CutWorkload)")
            if partition == "flops":
                return flops_cut(workload.config, n, pp, workload.micro_batch, workload.seq_len)
            return time_cut(layer_list, pp, workload)
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
    for name in ("warmup_steps", "loss_scale_window", "hysteresis", "initial_scale_power", "save_every", "restarts",
                 "max_skips"):
        if getattr(cfg, name) < (0 if name in ("warmup_steps", "initial_scale_power", "save_every", "restarts") else 1):
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
    if cfg.resume in ("latest", "auto") and cfg.save_dir is None:
        raise ConfigError(f"--resume {cfg.resume} needs --save-dir (the checkpoint root it resumes from), "
                          "or give --resume DIR")
    if cfg.resume not in (None, "latest", "auto") and not Path(cfg.resume).is_dir():
        raise ConfigError(f"--resume {cfg.resume}: no such checkpoint directory")
    if cfg.save_every and cfg.save_dir is None:
        raise ConfigError(f"--save-every {cfg.save_every} needs --save-dir")
    if cfg.restarts and (cfg.save_dir is None or not cfg.save_every):
        raise ConfigError(f"--restarts {cfg.restarts} needs --save-dir and --save-every N: a restart resumes from "
                          "the latest checkpoint, and without one it would start over")


def validate(cfg: TrainConfig) -> None:
    """Every check that needs no process group: fail before any rank starts."""
    _validate_numbers(cfg)
    _validate_paths(cfg)
    from mp_toolkit.ds.engine import check_engine  # --engine deepspeed's limits (imports no DeepSpeed)

    check_engine(cfg)
    spec = model_spec(cfg)
    try:
        check_tensor_parallel(cfg.tp, **spec.tp_sizes())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    with torch.device("meta"):
        layers = LayerList.from_model(spec.build())
    plan_boundaries(layers, cfg.pp, cfg.partition, cfg.chunks, CutWorkload.of(cfg, spec.config))
    try:
        get_schedule(cfg.schedule, cfg.pp, cfg.microbatches, num_chunks=cfg.chunks)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_engine(cfg: TrainConfig, ctx: ParallelContext, model: torch.nn.Module) -> PipelineEngine:
    """Compose the parallelisms over a plain single-device GPT, BERT or HF model, for this rank.
    The order matters:

    1. Plan the pipeline cut on the *unsplit* layer list (boundaries are data), so every tp degree
       cuts the model at the same layers.
    2. Tensor parallelism: `apply_tensor_parallel` (an HF model: `apply_hf_tensor_parallel`) swaps
       the modules the model's TP plan names for this rank's shards over the whole list at once,
       so the tied embedding and LM head (MLM decoder), which may land on different stages, are
       split alike (and stay one Parameter where one stage holds both). It must come before the
       cut: a stage is a slice of whatever modules the list holds.
    3. Pipeline: the engine keeps this rank's stages of the sharded list; the others are freed
       with ``model`` once the caller drops it.
    4. Data parallelism last: the engine averages each stage's gradients over ``ctx.dp_group``
       once its backward is done; nothing is wrapped, the modules stay plain.

    ``model`` must be built identically on every rank (same seed): each keeps its own slice.
    """
    layers = LayerList.from_model(model)
    boundaries = plan_boundaries(layers, cfg.pp, cfg.partition, cfg.chunks,  # 1
                                 CutWorkload.of(cfg, config_of(model), ctx))
    layers = tensor_parallel(model, layers, ctx)  # 2
    tp_group = ctx.tp_group  # LAMB / LARS: whole-tensor norms of the shards in their trust ratios
    options = OptimizerOptions.of(cfg)
    return PipelineEngine(  # 3 and 4
        layers, ctx, boundaries, cfg.microbatches, cfg.schedule,
        optimizer=lambda named: build_optimizer(cfg.optimizer, named, cfg.lr, cfg.weight_decay, tp_group=tp_group,
                                                options=options),
        loss_fn=loss_function(model, ctx), clip_grad=cfg.clip_grad, precision=cfg.precision,
        loss_scaler=loss_scaler(cfg), chunks=cfg.chunks, dp_bucket_bytes=max(1, int(cfg.dp_bucket_mb * 2**20)),
    )


def deepspeed_engine(cfg: TrainConfig, ctx: ParallelContext, model: torch.nn.Module):
    """``--engine deepspeed``: DeepSpeed's PipelineEngine with the same cut, optimizer and loss, behind
    the calls this loop makes of ours (`mp_toolkit.ds.engine`; DeepSpeed is imported only then)."""
    from mp_toolkit.ds.engine import DeepSpeedPipeline

    return DeepSpeedPipeline(cfg, ctx, model)


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
    """Train on this rank; returns the per-step rows on rank 0 (empty elsewhere). A collective or
    point-to-point call that fails because a peer died or stopped answering (bounded by
    --timeout) becomes `PeerLost`, whose line names the lost rank when it ran on this host."""
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // env.local_world_size))
    status = RankStatus(env)  # under spawn_local: the watchdog hears each step
    peers, lost = None, False
    try:
        device = init_distributed(env, cfg.timeout_s)
        if env.world_size > 1:
            peers = Peers.exchange(env.rank, env.world_size, device)
        return _train(cfg, env, device, status)
    except RuntimeError as e:
        if isinstance(e, PeerLost) or not is_comm_failure(e):
            raise
        lost = True  # no teardown: the group is broken and the process exits now
        raise PeerLost(comm_failure_line(e, peers, env.rank, status.phase)) from None
    finally:
        if dist.is_initialized() and not lost:
            dist.destroy_process_group()


def _resume(cfg: TrainConfig, engine, ctx, names, data, spec, log_rank0: bool) -> Progress:
    """Progress after restoring ``--resume``'s checkpoint (a fresh Progress without one)."""
    path = find_checkpoint(cfg) if cfg.resume else None
    if path is None:
        if cfg.resume and log_rank0:
            print(f"--resume {cfg.resume}: {cfg.save_dir} holds no committed checkpoint yet, starting from step 0")
        return Progress()
    resumed = load_state(path, cfg, engine, ctx, names, data, spec)
    if log_rank0:
        print(f"resumed from {resumed.path} at step {resumed.progress.step}")
        for note in resumed.notes:
            print(f"  {note}")
    return resumed.progress


@contextmanager
def injected_nonfinite(engine: PipelineEngine, kind: str | None):
    """Test hook (``MPT_FAULTS``, `mp_toolkit.run.launch.Faults`): for one step make this rank's gradients
    ("grad": the first parameter's gradient becomes inf) or its loss ("loss": the last stage's output
    times inf) non-finite. Nothing happens when ``kind`` is None."""
    handle = None
    if kind == "grad":
        handle = engine.named_parameters()[0][1].register_hook(lambda g: torch.full_like(g, float("inf")))
    elif kind == "loss":
        last = engine.schedule.num_stages - 1
        if last not in engine.stages:
            raise ConfigError(f"MPT_FAULTS: a non-finite loss needs the rank of the last stage ({last}), "
                              f"this one holds stages {sorted(engine.stages)}")
        times_inf = lambda t: t * float("inf") if t.is_floating_point() else t
        handle = engine.stages[last].register_forward_hook(
            lambda module, args, out: tuple(map(times_inf, out)) if isinstance(out, tuple) else times_inf(out))
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


@dataclass
class SkipStreak:
    """Consecutive skipped steps that count toward --max-skips: every skip in fp32 / bf16; in fp16 only
    those the scaler cannot answer by lowering the scale (a static scale, or one at --min-loss-scale)."""

    limit: int
    count: int = 0
    first: int = 0

    def update(self, step: int, stats, scaler: DynamicLossScaler | None) -> bool:
        """Whether this step counts (and so may not be checkpointed)."""
        counts = stats.skipped and (scaler is None or scaler.static or stats.loss_scale <= scaler.min_loss_scale)
        self.first = step if counts and not self.count else self.first
        self.count = self.count + 1 if counts else 0
        return counts

    def line(self, step: int, stats, cfg: TrainConfig, scaler: DynamicLossScaler | None) -> str:
        what = f"non-finite {stats.nonfinite or 'values'} on some rank"
        if self.count:
            return (f"step {step} skipped on every rank: {what} in {cfg.precision}; parameters and optimizer state "
                    f"unchanged ({self.count} in a row, --max-skips {self.limit})")
        return f"step {step} skipped on every rank: fp16 overflow ({what}), loss scale {stats.loss_scale:g} -> {scaler.scale:g}"

    def stop_message(self, step: int, stats, cfg: TrainConfig) -> str:
        latest = latest_step(cfg.save_dir) if cfg.save_dir is not None else None
        kept = (f"the last good checkpoint is {cfg.save_dir / f'step-{latest:08d}'}" if latest is not None
                else "no checkpoint was written")
        return (f"{self.count} consecutive steps skipped (steps {self.first}-{step}): non-finite "
                f"{stats.nonfinite or 'values'} on some rank in {cfg.precision}; stopping, {kept} (lower --lr, check "
                f"the data, or raise --max-skips above {self.limit})")


@dataclass
class SaveSchedule:
    """Checkpoints every --save-every steps and after the last one, but never at a step that counts
    toward --max-skips: that save waits for the next applied step, so `latest` stays on a good one."""

    cfg: TrainConfig
    deferred: bool = False

    def now(self, step: int, counted: bool, log: MetricsLog) -> bool:
        cfg = self.cfg
        due = cfg.save_dir is not None and (step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0))
        if not (due or self.deferred):
            return False
        if counted and due:
            log.note(f"no checkpoint at step {step}: it was skipped; the next applied step saves")
        self.deferred = counted
        return not counted


def _one_step(cfg: TrainConfig, env: LaunchEnv, engine: PipelineEngine, data, progress: Progress,
              step: int) -> tuple:
    """Train step ``step`` (advancing ``progress``); returns (StepStats, its metrics row)."""
    lr = lr_at(cfg, progress, step)
    set_lr(engine.optimizer, lr)
    t0 = time.perf_counter()
    with injected_nonfinite(engine, env.faults.nonfinite_at(env.rank, step)):
        stats = engine.train_batch(data)
    dt = time.perf_counter() - t0
    progress.step, progress.applied = step, progress.applied + (not stats.skipped)
    row = {"step": step, "loss": stats.loss, "lr": lr, "grad_norm": stats.grad_norm,
           "tokens_per_s": cfg.tokens_per_step / dt, "step_time_s": dt,
           "loss_scale": stats.loss_scale, "skipped": stats.skipped, "time": time.time()}
    trust = engine.trust_ratio_stats()
    if trust is not None:
        row["trust_ratio"] = trust
    return stats, row


def _train(cfg: TrainConfig, env: LaunchEnv, device: torch.device, status: RankStatus) -> list[dict]:
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, device))
    rank0 = env.rank == 0
    spec = model_spec(cfg)
    if rank0:
        print(f"model {cfg.hf or cfg.model} ({spec.label}), precision {cfg.precision}, optimizer {cfg.optimizer}, "
              f"schedule {cfg.schedule}, pp {cfg.pp}, tp {cfg.tp}, dp {cfg.dp}", flush=True)
    ctx = build_context(cfg.pp, cfg.tp, cfg.dp, device=device)
    data, spec = micro_batches(spec, cfg, ctx, env.rank)  # BERT: the model's padding id is the corpus's
    # Peak memory is reported as RSS above this baseline. It follows live tensors closely only when
    # large blocks are mapped one by one (MALLOC_MMAP_THRESHOLD_=65536, as tools/bench_plan_accuracy.py
    # sets for its memory runs); forcing that here would cost 20-30% of the step time on CPU.
    if device.type == "cpu":
        keep_freed_memory()  # a step's freed activations stay in the heap for the next (memstats)
    warm_runtime()  # torch's one-time costs (lazy imports, kernel set-up) before the baseline
    base_rss = rss_bytes()  # what the model, its activations and optimizer add is measured from here
    torch.manual_seed(cfg.seed)  # every rank builds the same full model, then keeps its shard of its stage
    model = spec.build()
    names = ModelNames.of(model)
    engine = build_engine(cfg, ctx, model) if cfg.engine == "mp_toolkit" else deepspeed_engine(cfg, ctx, model)
    del model
    progress = _resume(cfg, engine, ctx, names, data, spec, rank0)
    if progress.step >= cfg.steps:
        if rank0:
            print(f"the checkpoint is at step {progress.step}, --steps is {cfg.steps}: nothing to train")
        return []
    release_free_memory()
    reset_peak()
    log = MetricsLog(cfg, enabled=rank0, start_step=progress.step)
    scaler, streak, saves = engine.step.scaler, SkipStreak(cfg.max_skips), SaveSchedule(cfg)
    first = progress.step + 1
    for step in range(first, cfg.steps + 1):
        status.set(f"during step {step}")
        env.faults.kill_here(env, step, "step")
        stats, row = _one_step(cfg, env, engine, data, progress, step)
        if step == cfg.steps:
            row["peak_memory_bytes"] = gather_ints(peak_rss_bytes() - base_rss, ctx.device)
        if step == first:  # steady state: later steps' peak (the first adds one-time shape agreement)
            reset_peak()
        log.step(row)
        counted = streak.update(step, stats, scaler)
        if stats.skipped:
            log.note(streak.line(step, stats, cfg, scaler))
        if saves.now(step, counted, log):
            status.set(f"while saving step {step}")
            meta = manifest(cfg, engine, ctx, data, progress, spec, row["lr"]) if rank0 else None
            save_state(cfg.save_dir, meta, engine, ctx, names, step, cfg.keep,
                       after_shards=lambda: env.faults.kill_here(env, step, "save"))
            log.note(f"saved step {step} to {cfg.save_dir}")
        if streak.count >= cfg.max_skips:
            log.close()
            raise Diverged(streak.stop_message(step, stats, cfg))
    if saves.deferred:
        log.note(f"the run ended on a skipped step: no checkpoint of step {cfg.steps}, `latest` stays where it was")
    log.close()
    return log.rows
