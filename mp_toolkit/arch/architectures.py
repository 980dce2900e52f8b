"""One `Architecture` record per kind of Transformer the toolkit plans, splits and trains.

An architecture is what the cost model, the tensor-parallel split and the HF adapters need to know
of a model, whichever code built it (`model_zoo` or transformers): ``ModelShape.family`` names it,
and everything that differs between architectures is a field here, looked up once
(`ARCHITECTURES[shape.family]`, `architecture_of(model_type)`) instead of compared as a string.

    name    HF model_type             layers (embedding, blocks, final norm, head)
    gpt2    gpt2                      embed, h.{i}, ln_f, lm_head
    bert    bert                      embeddings, encoder.layer.{i}, heads
    llama   llama, mistral, qwen2     embed_tokens, layers.{i}, norm, lm_head
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from model_zoo import bert
from mp_toolkit.arch.costs import BERT_LAYERS, GPT2_LAYERS, LLAMA_LAYERS, LayerArithmetic
from mp_toolkit.arch.shape import ModelShape


@dataclass(frozen=True)
class LayerKinds:
    """Layer names and class names (what ``type:REGEX`` partitions match) of each kind of layer."""

    embedding: tuple[str, str]
    block: tuple[str, str]
    """The block's name has ``{i}`` for its index."""
    final_norm: tuple[str, str] | None
    head: tuple[str, str]


@dataclass(frozen=True)
class Architecture:
    """Everything below the run that differs between GPT-2, BERT and the Llama family."""

    name: str
    """``ModelShape.family``: "gpt2", "bert" or "llama"."""
    model_types: tuple[str, ...]
    """The HF ``model_type`` values read as this architecture."""
    layers: LayerKinds
    read: Callable[[Mapping, str, bool], ModelShape]
    """(HF config dict, its model_type, built from transformers' modules) -> its shape, dropout
    included; a KeyError names a key the config lacks."""
    costs: LayerArithmetic
    """The cost model's arithmetic of each kind of layer (`mp_toolkit.arch.costs`)."""
    causal: bool
    """Attention sees earlier positions only (the cost model counts the lower triangle)."""
    selective: bool
    """Its model_zoo blocks recompute their attention core alone (``--recompute selective``,
    `model_zoo.recompute`); every layer can recompute in full."""
    hf_tp_plan: Mapping[str, str]
    """The tensor-parallel plan of a `from_hf` layer list (`mp_toolkit.hf.tp_plans`), as data in the
    format of `model_zoo.gpt.TP_PLAN`."""
    hf_sp_plan: Mapping[str, str]
    """The sequence-parallel plan of a `from_hf` layer list, applied after its TP plan
    (`mp_toolkit.parallel.sequence_parallel`; the format of `model_zoo.gpt.SP_PLAN`)."""
    tp_sizes: Callable[[ModelShape], dict[str, int]]
    """The sizes a tensor-parallel degree must divide (`check_tensor_parallel`'s keywords); grouped
    key/value heads are checked on their own."""


def _read_gpt2(d: Mapping, model_type: str, hf_modules: bool) -> ModelShape:
    h = d.get("n_embd", 768)
    absent = 0.1 if hf_modules else 0.0  # HF GPT2Config's default; model_zoo GPTConfig's is 0
    p = {k: float(d.get(k, absent) or 0.0) for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop")}
    return ModelShape("gpt2", d.get("vocab_size", 50257), h, d.get("n_layer", 12), d.get("n_head", 12),
                      d.get("n_inner") or 4 * h, d.get("n_positions", 1024), tied=d.get("tie_word_embeddings", True),
                      attn_dropout=p["attn_pdrop"], hidden_dropout=p["resid_pdrop"], embd_dropout=p["embd_pdrop"],
                      hf_modules=hf_modules)


def _read_bert(d: Mapping, model_type: str, hf_modules: bool) -> ModelShape:
    shape = ModelShape("bert", d["vocab_size"], d["hidden_size"], d["num_hidden_layers"], d["num_attention_heads"],
                       d["intermediate_size"], d.get("max_position_embeddings", 512),
                       tied=d.get("tie_word_embeddings", True), type_vocab=d.get("type_vocab_size", 2))
    hidden = float(d.get("hidden_dropout_prob", 0.1) or 0.0)  # HF's and model_zoo's BertConfig both default to 0.1
    return replace(shape, attn_dropout=float(d.get("attention_probs_dropout_prob", 0.1) or 0.0),
                   hidden_dropout=hidden, embd_dropout=hidden, hf_modules=hf_modules)


def _read_llama(d: Mapping, model_type: str, hf_modules: bool) -> ModelShape:
    # attention_dropout is 0 in practice: not modelled
    return ModelShape("llama", d["vocab_size"], d["hidden_size"], d["num_hidden_layers"], d["num_attention_heads"],
                      d["intermediate_size"], kv_heads=d.get("num_key_value_heads") or 0,
                      head_dim=d.get("head_dim") or 0, tied=d.get("tie_word_embeddings", False),
                      qkv_bias=model_type in QKV_BIAS_MODEL_TYPES or bool(d.get("attention_bias", False)),
                      hf_modules=hf_modules)


QKV_BIAS_MODEL_TYPES = ("qwen2",)
"""Llama-family model types whose q/k/v projections always have biases."""


def _heads_hidden_inner(shape: ModelShape) -> dict[str, int]:
    return dict(n_head=shape.heads, hidden=shape.hidden, inner=shape.ffn)


GPT2 = Architecture(
    name="gpt2", model_types=("gpt2",),
    layers=LayerKinds(("embed", "GPTEmbedding"), ("h.{i}", "GPTBlock"), ("ln_f", "GPTFinalNorm"),
                      ("lm_head", "GPTLMHead")),
    read=_read_gpt2, costs=GPT2_LAYERS, causal=True, selective=True,
    # HF's c_attn / c_proj / c_fc are Conv1D (weight (in, out)): `mp_toolkit.hf.conv1d_parallel` shards them
    hf_tp_plan=MappingProxyType({
        "embed.wte": "vocab",
        "attn.c_attn": "qkv",  # fused [q | k | v] columns: stride 3
        "attn.c_proj": "row",
        "mlp.c_fc": "column",
        "mlp.c_proj": "row",
        "lm_head": "vocab",    # tied to wte by default: the same vocab shard
    }),
    hf_sp_plan=MappingProxyType({
        "embed": "scatter",
        "attn": "gather",
        "mlp": "gather",
        "attn.resid_dropout": "dropout",
        "mlp.dropout": "dropout",
        "lm_head": "gather",
    }),
    tp_sizes=_heads_hidden_inner,
)
BERT = Architecture(
    name="bert", model_types=("bert",),
    layers=LayerKinds(("embeddings", "BertEmbeddings"), ("encoder.layer.{i}", "BertLayer"), None,
                      ("heads", "BertPreTrainingHeads")),
    read=_read_bert, costs=BERT_LAYERS, causal=False, selective=True,
    hf_tp_plan=MappingProxyType(bert.TP_PLAN),  # our BERT is HF's module for module: one plan for both
    hf_sp_plan=MappingProxyType(bert.SP_PLAN),
    tp_sizes=_heads_hidden_inner,
)
LLAMA = Architecture(
    name="llama", model_types=("llama", "mistral", "qwen2"),
    layers=LayerKinds(("embed_tokens", "Embedding"), ("layers.{i}", "LlamaDecoderLayer"), ("norm", "LlamaRMSNorm"),
                      ("lm_head", "LMHead")),
    read=_read_llama, costs=LLAMA_LAYERS, causal=True, selective=False,
    hf_tp_plan=MappingProxyType({
        "embed_tokens.embed_tokens": "vocab",
        "self_attn.q_proj": "column",
        "self_attn.k_proj": "column",  # whole k/v heads: tp must divide num_key_value_heads
        "self_attn.v_proj": "column",
        "self_attn.o_proj": "row",
        "mlp.gate_proj": "column",
        "mlp.up_proj": "column",
        "mlp.down_proj": "row",
        "lm_head": "vocab",
    }),
    hf_sp_plan=MappingProxyType({
        "embed_tokens": "scatter",
        "self_attn": "gather",
        "mlp": "gather",
        "lm_head": "gather",
    }),
    tp_sizes=lambda shape: dict(n_head=shape.heads, inner=shape.ffn),  # hidden: whole heads of head_dim
)
ARCHITECTURES: Mapping[str, Architecture] = MappingProxyType({a.name: a for a in (GPT2, BERT, LLAMA)})
"""By ``ModelShape.family``."""
BY_MODEL_TYPE: Mapping[str, Architecture] = MappingProxyType({t: a for a in ARCHITECTURES.values()
                                                              for t in a.model_types})
"""By HF ``model_type``."""


def architecture_of(model_type) -> Architecture | None:
    """The architecture an HF config of ``model_type`` is read as, or None."""
    return BY_MODEL_TYPE.get(model_type)


def architecture_of_layers(names) -> Architecture | None:
    """The architecture of a layer list, known by its embedding layer's name, or None."""
    names = set(names)
    return next((a for a in ARCHITECTURES.values() if a.layers.embedding[0] in names), None)
