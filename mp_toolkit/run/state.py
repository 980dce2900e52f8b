"""Saving and resuming a training run through `mp_toolkit.checkpoint` (DESIGN.md invariant 8).

Every rank calls `save_state` after the same step; phases are separated by an agreement (an
all-reduce that doubles as the barrier and tells every rank whether any rank failed), and each
rank touches only its own files::

    1. rank 0: begin(root, step)                   -> root/.tmp-step-XXXXXXXX/
    2. each layer, by exactly one rank (tp_rank 0 and dp_rank 0 of the stage that holds it):
         layers/<layer>.safetensors   FULL fp32 tensors (the masters; tp shards all-gathered
                                      by gather_full over the stage's tp group)
         optim/<layer>.safetensors    optimizer state by parameter name, sharded state gathered
                                      the same way, scalars (a step count) by name
       every rank: rng/rank-XXXXX.safetensors
    3. rank 0: commit(root, step, manifest, keep)  -> root/step-XXXXXXXX/, then `latest`

A weight tied across stages (GPT's embedding and LM head, BERT's word embedding and MLM decoder)
is saved once, under its first member in layer order (``embed.wte.weight``), and loaded into every
member. The manifest (``meta``) holds: the TrainConfig, the model config, the layout, progress
(steps taken, steps applied), the data position, the loss-scaler state, the lr schedule position
and the param-group hyper-parameters; for an ``--hf DIR`` run also the HF config (``hf_config``).

`load_state` runs on any (pp, tp, dp) layout: each rank reads the layers it holds, shards them for
its tp rank (`shard_full`), loads the optimizer state by name (any grouping), restores the data
position, the scaler and the step. RNG state is restored only on the identical layout; elsewhere
every rank reseeds from (seed, step), the same on every rank as at a fresh start, and says so.

Data position: `mp_toolkit.run.data_position` (what the manifest records of the sample stream, and
resuming it on any layout).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mp_toolkit.checkpoint import (
    CheckpointError,
    begin,
    capture_rng,
    commit,
    discard,
    latest_step,
    load_optimizer_state_by_name,
    open_checkpoint,
    optimizer_state_by_name,
    param_groups_by_name,
    restore_rng,
    write_layer_shard,
    write_optimizer_shard,
    write_rng_shard,
)
from mp_toolkit.engine.interface import TrainEngine
from mp_toolkit.errors import DataError, PeerFailed
from mp_toolkit.optim.groups import is_tensor_parallel
from mp_toolkit.parallel.agree import agree
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.tensor_parallel import full_shape, gather_full, shard_full
from mp_toolkit.run.config import ConfigError, TrainConfig
from mp_toolkit.run.data_position import check_same_data, data_position, data_state

RUN_CONTROL = ("steps", "metrics", "plot", "progress", "threads", "timeout_s", "save_dir", "save_every", "keep",
               "resume", "cache_dir", "restarts", "max_skips", "overwrite", "check_replicas",
               "spike_rewind", "async_save")
"""TrainConfig fields that steer the run rather than the training: not reported as changed on resume."""


def one_line(e: Exception, root) -> CheckpointError:
    if isinstance(e, OSError):
        return CheckpointError(f"{e.filename or root}: {e.strerror or ' '.join(str(e).split())}")
    return e if isinstance(e, CheckpointError) else CheckpointError(str(e))


@dataclass(frozen=True)
class ModelNames:
    """The unsplit model's layer names and, for each tied parameter, the name it is saved under."""

    layers: tuple[str, ...]
    canonical_of: dict[str, str]

    @classmethod
    def of(cls, model) -> "ModelNames":
        layers = tuple(name for name, _ in model.named_layers())
        canonical = {}
        for group in (model.tie_groups() if hasattr(model, "tie_groups") else ()):
            members = sorted(group, key=lambda m: layers.index(m[0]))  # the first in layer order owns it
            first = f"{members[0][0]}.{members[0][1]}"
            canonical.update({f"{layer}.{path}": first for layer, path in members})
        return cls(layers, canonical)

    def canonical(self, name: str) -> str:
        return self.canonical_of.get(name, name)

    def layer_of(self, name: str) -> str:
        """The layer a parameter name belongs to (the longest layer-name prefix: h.1 never takes h.10.x)."""
        return max((layer for layer in self.layers if name.startswith(layer + ".")), key=len)


@dataclass
class Progress:
    """How far training got: ``step`` optimizer steps taken, ``applied`` of them not skipped for
    fp16 overflow (a DeepSpeed lr schedule advances on those only)."""

    step: int = 0
    applied: int = 0


def config_json(cfg: TrainConfig) -> dict:
    """TrainConfig as JSON values by flat name (`TrainConfig.flat`: the manifest's keys, as before the
    config had sections): paths as strings, tuples as lists, a DeepSpeed schedule as its fields."""
    out = {}
    for name, v in cfg.flat().items():
        if dataclasses.is_dataclass(v):
            v = {"type": type(v).__name__, **dataclasses.asdict(v)}
        elif isinstance(v, Path):
            v = str(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[name] = v
    return out


def layout_of(engine: TrainEngine, ctx: ParallelContext, cfg: TrainConfig) -> dict:
    par = cfg.parallel
    return {"pp": ctx.pp, "tp": ctx.tp, "dp": ctx.dp, **({"cp": ctx.cp} if ctx.cp > 1 else {}),
            "chunks": par.chunks, "schedule": par.schedule, "boundaries": list(engine.boundaries),
            "world_size": ctx.world_size}


def _gather_state(param: torch.Tensor, value: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """A state tensor laid out like its sharded parameter (exp_avg, ...) is gathered; others (a 0-d step) not."""
    if is_tensor_parallel(param) and value.shape == param.shape:
        return gather_full(param, ctx.tp_group, tensor=value)
    return value


def _unpartitioned(engine: TrainEngine, params: dict, own: list[str], states: dict, scalars: dict
                   ) -> tuple[dict, dict, dict]:
    """ZeRO-1: the fp32 masters and optimizer state of the parameters ``own`` as whole tensors of this
    rank's (tp-shard) shapes, gathered from the data-parallel replicas' pieces (`ShardedMasters.gather`).

    Every replica calls it for the same names in the same order. Piece-shaped state tensors are
    gathered; 0-d ones (a step count) and scalars are alike on every piece of every tensor (each
    piece steps on every applied step), so any piece this rank holds stands in for a tensor it holds
    none of."""
    zero = engine.masters
    template_t, template_s = _state_template(states, scalars, zero.group)
    masters, out_states, out_scalars = {}, {}, {}
    for n in own:
        p = params[n]
        masters[n] = zero.gather(p, engine.master_of(p))
        mine = states.get(n, {})
        if template_t:
            out_states[n] = {k: zero.gather(p, mine.get(k)) if v.dim() > 0 else mine.get(k, v)
                             for k, v in sorted(template_t.items())}
        if template_s:
            out_scalars[n] = scalars.get(n, template_s)
    return masters, out_states, out_scalars


def _state_template(states: dict, scalars: dict, group) -> tuple[dict, dict]:
    """(the state tensors, the scalars) of one piece, as every replica of ``group`` sees them: the first
    replica's that holds any state. A replica that owns no element of any tensor (ZeRO-1 over small
    buckets) has none of its own, yet must enter the same gathers as the others."""
    mine = (next(iter(states.values()), {}), next(iter(scalars.values()), {}))
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, None if not (mine[0] or mine[1]) else
                           ({k: v.detach().reshape(-1)[:0].cpu() if v.dim() else v.detach().cpu()
                             for k, v in mine[0].items()}, mine[1]), group=group)  # shapes aside: host copies
    return next((t for t in every if t is not None), ({}, {}))


def write_shards(tmp: Path, engine: TrainEngine, ctx: ParallelContext, names: ModelNames, sink=None
                 ) -> Exception | None:
    """Phase 2 on this rank: its layers' model and optimizer shards (when it is their writer) and its
    RNG shard. A failed write is returned, not raised, so the tp peers' gathers still pair up.
    ``sink(write, args)``: each write is handed to it instead of done (`run.async_save` copies the
    tensors to host memory and writes them later); the gathers are done here either way."""
    error = None

    def attempt(write, *args):
        nonlocal error
        if sink is not None:
            sink(write, args)
        elif error is None:
            try:
                write(*args)
            except (CheckpointError, OSError) as e:
                error = one_line(e, tmp)

    zero = getattr(engine, "zero", 0)
    if ctx.grad_rank == 0 or zero:  # every replica (and cp slice) holds the same weights: replica 0 saves them
        params = dict(engine.named_parameters())
        masters = {n: engine.master_of(p) for n, p in params.items()}
        held = {id(t) for group in engine.optimizer.param_groups for t in group["params"]}  # stand-ins too (ZeRO-1)
        states, scalars = optimizer_state_by_name(engine.optimizer,
                                                  [(n, m) for n, m in masters.items() if m.numel() or id(m) in held])
        by_layer: dict[str, list[str]] = {}
        for n in masters:
            if names.canonical(n) == n:  # a tie's later members are saved by its first
                by_layer.setdefault(names.layer_of(n), []).append(n)
        for layer in engine.layer_names():
            own = by_layer.get(layer, [])
            if zero:  # ZeRO-1: whole tensors from the replicas' pieces, one layer at a time (collective over dp)
                layer_masters, layer_states, layer_scalars = _unpartitioned(engine, params, own, states, scalars)
                if ctx.grad_rank != 0:
                    continue
            else:
                layer_masters, layer_states, layer_scalars = masters, states, scalars
            full = {n: gather_full(params[n], ctx.tp_group, tensor=layer_masters[n]) for n in own}  # collective over tp
            optim = {n: {k: _gather_state(params[n], v, ctx) for k, v in sorted(layer_states[n].items())}
                     for n in own if n in layer_states}
            if ctx.tp_rank == 0:
                attempt(write_layer_shard, tmp, layer, full)
                attempt(write_optimizer_shard, tmp, layer, optim,
                        {n: layer_scalars[n] for n in own if n in layer_scalars})
    attempt(write_rng_shard, tmp, ctx.rank, capture_rng())
    return error


def manifest(cfg: TrainConfig, engine: TrainEngine, ctx: ParallelContext, data, progress: Progress, spec, lr: float,
             run: str | None = None, spikes: dict | None = None) -> dict:
    """Rank 0's description of the run at this step (the store adds step, files and hashes); ``run``
    is the run's id (`mp_toolkit.run.save_dir`): --keep prunes only checkpoints of that id; ``spikes``
    the loss window of --spike-rewind (`run.spikes.SpikeGuard.state`)."""
    named = [(n, engine.master_of(p)) for n, p in engine.named_parameters()]
    scaler, schedule = engine.scaler, cfg.optim.lr_schedule
    return {
        **({"run": run} if run is not None else {}),
        **({"spikes": spikes} if spikes is not None else {}),
        "config": config_json(cfg), "model": spec.to_json(), "layout": layout_of(engine, ctx, cfg),
        "progress": dataclasses.asdict(progress), "data": data_state(data, ctx.dp),
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "lr_schedule": {"kind": type(schedule).__name__ if schedule is not None else "WarmupDecay",
                        "position": progress.applied + 1 if schedule is not None else progress.step + 1,
                        "last_lr": lr},
        "param_groups": [{k: v for k, v in g.items() if k != "params"}
                         for g in param_groups_by_name(engine.optimizer, named)],
        # an HF model's config (`--hf DIR`): `mp_toolkit.hf.export_checkpoint` writes it back out
        **({"hf_config": hf} if (hf := spec.family_record.hf_config(spec.config)) is not None else {}),
    }


def save_state(root: Path, meta: dict | None, engine: TrainEngine, ctx: ParallelContext, names: ModelNames, step: int,
               keep: int | None, after_shards=None) -> None:
    """Write one checkpoint of this step; every rank calls it, rank 0 passes ``meta`` (`manifest`).
    ``after_shards()`` runs once this rank's shards are written, before the commit (a test's fault hook).

    A failed write on any rank (a full disk, a read-only folder, an I/O error) stops every rank: rank 0
    removes this save's temp directory, ``latest`` stays on the previous complete checkpoint, and the
    lowest failing rank raises one `CheckpointError` line naming the file and the error."""
    error, tmp = None, None
    try:
        try:
            tmp = begin(root, step, create=ctx.rank == 0)
        except (CheckpointError, OSError) as e:
            error = one_line(e, root)
        agree(error, ctx)  # the directory exists before anyone writes into it
        error = write_shards(tmp, engine, ctx, names)
        if after_shards is not None:
            after_shards()
        agree(error, ctx)  # every shard is written before the commit
        error = None
        if ctx.rank == 0:
            try:
                commit(root, step, tmp, meta, keep=keep)
            except (CheckpointError, OSError) as e:
                error = one_line(e, root)
        agree(error, ctx)
    except (CheckpointError, PeerFailed) as e:
        if ctx.rank == 0 and tmp is not None:
            discard(tmp)
        if isinstance(e, CheckpointError):
            raise CheckpointError(f"saving step {step} failed: {e}; {still_latest(root)}") from None
        raise


def still_latest(root: Path) -> str:
    try:
        step = latest_step(root)
    except CheckpointError:
        step = None
    return (f"latest still names step-{step:08d}" if step is not None
            else "no checkpoint was committed")


def find_checkpoint(cfg: TrainConfig) -> Path | None:
    """What ``--resume`` names: None for "latest" / "auto" when the save dir holds no committed checkpoint."""
    ck = cfg.checkpoint
    if ck.resume in ("latest", "auto"):
        return ck.save_dir if latest_step(ck.save_dir) is not None else None
    return Path(ck.resume)


def reseed(seed: int, step: int) -> None:
    """Every generator from (seed, step): the same on every rank, as a fresh start seeds them."""
    s = (seed * 1_000_003 + step) % 2**63
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s % 2**32)


def _check_model(meta: dict, spec, path) -> None:
    saved = meta.get("model", {})
    mine = spec.to_json()
    if saved == mine:
        return
    if saved.get("family") != mine["family"]:
        raise ConfigError(f"{path} holds a {saved.get('family')} model, --model is a {mine['family']}: resume with "
                          "the model it was saved from")
    diff = [f"{k} {saved['config'].get(k)} vs {v}" for k, v in mine["config"].items() if saved["config"].get(k) != v]
    raise ConfigError(f"{path} was saved from another {mine['family']} config ({', '.join(diff[:4])}): resume with "
                      "the model it was saved from")


def _load_weights(ck, engine: TrainEngine, ctx: ParallelContext, names: ModelNames) -> None:
    """Model and optimizer state of this rank's parameters from the layers that hold them, one
    layer's files at a time (a layer's full tensors are dropped once its parameters hold their shares)."""
    local = engine.named_parameters()
    by_layer: dict[str, list] = {}
    for n, p in local:
        by_layer.setdefault(names.layer_of(names.canonical(n)), []).append((n, p))
    zero = engine.masters if getattr(engine, "zero", 0) else None
    states, scalars = {}, {}
    with torch.no_grad():
        for layer, params in by_layer.items():
            tensors, opt_t, opt_s = ck.read_layer(layer), *ck.read_optimizer(layer)
            for n, p in params:
                c = names.canonical(n)
                if c not in tensors:
                    raise CheckpointError(f"{ck.path}: layer {layer} has no {c} (saved from another model?)")
                if tensors[c].shape != full_shape(p, ctx.tp):
                    raise CheckpointError(f"{ck.path}: {c} has shape {tuple(tensors[c].shape)}, this model's is "
                                          f"{full_shape(p, ctx.tp)} (saved from another model?)")
                # ZeRO-1: this rank's piece of the master; the all-gather of copy_back fills the rest
                piece = (lambda t, p=p: zero.piece_of_full(p, t)) if zero else (lambda t: t)
                engine.master_of(p).copy_(piece(shard_full(tensors[c], p, ctx.tp_rank, ctx.tp)))
                if c in opt_t:
                    saved_shape = tensors[c].shape
                    states[n] = {k: piece(shard_full(v, p, ctx.tp_rank, ctx.tp)).clone()
                                 if v.shape == saved_shape else v for k, v in opt_t[c].items()}
                if c in opt_s:
                    scalars[n] = opt_s[c]
            del tensors, opt_t  # before the next layer is read
    engine.copy_back()
    named = [(n, engine.master_of(p)) for n, p in local if engine.master_of(p).numel()]
    states = {n: s for n, s in states.items() if n in dict(named)}
    # strict unless nothing was saved: a run whose every step was skipped has no state yet
    load_optimizer_state_by_name(engine.optimizer, named, states, scalars, strict=bool(states or scalars))


@dataclass(frozen=True)
class Resumed:
    """What `load_state` restored, and what rank 0 should say about it."""

    progress: Progress
    path: Path
    notes: tuple[str, ...]
    run: str | None = None
    """The id of the run that saved it (``meta.run``), None in checkpoints from before ids."""
    spikes: dict | None = None
    """The --spike-rewind state it was saved with (``meta.spikes``), None without."""


def _load(path, cfg: TrainConfig, engine: TrainEngine, ctx: ParallelContext, names: ModelNames, data, spec) -> Resumed:
    ck = open_checkpoint(path)
    meta = ck.manifest
    _check_model(meta, spec, ck.path)
    _load_weights(ck, engine, ctx, names)
    notes = []
    scaler = engine.scaler
    if scaler is not None and meta.get("loss_scaler") is not None:
        scaler.load_state_dict(meta["loss_scaler"])
    seq_len = cfg.batch.seq_len
    saved_len = meta.get("config", {}).get("seq_len", seq_len)
    resized = (saved_len, seq_len) if isinstance(saved_len, int) and saved_len != seq_len else None
    check_same_data(meta["data"], data, cfg, ck.path)
    state, note = data_position(meta["data"], data, ctx.dp, resized)
    data.load_state_dict(state)
    notes += [note] if note else []
    saved_layout = meta.get("layout", {})
    if saved_layout == layout_of(engine, ctx, cfg):
        restore_rng(ck.read_rng(ctx.rank))
    else:
        reseed(cfg.seed, ck.step)
        changed = [f"{k} {saved_layout.get(k)} -> {v}" for k, v in layout_of(engine, ctx, cfg).items()
                   if saved_layout.get(k) != v]
        notes.append(f"layout changed ({', '.join(changed)}): random generators reseeded from --seed and the step")
    saved_cfg, mine = meta.get("config", {}), config_json(cfg)
    laid_out = ("pp", "tp", "dp", "cp", "cp_attention", "sequence_parallel", "chunks", "schedule", "partition")
    changed = [f"{k} {saved_cfg.get(k)!r} -> {v!r}" for k, v in mine.items()
               if k not in RUN_CONTROL and k not in laid_out and saved_cfg.get(k) != v]
    if changed:
        notes.append(f"settings changed since the save: {', '.join(changed)}")
    progress = meta.get("progress", {})
    run = meta.get("run") if isinstance(meta.get("run"), str) else None
    spikes = meta.get("spikes") if isinstance(meta.get("spikes"), dict) else None
    return Resumed(Progress(step=ck.step, applied=int(progress.get("applied", ck.step))), ck.path, tuple(notes), run,
                   spikes)


def load_state(path, cfg: TrainConfig, engine: TrainEngine, ctx: ParallelContext, names: ModelNames, data,
               spec) -> Resumed:
    """Restore a checkpoint into this rank's engine, data iterator and generators (every rank calls it).
    A refused file or an impossible resume raises on every rank (`agree`)."""
    error, out = None, None
    try:
        out = _load(path, cfg, engine, ctx, names, data, spec)
    except (CheckpointError, ConfigError) as e:
        error = e
    except DataError as e:
        error = ConfigError(str(e))
    agree(error, ctx)
    return out
