"""The training loop every rank runs: build model, shard and cut it, feed micro-batches, step, log, save.

Entry point (each rank)::

    torchrun --nproc_per_node 2 -m mp_toolkit.cli train --model gpt-small-cpu --pp 2 --schedule 1f1b
    torchrun --nproc_per_node 8 -m mp_toolkit.cli train --model gpt-small-cpu --pp 2 --tp 2 --dp 2
    deepspeed --num_gpus 8 recipes/bert_pretrain/train.py --deepspeed_config recipes/bert_pretrain/ds_config.json
    mpt train --model bert-tiny --seq-len 64 --pp 2 --save-dir runs/bert --save-every 50   # starts the ranks itself
    mpt train --model bert-tiny --seq-len 64 --pp 1 --tp 2 --save-dir runs/bert --resume latest  # another layout
    mpt train --model gpt-tiny --seq-len 64 --data synthetic --pp 2 --save-dir runs/x --save-every 20 --restarts 3
    torchrun --nproc_per_node 2 --max-restarts 3 -m mp_toolkit.cli train --model gpt-tiny --pp 2 \
             --seq-len 64 --data synthetic --save-dir runs/x --save-every 20 --resume auto

A step whose loss or gradients are not finite on any rank is skipped by every rank, in every
precision, and logged; --max-skips such steps in a row stop the run (exit 3) and no checkpoint is
written at such a step, so `latest` stays on the last good one (RELIABILITY.md). Each rank's
heartbeat names a hung rank within --hang-timeout (`run.watchdog`, exit 4); SIGTERM / SIGUSR1 stop
every rank after the same step, saved (`run.preempt`, exit 5).
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist

from mp_toolkit.checkpoint import CheckpointError, latest_step
from mp_toolkit.engine.interface import TrainEngine
from mp_toolkit.optim.lr import WarmupDecay, set_lr
from mp_toolkit.parallel.context import ParallelContext, build_context
from mp_toolkit.parallel.tensor_parallel import padded_vocab_size
from mp_toolkit.partition.memstats import DeviceMemory, peak_rss_bytes, reset_peak, warm_runtime
from mp_toolkit.run.compose import make_engine
from mp_toolkit.run.config import ConfigError, TrainConfig
from mp_toolkit.run.families import micro_batches
from mp_toolkit.run.launch import (
    LaunchEnv,
    PeerLost,
    Peers,
    RankStatus,
    comm_failure_line,
    init_distributed,
    is_comm_failure,
)
from mp_toolkit.run.metrics import DrawnTokens, MetricsLog, gather_ints, global_batch_tokens
from mp_toolkit.run.plan import RunPlan
from mp_toolkit.run.predict import run_plan
from mp_toolkit.run.preempt import Preempted, PreemptSignals
from mp_toolkit.run.replicas import flip_bit
from mp_toolkit.run.save_dir import SaveDirLock, new_run_id
from mp_toolkit.run.save_dir import prepare as prepare_save_dir
from mp_toolkit.run.saving import RunCheckpoints
from mp_toolkit.run.skips import Diverged, SaveSchedule, SkipStreak, injected_nonfinite
from mp_toolkit.run.spikes import SpikeGuard
from mp_toolkit.run.state import ModelNames, Progress, agree, find_checkpoint, load_state
from mp_toolkit.run.validation import bert_metrics, evaluates_at, validation_row
from mp_toolkit.run.watchdog import Heartbeat

__all__ = ["Diverged", "Preempted", "lr_at", "run_training"]


def lr_at(cfg: TrainConfig, progress: Progress, step: int) -> float:
    """The rate of optimizer step ``step``. A DeepSpeed schedule counts applied steps only (its engine
    does not step the scheduler after an fp16 overflow); WarmupDecay counts every step."""
    o = cfg.optim
    if o.lr_schedule is not None:
        return o.lr_schedule(progress.applied + 1)
    return WarmupDecay(o.lr, cfg.steps, o.warmup_steps, o.lr_decay, o.min_lr)(step)


def run_training(run: RunPlan, env: LaunchEnv) -> list[dict]:
    """Train ``run`` (decided once, `run.plan`) on this rank; returns the per-step rows on rank 0 (empty
    elsewhere). A collective or point-to-point call that fails because a peer died or stopped answering (bounded by
    --timeout) becomes `PeerLost`, whose line names the lost rank when it ran on this host."""
    cfg = run.cfg
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // env.local_world_size))
    status = RankStatus(env)  # under spawn_local: the watchdog hears each step
    peers, lost, lock, heartbeat = None, False, SaveDirLock(), None
    signals = PreemptSignals(speak=env.rank == 0).install()
    try:
        device = init_distributed(env, cfg.faults.timeout_s)
        if env.world_size > 1:
            if cfg.faults.hang_timeout_s:  # its first beat now; judging once every rank has beaten (the exchange)
                heartbeat = Heartbeat(env, status, cfg.faults.hang_timeout_s)
            peers = Peers.exchange(env.rank, env.world_size, device)
            if heartbeat is not None:
                heartbeat.arm()
        return _train(run, env, device, status, lock, signals)
    except RuntimeError as e:
        if isinstance(e, PeerLost) or not is_comm_failure(e):
            raise
        lost = True  # no teardown: the group is broken and the process exits now
        raise PeerLost(comm_failure_line(e, peers, env.rank, status.phase)) from None
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        signals.restore()
        lock.release()
        if dist.is_initialized() and not lost:
            dist.destroy_process_group()


def predicted_bytes(run: RunPlan, boundaries: list[int], pp_rank: int) -> int | None:
    """``mpt plan``'s bytes for this pipeline rank's steps: the run plan's, or for a cut rank 0 measured
    when the ranks started (``--partition time``) a plan of that cut, made now."""
    if list(run.boundaries) == list(boundaries):
        return run.predicted_rank_bytes(pp_rank)
    plan = run_plan(run.cfg, boundaries)
    return None if plan is None else sum(plan.stages[s].memory_bytes for s in run.stages_of(pp_rank))


def _resume(cfg: TrainConfig, path, engine, ctx, names, data, spec, log_rank0: bool
            ) -> tuple[Progress, str, SpikeGuard | None]:
    """(Progress after restoring ``path``, ``--resume``'s checkpoint, the run's id, its --spike-rewind
    guard): a fresh Progress and a new id when None; a resumed run keeps the id its checkpoint records."""
    if path is None:
        ck = cfg.checkpoint
        if ck.resume and log_rank0:
            print(f"--resume {ck.resume}: {ck.save_dir} holds no committed checkpoint yet, starting from step 0")
        return Progress(), new_run_id(), SpikeGuard.of(cfg.faults.spike_rewind)
    resumed = load_state(path, cfg, engine, ctx, names, data, spec)
    if log_rank0:
        print(f"resumed from {resumed.path} at step {resumed.progress.step}")
        for note in resumed.notes:
            print(f"  {note}")
    return resumed.progress, resumed.run or new_run_id(), SpikeGuard.of(cfg.faults.spike_rewind, resumed.spikes)


def _one_step(cfg: TrainConfig, env: LaunchEnv, ctx: ParallelContext, engine: TrainEngine, data,
              progress: Progress, step: int) -> tuple:
    """Train step ``step`` (advancing ``progress``); returns (StepStats, its metrics row). The row's
    ``tokens``: the global batch's, counted from the micro-batches drawn under --length-buckets
    (one small all-gather a step), else dp x micro-batches x micro-batch x seq-len."""
    lr = lr_at(cfg, progress, step)
    set_lr(engine.optimizer, lr)
    drawn = DrawnTokens(data) if cfg.batch.length_buckets else None
    t0 = time.perf_counter()
    batch = data.position // cfg.batch.microbatches + 1  # the global batch this step reads (1-based)
    with injected_nonfinite(engine, env.faults.nonfinite_at(env.rank, step, batch)):
        stats = engine.train_batch(data if drawn is None else drawn)
    dt = time.perf_counter() - t0
    tokens = cfg.tokens_per_step if drawn is None else global_batch_tokens(drawn.tokens, ctx)
    progress.step, progress.applied = step, progress.applied + (not stats.skipped)
    row = {"step": step, "loss": stats.loss, "lr": lr, "grad_norm": stats.grad_norm,
           "tokens": tokens, "tokens_per_s": tokens / dt, "step_time_s": dt,
           "loss_scale": stats.loss_scale, "skipped": stats.skipped, "time": time.time()}
    trust = engine.trust_ratio_stats()
    if trust is not None:
        row["trust_ratio"] = trust
    return stats, row


def _preempted_line(cfg: TrainConfig, signal_name: str, step: int, saved: bool) -> str:
    save_dir = cfg.checkpoint.save_dir
    if save_dir is None:
        where = "no --save-dir, nothing saved"
    elif saved:
        where = f"saved {save_dir / f'step-{step:08d}'}; continue with --resume auto"
    else:
        where = f"step {step} was skipped, so `latest` in {save_dir} stays on the last good step"
    return f"{signal_name}: every rank stopped after step {step} ({where})"


def _train(run: RunPlan, env: LaunchEnv, device: torch.device, status: RankStatus, lock: SaveDirLock,
           signals: PreemptSignals) -> list[dict]:
    cfg, spec, rank0, par = run.cfg, run.spec, env.rank == 0, run.cfg.parallel
    if rank0:
        padded = padded_vocab_size(spec.vocab_size, par.tp)  # the vocab shards' rows (vocab_parallel)
        pad = f" (vocab {spec.vocab_size} padded to {padded})" if padded != spec.vocab_size else ""
        sp = " with sequence parallelism" if par.sequence_parallel else ""
        cp = f", cp {par.cp}" if par.cp > 1 else ""
        replicas = par.dp * par.cp  # the ranks holding the same parameters
        zero = f", ZeRO-1 (masters and optimizer state 1/{replicas} per replica)" if par.zero and replicas > 1 else ""
        print(f"model {cfg.hf or cfg.model} ({spec.label}), precision {cfg.numerics.precision}, "
              f"optimizer {cfg.optim.optimizer}, schedule {par.schedule}, pp {par.pp}, tp {par.tp}{pad}{sp}{cp}, "
              f"dp {par.dp}{zero}", flush=True)
    ctx = build_context(par.pp, par.tp, par.dp, device=device, cp=par.cp)
    data, spec = micro_batches(spec, cfg, ctx, env.rank)  # BERT: the model's padding id is the corpus's
    # Peak memory is the device's figure above this baseline (`memstats.DeviceMemory`): on CPU the RSS,
    # which follows live tensors closely only when large blocks are mapped one by one
    # (MALLOC_MMAP_THRESHOLD_=65536, as tools/bench_plan_accuracy.py sets for its memory runs; forcing
    # that here would cost 20-30% of the step time); on CUDA the caching allocator's tensor bytes.
    memory = DeviceMemory.of(device)
    memory.keep_freed()  # a step's freed activations stay for the next (glibc's heap / the caching allocator)
    warm_runtime()  # torch's one-time costs (lazy imports, kernel set-up) before the baseline
    base = memory.in_use_bytes()  # what the model, its activations and optimizer add is measured from here
    torch.manual_seed(cfg.seed)  # the same init_seed on every rank; each draws only its own layers
    with torch.device("meta") if spec.builds_on_meta else contextlib.nullcontext():
        model = spec.build()
    names = ModelNames.of(model)
    if cfg.checkpoint.save_dir is not None:  # locked for the run's life, scratch cleared, room for one
        error = None
        if rank0:
            try:
                prepare_save_dir(cfg, lock, sum(p.numel() for p in model.parameters()))
            except (ConfigError, CheckpointError) as e:
                error = e
        agree(error, ctx)
    resume_from = find_checkpoint(cfg) if cfg.checkpoint.resume else None
    engine = make_engine(run, ctx, model, values=resume_from is None)  # resuming: the checkpoint fills them
    del model
    planned = predicted_bytes(run, engine.boundaries, ctx.pp_rank)  # mpt plan's figure for this rank
    if planned is not None and ctx.grad_rank == 0 and ctx.tp_rank == 0:  # the --async-save copy's writer
        planned += run.copy_bytes(ctx.pp_rank)
    progress, run_id, spikes = _resume(cfg, resume_from, engine, ctx, names, data, spec, rank0)
    if progress.step >= cfg.steps:
        if rank0:
            print(f"the checkpoint is at step {progress.step}, --steps is {cfg.steps}: nothing to train")
        return []
    memory.release()
    peak_since_start = peak_rss_bytes()  # imports, build and load: the counter restarts below
    peak_loaded = peak_since_start
    reset_peak()
    memory.reset_peak()  # on CPU the same counter
    log = MetricsLog(cfg, enabled=rank0, start_step=progress.step)
    # BERT pre-training: MLM and NSP losses and MLM accuracy beside the validation loss (our engine)
    metrics = bert_metrics(spec.family_record.mlm, getattr(spec.config, "architecture", None), engine, ctx.tp_group)
    scaler, streak, saves = engine.scaler, SkipStreak(cfg.faults.max_skips), SaveSchedule(cfg)
    checkpoints = RunCheckpoints(cfg, env, ctx, engine, names, data, spec, status, log, run_id)
    flips = lambda step: env.faults.flips_at(env, step)  # noqa: E731 -- the test hook (MPT_FAULTS)

    first = step = progress.step + 1
    signals.begin()
    while step <= cfg.steps:
        status.set(f"during step {step}", step)
        env.faults.kill_here(env, step, "step")
        stats, row = _one_step(cfg, env, ctx, engine, data, progress, step)
        for tensor, element, bit in flips(step):
            log_flip = flip_bit(engine, tensor, element, bit)
            print(f"MPT_FAULTS: rank {env.rank} flipped {log_flip} after step {step}", flush=True)
        if step == cfg.steps:
            row["peak_memory_bytes"] = gather_ints(memory.peak_bytes() - base, ctx.device)
            row["peak_rss_bytes"] = gather_ints(max(peak_since_start, peak_rss_bytes()), ctx.device)
            row["peak_load_rss_bytes"] = gather_ints(peak_loaded, ctx.device)  # before the first step
            row["planned_memory_bytes"] = gather_ints(planned or 0, ctx.device)  # 0: the cost model cannot say
        if step == first:  # steady state: later steps' peak (the first adds one-time shape agreement)
            peak_since_start = max(peak_since_start, peak_rss_bytes())
            reset_peak()
            memory.reset_peak()
            checkpoints.prepare()  # --async-save: its buffers, counted in the steady state's peak
        if evaluates_at(cfg, step):
            status.set(f"while evaluating after step {step}")
            row.update(validation_row(engine, data, cfg.logging.eval_batches, metrics))
        log.step(row)
        if log.writes_files:  # a write rank 0 could not make stops every rank here, with its one line
            agree(log.failed, ctx)
        counted = streak.update(step, stats, scaler)
        if stats.skipped:
            log.note(streak.line(step, stats, cfg, scaler))
        if spikes is not None:
            spike = spikes.judge(step, stats.loss, stats.skipped)
            why = spike or (streak.stop_reason(cfg) if streak.count >= cfg.faults.max_skips else None)
            where = latest_step(cfg.checkpoint.save_dir) if why else None
            if why and spikes.left > 0 and where is not None:
                step = checkpoints.rewind(step, why, progress, spikes, streak, saves)
                continue
            if spike:
                log.note(f"step {step}: {spike}; not rewound: " + ("no checkpoint yet" if where is None else
                         f"the {spikes.limit} rewinds of --spike-rewind are spent"))
                spikes.accept(step, stats.loss)
        saved = saves.now(step, counted, log)
        if checkpoints.check.due(step):
            checkpoints.check_replicas(step)
        if saved:
            checkpoints.save(step, row, progress, spikes)
        if streak.count >= cfg.faults.max_skips:
            checkpoints.finish()
            log.close()
            raise Diverged(streak.stop_message(step, stats, cfg))
        stop = signals.agreed(ctx.device) if step < cfg.steps else None  # every rank, the same step
        if stop is not None:
            if cfg.checkpoint.save_dir is not None and not saved and not counted:
                checkpoints.save(step, row, progress, spikes)
            checkpoints.finish()
            log.close()
            raise Preempted(_preempted_line(cfg, stop.name, step, saved or not counted))
        step += 1
    checkpoints.finish()
    if saves.deferred:
        log.note(f"the run ended on a skipped step: no checkpoint of step {cfg.steps}, `latest` stays where it was")
    log.close()
    return log.rows
