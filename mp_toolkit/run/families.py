"""The model families `mpt train` trains, one `Family` record each, in one table (`FAMILIES`).

Family names, as ``--model`` / ``--hf`` select them and checkpoints record them (``manifest["model"]
["family"]``): ``"gpt"`` (model_zoo GPT, causal LM), ``"bert"`` (model_zoo BertForPreTraining: MLM +
NSP pre-training) and ``"hf"`` (a HuggingFace save_pretrained directory, `mp_toolkit.run.hf_family`).
The cost model's architectures ("gpt2", "bert", "llama", `mp_toolkit.arch.architectures`) describe
shapes, not families.

A `Family` is the run-level half: the micro-batches of one data-parallel replica and the last stage's
loss (vocab-parallel under ``--tp > 1``), and how the run builds and splits the model. What the model
itself is (its classes and presets, its shape for the cost model, its measurement batch, its TP plan,
its export half and its recomputation) is the model_zoo family's record (`Family.zoo`,
`mp_toolkit.arch.zoo`), or for "hf" the directory's architecture (`mp_toolkit.hf`). A run looks its
record up once (`ModelSpec.family_record`, `family_of`); nothing else compares family names.

BERT under ``--tp > 1``: the MLM decoder is vocab-sharded (``TP_PLAN["predictions.decoder"]``), so
the MLM part of the loss is `vocab_parallel_cross_entropy` over the local (B, T, V / tp) logits
(never gathered) and the NSP part a plain cross-entropy of the replicated (B, 2) logits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import datasets
import torch
import torch.nn.functional as F
from torch import nn

from model_zoo import bert, gpt
from model_zoo.config_io import read_config_json
from mp_toolkit.arch import zoo
from mp_toolkit.arch.architectures import architecture_of
from mp_toolkit.data.feed import Wanted
from mp_toolkit.errors import DataError
from mp_toolkit.hf.model import HFModel, HFSource
from mp_toolkit.layers import LayerList
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.context_parallel import apply_context_parallel, context_parallel_loss
from mp_toolkit.parallel.sequence_parallel import apply_sequence_parallel
from mp_toolkit.parallel.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy
from mp_toolkit.run.config import ConfigError, TrainConfig
from mp_toolkit.run.feeding import feed_batches


@dataclass(frozen=True)
class Family:
    """Everything `mpt train` asks of one model family."""

    name: str
    """The family's one spelling: "gpt", "bert" or "hf"."""
    zoo: zoo.ZooFamily | None
    """The model_zoo record the model-level fields below come from; None for "hf" (its architecture is
    its directory's: `mp_toolkit.hf`)."""
    model_class: type
    """What `build` returns (`family_of` recognises a model by it)."""
    config_class: type
    """Its config: ``gpt.GPTConfig``, ``bert.BertConfig`` or `mp_toolkit.hf.model.HFSource`."""
    build: Callable[[object], nn.Module]
    """config -> the plain model, initialised from torch's current RNG state (hf: the directory's weights)."""
    positions: Callable[[object], int]
    """config -> the longest sequence the model takes."""
    tp_sizes: Callable[[object], dict]
    """config -> the sizes a tensor-parallel degree must divide (`check_tensor_parallel`'s keywords)."""
    tensor_parallel: Callable[[LayerList, ParallelContext], LayerList]
    """(LayerList, ctx) -> this rank's shard by the family's TP plan."""
    sp_plan: Callable[[LayerList], Mapping[str, str]]
    """LayerList -> the family's sequence-parallel plan (`apply_sequence_parallel`)."""
    loss: Callable[[nn.Module, ParallelContext], Callable]
    """(model, ctx) -> the last stage's loss: on full logits, or with tp > 1 its vocab-parallel form."""
    micro_batches: Callable[[object, TrainConfig, ParallelContext, int], tuple]
    """(config, cfg, ctx, rank) -> (this replica's micro-batches, the config to build the model from)."""
    label: Callable[[object], str] = lambda config: ""
    """What the log adds to the family's name (hf: the HF architecture)."""
    hf_config: Callable[[object], dict | None] = lambda config: None
    """The HF config dict a checkpoint also records (``hf_config``, for export); None for model_zoo."""
    recompute_modes: tuple[str, ...] = ("full",)
    """The ``--recompute`` modes its blocks support ("none" aside): selective where the record's
    architecture recomputes its attention core alone (`mp_toolkit.arch.architectures.Architecture.selective`)."""
    builds_on_meta: bool = False
    """The model draws each parameter by name (`model_zoo.init`), so it can be built on the meta
    device and each rank materialise only its own layers (DESIGN.md invariant 9)."""

    @property
    def mlm(self) -> bool:
        """Trained on MLM + NSP sentence pairs with BERT's [PAD] [CLS] [SEP] [MASK] after the BPE."""
        return self.zoo is not None and self.zoo.mlm


@dataclass(frozen=True)
class ModelSpec:
    """A model family and its config (``gpt.GPTConfig``, ``bert.BertConfig`` or ``hf.model.HFSource``)."""

    family: str
    config: object

    @property
    def family_record(self) -> Family:
        return FAMILIES[self.family]

    @property
    def positions(self) -> int:
        return self.family_record.positions(self.config)

    @property
    def label(self) -> str:
        """What the log calls it: the family, and for "hf" the HF architecture."""
        return " ".join(filter(None, (self.family, self.family_record.label(self.config))))

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def tp_sizes(self) -> dict[str, int]:
        """The sizes a tensor-parallel degree must divide (`check_tensor_parallel`'s keywords)."""
        return self.family_record.tp_sizes(self.config)

    def build(self) -> nn.Module:
        """The plain model, initialised from torch's current RNG state (hf: the directory's weights)."""
        return self.family_record.build(self.config)

    @property
    def builds_on_meta(self) -> bool:
        return self.family_record.builds_on_meta

    def to_json(self) -> dict:
        return {"family": self.family, "config": self.config.to_dict()}


def resolve_model(name: str) -> ModelSpec:
    """``--model``: a GPT or BERT preset, or a config.json whose ``model_type`` says which (GPT-2 when absent)."""
    record = zoo.preset_family(name)
    if record is not None:
        return ModelSpec(record.name, record.presets[name])
    path = Path(name)
    if not (path.is_file() or (path.is_dir() and (path / "config.json").is_file())):
        raise ConfigError(f"unknown model {name!r}: choose one of {', '.join(zoo.preset_names())} "
                          "or a path to a GPT-2 or BERT config.json")
    try:
        doc = read_config_json(path, "model")
        kind = doc.get("model_type", "gpt2") if isinstance(doc, dict) else "gpt2"
        arch = architecture_of(kind)
        record = zoo.zoo_family_on(arch) if arch is not None else None
        if record is None:
            raise ValueError(f"{path}: model_type {kind!r} is not trained by mpt train --model: use gpt2 or bert, "
                             "or --hf DIR for a save_pretrained directory (Llama, Mistral, Qwen2 too)")
        return ModelSpec(record.name, record.config_from_dict(doc))
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def _hf():
    """`mp_toolkit.run.hf_family`, the rest of the family "hf", imported when an ``--hf`` run asks for it."""
    from mp_toolkit.run import hf_family  # imports transformers (seconds, optional): only --hf runs need it

    return hf_family


def resolve_hf(directory: str, cfg: TrainConfig | None = None) -> ModelSpec:
    """``--hf DIR`` -> ModelSpec("hf", HFSource), checked against the run ``cfg`` when given
    (`check_spec`); one-line ConfigError for a directory that cannot work."""
    spec = ModelSpec("hf", _hf().read_source(directory))
    if cfg is not None:
        check_spec(spec, cfg)
    return spec


def check_spec(spec: ModelSpec, cfg: TrainConfig) -> None:
    """One-line ConfigError where the run ``cfg`` cannot train ``spec``'s model: a sequence longer than its
    positions; for an HF directory also the HF tensor-parallel plan's sizes, every weight's header and the
    tokenizer (`hf_family.check_hf`)."""
    if cfg.parallel.cp > 1:
        _check_context_parallel(spec, cfg)
    if spec.family == "hf":
        _hf().check_hf(spec.config, cfg)
    elif cfg.batch.seq_len > spec.positions:
        raise ConfigError(f"--seq-len {cfg.batch.seq_len} exceeds {cfg.model}'s {spec.positions} positions: "
                          f"use at most {spec.positions}")


def _check_context_parallel(spec: ModelSpec, cfg: TrainConfig) -> None:
    """``--cp`` takes model_zoo's GPT and HF's Llama family (causal, full attention, no attention dropout)."""
    cp = cfg.parallel.cp
    hf = spec.config.config if spec.family == "hf" else None
    arch = architecture_of(hf.get("model_type")) if hf is not None else None
    if spec.family == "bert" or (hf is not None and (arch is None or arch.name != "llama")):
        what = "BERT (its bidirectional, padded attention)" if spec.family == "bert" or spec.config.is_bert else (
            f"--hf {spec.config.architecture}")
        raise ConfigError(f"--cp {cp}: context parallelism is built for model_zoo's GPT and HF's Llama family; "
                          f"{what} cannot use it yet")
    if hf is None:
        dropout, name = spec.config.attn_pdrop, "attn_pdrop"
    else:
        dropout, name = float(hf.get("attention_dropout") or 0.0), "attention_dropout"
        window = hf.get("sliding_window")
        sliding = window is not None and (hf.get("model_type") == "mistral" or hf.get("use_sliding_window"))
        if sliding and window < cfg.batch.seq_len:
            raise ConfigError(f"--cp {cp}: a sliding window of {window} tokens, narrower than --seq-len "
                              f"{cfg.batch.seq_len}, is not built for the ring: use a wider window or a shorter "
                              "sequence")
    if dropout > 0:
        raise ConfigError(f"--cp {cp}: ring attention has no dropout on the attention probabilities, and the "
                          f"model has {name} {dropout:g}: use a config with {name} 0")
    heads = spec.config.n_head if hf is None else int(hf.get("num_attention_heads") or 0)
    if cfg.parallel.cp_attention == "ulysses" and heads % (cp * cfg.parallel.tp):
        raise ConfigError(f"--cp-attention ulysses splits each tp rank's heads over the cp ranks: cp x tp = "
                          f"{cp * cfg.parallel.tp} does not divide the {heads} heads (use --cp-attention ring)")


def family_of(model: nn.Module) -> Family:
    """The record of the family whose `Family.build` made ``model``."""
    for family in FAMILIES.values():
        if isinstance(model, family.model_class):
            return family
    raise TypeError(f"mpt train builds GPT or BertForPreTraining models, not {type(model).__name__}")


def bert_vocab_parallel_loss(outputs, labels, group) -> torch.Tensor:
    """`pretraining_loss` with the MLM logits vocab-sharded over ``group``: (B, T, V / tp) local."""
    (mlm_logits, nsp_logits), (mlm_labels, nsp_labels) = outputs, labels
    return (vocab_parallel_cross_entropy(mlm_logits, mlm_labels, group)
            + F.cross_entropy(nsp_logits.float(), nsp_labels.reshape(-1)))


def tensor_parallel(model: nn.Module, layers: LayerList, ctx: ParallelContext,
                    sequence_parallel: bool = False, cp_attention: str = "ring") -> LayerList:
    """This rank's tensor-parallel shard of ``layers`` (the LayerList of ``model``) by its family's
    plan, then, with ``sequence_parallel``, its sequence-parallel plan (`apply_sequence_parallel`)."""
    family = family_of(model)
    layers = family.tensor_parallel(layers, ctx)
    if sequence_parallel:
        apply_sequence_parallel(layers, ctx, dict(family.sp_plan(layers)))
    if ctx.cp > 1:
        apply_context_parallel(layers, ctx, cp_attention)
    return layers


def loss_function(model: nn.Module, ctx: ParallelContext):
    """The last stage's loss: on full logits, or with tp > 1 its vocab-parallel form; with cp > 1 on
    this rank's tokens, scaled to its share (`context_parallel_loss`)."""
    return context_parallel_loss(family_of(model).loss(model, ctx), ctx)


def micro_batches(spec: ModelSpec, cfg: TrainConfig, ctx: ParallelContext, rank: int) -> tuple:
    """(this replica's micro-batches, the spec to build the model from). Every rank of a
    data-parallel replica (its tp and pp ranks) reads the same shard. BERT's padding id is the
    corpus's [PAD], so the spec returned carries it."""
    if not cfg.logging.progress or rank != 0:
        datasets.disable_progress_bars()  # the corpus's map() would draw one per rank (and `mp_toolkit.progress`'s)
    try:
        data, config = spec.family_record.micro_batches(spec.config, cfg, ctx, rank)
    except DataError as e:
        raise ConfigError(str(e)) from None
    return data, ModelSpec(spec.family, config)


def _wanted(vocab_size: int, cfg: TrainConfig, pairs: bool = False, hf_order: bool = False,
            tokenizer=None) -> Wanted:
    return Wanted(vocab_size, cfg.batch.seq_len, cfg.seed, pairs=pairs, hf_order=hf_order,
                  tokenizer=tokenizer if tokenizer is not None else cfg.dataset.tokenizer)


def _gpt_micro_batches(config: gpt.GPTConfig, cfg: TrainConfig, ctx: ParallelContext, rank: int) -> tuple:
    return feed_batches(cfg, ctx, rank, _wanted(config.vocab_size, cfg))[0], config


def _bert_micro_batches(config: bert.BertConfig, cfg: TrainConfig, ctx: ParallelContext, rank: int) -> tuple:
    data, fed = feed_batches(cfg, ctx, rank, _wanted(config.vocab_size, cfg, pairs=True))
    return data, dataclasses.replace(config, pad_token_id=fed.special.pad)


def _tp_loss(full_loss: Callable, parallel_loss: Callable) -> Callable:
    """(model, ctx) -> ``full_loss``, or ``parallel_loss`` over ``ctx.tp_group`` when tp > 1."""
    return lambda model, ctx: full_loss if ctx.tp_group is None else functools.partial(parallel_loss,
                                                                                         group=ctx.tp_group)


def _zoo_family(record: zoo.ZooFamily, micro_batches: Callable, parallel_loss: Callable) -> Family:
    """The family of a model_zoo record: the model's parts from the record, the data and loss given."""
    return Family(
        name=record.name, zoo=record, model_class=record.model_class, config_class=record.config_class,
        build=record.model_class, positions=record.positions,
        tp_sizes=lambda c: record.arch.tp_sizes(record.shape(c)),  # the vocab is padded
        tensor_parallel=lambda layers, ctx: apply_tensor_parallel(layers, ctx, record.tp_plan),
        sp_plan=lambda layers: record.sp_plan,
        loss=_tp_loss(record.loss, parallel_loss), micro_batches=micro_batches,
        recompute_modes=("full", "selective") if record.arch.selective else ("full",),
        builds_on_meta=True,
    )


GPT = _zoo_family(zoo.GPT, _gpt_micro_batches, vocab_parallel_cross_entropy)
BERT = _zoo_family(zoo.BERT, _bert_micro_batches, bert_vocab_parallel_loss)
HF = Family(
    name="hf", zoo=None, model_class=HFModel, config_class=HFSource, build=lambda source: _hf().build_model(source),
    positions=lambda source: source.positions,
    tp_sizes=lambda source: {},  # `hf_family.check_hf` checks the HF plan's sizes (grouped-query heads too)
    tensor_parallel=lambda layers, ctx: _hf().hf_tensor_parallel(layers, ctx),
    sp_plan=lambda layers: _hf().hf_sp_plan(layers),
    loss=lambda model, ctx: _hf().hf_loss(model, ctx),
    micro_batches=lambda source, cfg, ctx, rank: _hf().hf_micro_batches(source, cfg, ctx, rank),
    label=lambda source: source.architecture, hf_config=lambda source: source.to_dict(),
)
FAMILIES: Mapping[str, Family] = MappingProxyType({f.name: f for f in (GPT, BERT, HF)})
