"""HF directories from checkpoints of our own models (`mpt train --model gpt-tiny | gpt2 | config.json | bert-*`).

A checkpoint of a `model_zoo` run holds full tensors under our names and its manifest records the
model (``{"family": "gpt" | "bert", "config": {...}}``, `ModelSpec.to_json`). The HF model written:

    family  HF class              config
    gpt     GPT2LMHeadModel       GPT2Config: the GPTConfig fields (same spelling), eos = bos = 0
    bert    BertForPreTraining    BertConfig: the BertConfig fields (same spelling)

GPT names (``model_zoo.gpt``'s docstring): ours are nanoGPT's, HF's are GPT-2's, and our
projections are ``nn.Linear`` (weight (out, in)) where HF's are ``Conv1D`` (weight (in, out)), so
those four weights are transposed::

    embed.wte.weight / embed.wpe.weight  -> transformer.wte.weight / transformer.wpe.weight
    h.{i}.ln_1.* / h.{i}.ln_2.*          -> transformer.h.{i}.ln_1.* / ln_2.*
    h.{i}.attn.qkv.weight (3C, C)        -> transformer.h.{i}.attn.c_attn.weight (C, 3C)   (q, k, v order kept)
    h.{i}.attn.proj / mlp.fc / mlp.proj  -> attn.c_proj / mlp.c_fc / mlp.c_proj            (weights transposed)
    ln_f.ln_f.*                          -> transformer.ln_f.*
    lm_head.weight                       -> lm_head.weight   (the embedding itself when tied)

BERT names are `model_zoo.bert_hf`'s (our BERT is HF's module for module). What HF cannot express
(today: a GPT without biases; or a config field this module does not know) is refused in one line
rather than written as a model that computes something else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import transformers

from model_zoo import bert, bert_hf, gpt
from mp_toolkit.hf.export import HFTarget
from mp_toolkit.run.families import FAMILIES, ModelSpec

# GPTConfig fields GPT2Config spells and computes the same way; `bias` is checked on its own.
_GPT2_FIELDS = frozenset({"vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
                          "activation_function", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                          "layer_norm_epsilon", "initializer_range", "tie_word_embeddings"})
_BERT_FIELDS = frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "intermediate_size", "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob",
                          "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "initializer_range",
                          "pad_token_id", "tie_word_embeddings"})
_GPT_PREFIXES = (("embed.wte.", "transformer.wte."), ("embed.wpe.", "transformer.wpe."),
                 ("ln_f.ln_f.", "transformer.ln_f."), ("lm_head.", "lm_head."))
_GPT_BLOCK = {"ln_1": "ln_1", "ln_2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
              "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
_CONV1D = frozenset({"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"})  # nn.Linear here, Conv1D in HF


class ExportError(ValueError):
    """A checkpoint HF cannot hold as it is (one line naming what differs)."""


def zoo_spec(manifest: Mapping) -> ModelSpec | None:
    """The `ModelSpec` a `model_zoo` run recorded in its manifest, or None (not such a run)."""
    model = manifest.get("model")
    if not isinstance(model, Mapping) or model.get("family") not in ZOO_HF:
        return None
    family, cfg = model["family"], model.get("config")
    try:
        config = FAMILIES[family].config_from_dict(cfg)
    except (ValueError, TypeError) as e:
        raise ExportError(f"the manifest's {family} model config is not valid: {str(e).splitlines()[0]}") from None
    unknown = sorted(set(cfg) - ZOO_HF[family].known_fields)
    if unknown:  # a field added to our config later: it might change what the model computes
        raise ExportError(f"the {family} config field(s) {', '.join(unknown)} have no {ZOO_HF[family].hf_class} "
                          "counterpart known to the exporter: it cannot say the HF model computes the same")
    return ModelSpec(family, config)


def hf_config(spec: ModelSpec) -> transformers.PretrainedConfig:
    """The GPT2Config / BertConfig that makes HF compute what ``spec``'s model computes."""
    return ZOO_HF[spec.family].hf_config(spec.config)


def bert_hf_config(config: bert.BertConfig) -> transformers.BertConfig:
    """The BertConfig of our BERT's config: the same fields, the same spelling."""
    d = config.to_dict()
    return transformers.BertConfig(**{k: d[k] for k in _BERT_FIELDS}, architectures=["BertForPreTraining"])


def gpt2_config(config: gpt.GPTConfig) -> transformers.GPT2Config:
    """The GPT2Config of our GPT's config; a GPT without biases has none."""
    d = config.to_dict()
    if not config.bias:
        raise ExportError("this GPT has bias=False: HF GPT2LMHeadModel always has Linear and LayerNorm biases, "
                          "so it cannot hold this model (train with bias=true to export to GPT-2)")
    # our tokenizers put <|endoftext|> at id 0 (mp_toolkit.data.tokens.train_tokenizer); GPT-2's 50256 may not exist
    return transformers.GPT2Config(**{k: d[k] for k in _GPT2_FIELDS}, bos_token_id=0, eos_token_id=0,
                                   architectures=["GPT2LMHeadModel"])


def gpt_hf_name(name: str) -> tuple[str, bool]:
    """(HF GPT2LMHeadModel key, whether the weight is transposed) of one of our GPT's state keys."""
    for ours, theirs in _GPT_PREFIXES:
        if name.startswith(ours):
            return theirs + name[len(ours):], False
    parts = name.split(".")  # h.{i}.{module path}.{weight|bias}
    module = ".".join(parts[2:-1])
    if parts[0] != "h" or module not in _GPT_BLOCK:
        raise ExportError(f"parameter {name!r} has no HF GPT2LMHeadModel name")
    return f"transformer.h.{parts[1]}.{_GPT_BLOCK[module]}.{parts[-1]}", module in _CONV1D and parts[-1] == "weight"


def zoo_target(spec: ModelSpec, dtype: torch.dtype) -> HFTarget:
    """The HF class and config ``spec``'s model is written as (`ZOO_HF`), on meta."""
    return HFTarget.of(getattr(transformers, ZOO_HF[spec.family].hf_class), hf_config(spec), dtype)


def zoo_tensors_as_hf(named: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """A `model_zoo` checkpoint's ``(state key, tensor)`` pairs as ``(HF key, tensor)`` pairs (GPT's
    Linear weights transposed to Conv1D's (in, out)); `write_hf_dir` checks names and shapes."""
    hf_key = ZOO_HF[spec.family].hf_key
    for name, t in named:
        key, transpose = hf_key(name)
        yield key, (t.t().contiguous() if transpose else t)
        del t  # not held while the next one is read


@dataclass(frozen=True)
class ZooHF:
    """How a model_zoo family (`mp_toolkit.run.families.FAMILIES`) is written as an HF model: the export
    half of its record, here because it needs transformers."""

    hf_class: str
    """The HF class written (``architectures[0]``)."""
    known_fields: frozenset
    """Our config's fields the exporter knows HF computes alike."""
    hf_config: Callable[[object], transformers.PretrainedConfig]
    hf_key: Callable[[str], tuple[str, bool]]
    """(the HF class's key, whether the weight is transposed) of one of our model's state keys."""


ZOO_HF: Mapping[str, ZooHF] = MappingProxyType({
    "gpt": ZooHF("GPT2LMHeadModel", _GPT2_FIELDS | {"bias"}, gpt2_config, gpt_hf_name),
    "bert": ZooHF("BertForPreTraining", _BERT_FIELDS, bert_hf_config, lambda name: (bert_hf.hf_name(name), False)),
})

