"""The cut ``mpt train --partition flops|time`` makes for the model being trained.

* ``flops``: `cost.layer_costs` of the model's shape (GPT-2, BERT and Llama families: a model_zoo
  config's `mp_toolkit.arch.zoo` record gives it, an HF config is read by its architecture), balanced
  as ``mpt plan --method flops`` balances them (`solvers.min_max` of forward + backward FLOPs of
  one micro-batch at tp=1), so both commands cut a model alike. Pure arithmetic: every rank
  computes the same boundaries.
* ``time``: each layer timed on this machine (`measure.measure_layers`), on global rank 0 only,
  and the boundaries broadcast to every rank. Timings differ from rank to rank (and from run to
  run); two ranks that cut differently would wait on each other's messages forever.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_toolkit.arch.shape import ModelShape
from mp_toolkit.arch.zoo import zoo_family_of
from mp_toolkit.layers import LayerList
from mp_toolkit.names import V_SCHEDULES
from mp_toolkit.optim.master import PRECISIONS
from mp_toolkit.partition import PartitionError, by_parameters, explicit, uniform
from mp_toolkit.partition.cost import CostModelError, layer_costs, shape_from_hf_config
from mp_toolkit.partition.measure import TIMED_MICROBATCHES, measure_layers
from mp_toolkit.partition.vcut import balanced
from mp_toolkit.run.config import Batch, ConfigError, TrainConfig, parse_boundaries


@dataclass(frozen=True)
class CutWorkload:
    """What a ``flops`` or ``time`` cut needs beyond the layer list."""

    config: object
    """The model's config: model_zoo's GPTConfig / BertConfig, or anything whose ``to_dict()`` is a
    HuggingFace config dict (an HF model's config, `mp_toolkit.hf.model.HFSource`)."""
    batch: Batch
    """The run's batch section: a micro-batch of micro_batch x seq_len is costed or timed, over at most
    `TIMED_MICROBATCHES` of its micro-batches."""
    precision: str = "fp32"
    """What the timed layers compute in (``time``)."""
    ctx: object = None
    """The ParallelContext whose global rank 0 measures a ``time`` cut and broadcasts it; None
    (checking a config before any rank starts) checks that the model can be timed, and the FLOPs
    cut stands in for the measured one."""

    @classmethod
    def of(cls, cfg: TrainConfig, config, ctx=None) -> "CutWorkload":
        """The workload of ``cfg``'s run (its batch section and precision) for the model of ``config``."""
        return cls(config, cfg.batch, cfg.numerics.precision, ctx)


def config_of(model) -> object:
    """A model's config: model_zoo models carry ``.config``, `mp_toolkit.hf.model.HFModel` wraps HF's ``.model``."""
    return getattr(model, "config", None) or getattr(getattr(model, "model", None), "config", None)


def cost_shape(config) -> ModelShape:
    """The cost model's shape of the model of ``config``: its model_zoo record's, or read from its HF config dict."""
    zoo = zoo_family_of(config)
    if zoo is not None:
        return zoo.shape(config)
    try:
        return shape_from_hf_config(_hf_config_dict(config), "the model's config")
    except CostModelError as e:
        raise PartitionError(f"{e}; use parameters or uniform") from None


def _hf_config_dict(config) -> dict:
    """``config.to_dict()``, an HF config dict; PartitionError for a config the cost model cannot read."""
    d = config.to_dict() if hasattr(config, "to_dict") else None
    if not isinstance(d, dict):
        raise PartitionError(f"the cost model cannot read a {type(config).__name__}: use parameters or uniform")
    return d


def flops_cut(config, num_layers: int, num_stages: int, micro_batch: int, seq_len: int, v: bool = False) -> list[int]:
    """The boundaries of ``mpt plan --method flops`` for the model of ``config`` (``v``: `balanced`)."""
    try:
        costs = layer_costs(cost_shape(config), micro_batch, seq_len)
    except CostModelError as e:
        raise PartitionError(f"{e}; use parameters or uniform") from None
    if len(costs) != num_layers:
        raise PartitionError(f"the cost model describes {len(costs)} layers but the model has {num_layers}: "
                             f"use parameters or uniform")
    return balanced([c.flops_fwd + c.flops_bwd for c in costs], num_stages, v)


def time_cut(layer_list, num_stages: int, work: CutWorkload, v: bool = False) -> list[int]:
    """Boundaries minimising the slowest stage's (``v``: rank's, `balanced`) measured forward + backward;
    measured on global rank 0 and broadcast (see the module docstring)."""
    zoo = zoo_family_of(work.config)
    if zoo is None:
        _hf_config_dict(work.config)  # a config the cost model cannot read says so first
        raise PartitionError("time measures model_zoo GPT and BERT models so far: use flops or parameters")
    ctx = work.ctx
    if ctx is None:  # a check before the ranks start: the layers are shapes only
        return flops_cut(work.config, len(layer_list), num_stages, work.batch.micro_batch, work.batch.seq_len, v)
    shared = dist.is_initialized() and dist.get_world_size() > 1
    bounds = None
    if not shared or dist.get_rank() == 0:
        bounds = balanced(_measured_layer_times(layer_list, zoo.measure_batch, work), num_stages, v)
        print(f"--partition time: layers measured on this machine, cut {bounds}", flush=True)
    if shared:
        box = [bounds]
        dist.broadcast_object_list(box, src=0, device=ctx.device if ctx.device.type == "cuda" else None)
        bounds = box[0]
    return bounds


def _measured_layer_times(layer_list, measure_batch, work: CutWorkload) -> list[float]:
    """Forward + backward seconds per layer of a copy of ``layer_list`` in the run's precision on
    its device; torch's random state is left as it was (every rank must draw the same data). A
    meta-built list (`mpt train` builds GPT and BERT on meta) is copied with random N(0, 0.02)
    values: measuring rank 0 holds the whole model for that moment, the one exception to
    DESIGN.md invariant 9 (``--partition flops`` needs no values)."""
    batch, loss_fn = measure_batch(work.config)
    device = work.ctx.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        layers = copy.deepcopy(layer_list)
        if any(p.is_meta for p in layers.parameters()):  # a meta-built model: only timing needs values here
            layers.to_empty(device=device)
            for p in layers.parameters():
                torch.nn.init.normal_(p, std=0.02)
        layers = layers.to(device=device, dtype=PRECISIONS.get(work.precision, torch.float32))
        inputs, labels = batch(work.batch.micro_batch, work.batch.seq_len)
        move = lambda x: tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)  # noqa: E731
        timings = measure_layers(layers, move(inputs), loss_fn, move(labels),
                                 microbatches=min(work.batch.microbatches, TIMED_MICROBATCHES))
    return [t.forward_s + t.backward_s for t in timings]


def plan_boundaries(layer_list: LayerList, pp: int, partition: str, chunks: int = 1,
                    workload: CutWorkload | None = None, schedule: str | None = None) -> list[int]:
    """Boundaries of ``pp * chunks`` stages by method name or explicit ``0,3,7`` text. ``flops`` and
    ``time`` need ``workload`` (the model's config and batch; for ``time`` the context whose rank 0
    measures and broadcasts the cut, `time_cut`). ``schedule`` a V one (`V_SCHEDULES`): ``flops``,
    ``time`` and ``parameters`` balance ranks of two stages (`balanced`)."""
    v = schedule in V_SCHEDULES
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
                return flops_cut(workload.config, n, pp, workload.batch.micro_batch, workload.batch.seq_len, v)
            return time_cut(layer_list, pp, workload, v)
        if v:
            return balanced(layer_list.layer_parameter_counts(), pp, v)
        return by_parameters(layer_list.layer_parameter_counts(), pp)
    except PartitionError as e:
        raise ConfigError(f"--partition {partition}: {e}") from None
