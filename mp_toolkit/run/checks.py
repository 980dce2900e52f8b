"""Every check of an `mpt train` run that needs no process group: each rank fails the same way,
with one line, before any rank talks (exit 2)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mp_toolkit.data.blend import parse_blend
from mp_toolkit.data.buckets import BucketError
from mp_toolkit.data.feed import check_fits
from mp_toolkit.data.indexed import is_complete
from mp_toolkit.errors import DataError
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.factory import check_optimizer_options
from mp_toolkit.parallel.tensor_parallel import check_tensor_parallel
from mp_toolkit.partition.request import too_large_global_batch, too_many_microbatches
from mp_toolkit.recompute import StageRecompute
from mp_toolkit.run.config import ConfigError, TrainConfig
from mp_toolkit.run.engines import check_engine
from mp_toolkit.run.families import ModelSpec, check_spec, resolve_hf, resolve_model
from mp_toolkit.run.loggers import check_loggers
from mp_toolkit.run.recompute_plan import apply_choices, cut_and_recompute
from mp_toolkit.run.save_dir import check_fresh
from mp_toolkit.schedule import Schedule, get_schedule


def find_model(cfg: TrainConfig) -> ModelSpec:
    """The model ``cfg.model`` (or ``cfg.hf``) names, read once, not yet checked against the run."""
    return resolve_hf(cfg.hf) if cfg.hf is not None else resolve_model(cfg.model)


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The model ``cfg.model`` (or ``cfg.hf``) names, with the run checked against it (`check_spec`)."""
    spec = find_model(cfg)
    check_spec(spec, cfg)
    return spec


MAX_THREADS_PER_CORE = 4
"""--threads beyond this many per core are refused (100,000 fail to start)."""

MAX_SCALE_POWER = 64
"""fp16's initial loss scale is 2**N: beyond 2**64 every gradient overflows fp16 (and 2**128 fp32)."""


def validate_numbers(cfg: TrainConfig) -> None:
    """Every number of ``cfg`` in its range, before anything is planned or built (one line each)."""
    flat = cfg.flat()  # the checks below name each value by its flag
    for name in ("pp", "tp", "dp", "cp", "chunks", "microbatches", "micro_batch", "seq_len", "steps"):
        if flat[name] < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {flat[name]} must be at least 1")
    if too_many_microbatches(flat["microbatches"]):  # the words of mpt plan and mpt simulate
        raise ConfigError(too_many_microbatches(flat["microbatches"]))
    threads = MAX_THREADS_PER_CORE * (os.cpu_count() or 1)
    if cfg.threads is not None and not 0 <= cfg.threads <= threads:  # 0: cores / local ranks, as not given
        raise ConfigError(f"--threads {cfg.threads} is out of range (0..{threads}: at most {MAX_THREADS_PER_CORE} "
                          "per core here)")
    if not -2**63 <= cfg.seed < 2**63:
        raise ConfigError(f"--seed {cfg.seed} is out of range (a 64-bit integer)")
    batch = cfg.batch.global_batch
    if batch is not None and (batch < 1 or too_large_global_batch(batch)):
        raise ConfigError(too_large_global_batch(batch) or f"--global-batch {batch} must be at least 1")
    if flat["initial_scale_power"] > MAX_SCALE_POWER:
        raise ConfigError(f"--initial-scale-power {flat['initial_scale_power']} is out of range (0..{MAX_SCALE_POWER}: "
                          f"fp16's first loss scale is 2**N)")
    for name in ("lr", "min_lr", "weight_decay", "loss_scale", "min_loss_scale"):
        value = flat[name]
        if not (value >= 0 and math.isfinite(value)) or (name == "lr" and value == 0):
            sign = "positive" if name == "lr" else "non-negative"
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be a {sign} finite number")
    if not (cfg.parallel.dp_bucket_mb > 0 and math.isfinite(cfg.parallel.dp_bucket_mb)):
        raise ConfigError(f"--dp-bucket-mb {cfg.parallel.dp_bucket_mb} must be a positive finite number")
    if cfg.parallel.zero not in (0, 1):
        raise ConfigError(f"--zero {cfg.parallel.zero}: mp_toolkit implements ZeRO stage 0 (off) and 1 (optimizer "
                          "state partitioned over data-parallel replicas); use --zero 1")
    clip = cfg.optim.clip_grad
    if clip is not None and not (clip > 0 and math.isfinite(clip)):
        raise ConfigError(f"--clip-grad {clip} must be a positive finite number (or none)")
    for name in ("warmup_steps", "loss_scale_window", "hysteresis", "initial_scale_power", "save_every", "restarts",
                 "max_skips", "check_replicas"):
        if flat[name] < (0 if name in ("warmup_steps", "initial_scale_power", "save_every", "restarts",
                                       "check_replicas") else 1):
            raise ConfigError(f"--{name.replace('_', '-')} {flat[name]} is out of range")
    try:
        cfg.batch.bucket_lengths  # noqa: B018 -- each bucket at most --seq-len
    except BucketError as e:
        raise ConfigError(str(e)) from None
    _check_sequence_parallel(cfg)
    _check_context_parallel(cfg)
    if not (math.isfinite(cfg.faults.hang_timeout_s) and cfg.faults.hang_timeout_s >= 0):
        raise ConfigError(f"--hang-timeout {cfg.faults.hang_timeout_s} must be a positive finite number of seconds "
                          "(or 0: no heartbeats)")
    log, optim = cfg.logging, cfg.optim
    if log.eval_every < 0 or log.eval_batches < 1:
        raise ConfigError(f"--eval-every {log.eval_every} / --eval-batches {log.eval_batches}: give N >= 0 steps "
                          "(0: no validation) and K >= 1 global batches")
    if optim.min_lr > optim.lr:
        raise ConfigError(f"--min-lr {optim.min_lr} exceeds --lr {optim.lr}: the decay must end at or below the peak")
    try:
        check_optimizer_options(optim)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_sequence_parallel(cfg: TrainConfig) -> None:
    """``--sequence-parallel`` splits every micro-batch's tokens evenly over the tp ranks."""
    par = cfg.parallel
    if not par.sequence_parallel:
        return
    if par.tp < 2:
        raise ConfigError(f"--sequence-parallel splits the sequence over the tensor-parallel ranks: it needs --tp 2 "
                          f"or more (got --tp {par.tp})")
    if cfg.engine != "mp_toolkit":
        raise ConfigError(f"--sequence-parallel is ours: --engine {cfg.engine} runs DeepSpeed's pipeline "
                          "(use --engine mp_toolkit)")
    uneven = [n for n in (cfg.batch.seq_len, *(cfg.batch.bucket_lengths or ())) if n % par.tp]
    if uneven:
        raise ConfigError(f"--sequence-parallel: every micro-batch length must be a multiple of --tp {par.tp}, "
                          f"and {uneven[0]} is not (--seq-len, --length-buckets)")


def _check_context_parallel(cfg: TrainConfig) -> None:
    """``--cp N`` splits every sequence into 2 N chunks (zig-zag) for model_zoo's GPT, under our engine."""
    par = cfg.parallel
    if par.cp == 1:
        return
    if cfg.engine != "mp_toolkit":
        raise ConfigError(f"--cp {par.cp} is ours: --engine {cfg.engine} runs DeepSpeed's pipeline "
                          "(use --engine mp_toolkit)")
    split = 2 * par.cp * (par.tp if par.sequence_parallel else 1)
    uneven = [n for n in (cfg.batch.seq_len, *(cfg.batch.bucket_lengths or ())) if n % split]
    if uneven:
        what = f"2 x cp = {split}" if split == 2 * par.cp else f"2 x cp x tp = {split} (with --sequence-parallel)"
        raise ConfigError(f"--cp {par.cp}: every micro-batch length must be a multiple of {what} "
                          f"(the zig-zag split), and {uneven[0]} is not (--seq-len, --length-buckets)")


def _validate_paths(cfg: TrainConfig) -> None:
    data, ck = cfg.dataset.data, cfg.checkpoint
    try:
        parts = parse_blend(data)
    except DataError as e:
        raise ConfigError(str(e)) from None
    for _, source in parts:
        path = Path(source)
        if source in ("stdlib", "synthetic") or (is_complete(path) and os.access(f"{source}.idx", os.R_OK)):
            continue
        if not path.exists() or not os.access(path, os.R_OK):
            raise ConfigError(f"--data {source!r} is not a readable prepared directory, Megatron prefix, file or "
                              "folder (or use stdlib / synthetic)")
    tok = cfg.dataset.tokenizer
    if tok is not None and not (Path(tok).is_file() or (Path(tok) / "tokenizer.json").is_file()):
        raise ConfigError(f"--tokenizer {tok}: neither a tokenizer.json nor a directory holding one")
    if ck.keep is not None and ck.keep < 1:
        raise ConfigError(f"--keep {ck.keep} must be at least 1 (0 keeps every checkpoint)")
    if ck.resume in ("latest", "auto") and ck.save_dir is None:
        raise ConfigError(f"--resume {ck.resume} needs --save-dir (the checkpoint root it resumes from), "
                          "or give --resume DIR")
    if ck.resume not in (None, "latest", "auto") and not Path(ck.resume).is_dir():
        raise ConfigError(f"--resume {ck.resume}: no such checkpoint directory")
    if ck.save_every and ck.save_dir is None:
        raise ConfigError(f"--save-every {ck.save_every} needs --save-dir")
    check_fresh(cfg)
    if cfg.faults.restarts and (ck.save_dir is None or not ck.save_every):
        raise ConfigError(f"--restarts {cfg.faults.restarts} needs --save-dir and --save-every N: a restart resumes "
                          "from the latest checkpoint, and without one it would start over")
    if cfg.faults.spike_rewind is not None and (ck.save_dir is None or not ck.save_every):
        raise ConfigError("--spike-rewind needs --save-dir and --save-every N: a rewind goes back to the latest "
                          "checkpoint")
    if ck.async_save and ck.save_dir is None:
        raise ConfigError("--async-save needs --save-dir (it writes checkpoints in the background)")


@dataclass(frozen=True)
class Checked:
    """What the checks decided on the way: the model, the cut, each stage's recomputation, the schedule."""

    spec: ModelSpec
    boundaries: tuple[int, ...]
    recompute: tuple[StageRecompute, ...]
    schedule: Schedule


def validate(cfg: TrainConfig, planned=None, spec: ModelSpec | None = None) -> Checked:
    """Every check that needs no process group: fail before any rank starts. Returns what the checks
    decided (a ``--partition time`` cut is measured when the ranks start; here it is the FLOPs cut).
    ``planned``: the schedule candidate's plan (`run.recompute_plan.choose_schedule`), whose cut
    ``--recompute auto`` takes instead of planning it again; ``spec``: the model, already read (`find_model`)."""
    validate_numbers(cfg)
    _validate_paths(cfg)
    check_engine(cfg)  # --engine deepspeed's limits (imports no DeepSpeed)
    check_loggers(cfg)  # tensorboard / wandb installed when asked for
    spec = find_model(cfg) if spec is None else spec
    check_spec(spec, cfg)
    try:
        check_fits(cfg.dataset.data, cfg.dataset.tokenizer, spec.vocab_size)
    except DataError as e:
        raise ConfigError(str(e)) from None
    try:
        check_tensor_parallel(cfg.parallel.tp, **spec.tp_sizes())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # shapes only; the caller's RNG stays as it was
        layers = LayerList.from_model(spec.build())
    recompute, memory_gb = cfg.recomputation.recompute, cfg.recomputation.memory_gb
    if recompute != "none" and cfg.engine != "mp_toolkit":
        raise ConfigError(f"--recompute {recompute} is ours: --engine {cfg.engine} runs DeepSpeed's pipeline "
                          "(use --engine mp_toolkit, or --recompute none)")
    if memory_gb is not None and not (memory_gb > 0 and math.isfinite(memory_gb)):
        raise ConfigError(f"--memory-gb {memory_gb} must be a positive finite number")
    boundaries, choices = cut_and_recompute(cfg, layers, spec.config, planned=planned)
    apply_choices(layers, boundaries, choices)  # refuses selective where unsupported
    return Checked(spec, tuple(boundaries), tuple(choices), _schedule(cfg))


def check_received(cfg: TrainConfig, boundaries: tuple[int, ...], recompute: tuple[StageRecompute, ...]) -> Checked:
    """What a rank needs of a run whose checks and cut the process that started it made
    (`run.plan.RunPlan.received`): this rank's model spec and the schedule, nothing planned."""
    return Checked(find_model(cfg), tuple(boundaries), tuple(recompute), _schedule(cfg))


def _schedule(cfg: TrainConfig) -> Schedule:
    try:
        par = cfg.parallel
        return get_schedule(par.schedule, par.pp, cfg.batch.microbatches, chunks=par.chunks)
    except ValueError as e:
        raise ConfigError(str(e)) from None
