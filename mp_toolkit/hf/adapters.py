"""`from_hf`: a HuggingFace transformers model -> LayerList, by walking the model's own modules.

No tracing: each supported architecture has an adapter (``gpt2.py``, ``bert.py``, ``llama.py``) that
puts HF's embeddings, blocks, norms and heads, unchanged, inside thin layers that only adapt the
calling convention (a tuple out is the next layer's arguments) and carry masks / positions as
tensors. So the math is HF's, and the LayerList shares its modules (its Parameters) with the model:
training the LayerList trains the model (``copy.deepcopy(model)`` first to keep one untouched).

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("gpt2")
    layers = from_hf(model)                  # embed, h.0 .. h.11, ln_f, lm_head
    logits = layers(input_ids=input_ids, attention_mask=attention_mask)   # as model(...) is called
"""

from __future__ import annotations

from torch import nn

from mp_toolkit.arch.architectures import Architecture, architecture_of_layers
from mp_toolkit.hf.bert import bert_layers
from mp_toolkit.hf.calling import HFLayerList
from mp_toolkit.hf.common import layer_state_dict, tie_groups
from mp_toolkit.hf.gpt2 import gpt2_layers
from mp_toolkit.hf.llama import FAMILIES as LLAMA_FAMILIES
from mp_toolkit.hf.llama import llama_layers
from mp_toolkit.layers import LayerList

# HF class name -> adapter; also what `export_hf` can write.
ADAPTERS = {
    "GPT2LMHeadModel": gpt2_layers,
    "BertForPreTraining": bert_layers,
    "BertForMaskedLM": bert_layers,
    **{name: llama_layers for name in LLAMA_FAMILIES},
}
SUPPORTED = tuple(ADAPTERS)


class UnsupportedModelError(ValueError):
    """An architecture `from_hf` has no adapter for (one line, for the CLI's exit 2)."""


def unsupported(name: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{name} is not supported by from_hf: supported architectures are {', '.join(SUPPORTED)}; "
        "for another model build the layer list yourself, LayerList([(name, module), ...], tie_groups), "
        "where each layer takes the previous layer's output (a tuple is unpacked into its arguments)")


def from_hf(model: nn.Module) -> HFLayerList:
    """The LayerList of a supported HF model (GPT-2, BERT pre-training / MLM, Llama, Mistral, Qwen2).

    Layer names: GPT-2 ``embed, h.{i}, ln_f, lm_head``; BERT ``embeddings, encoder.layer.{i}, heads``;
    Llama family ``embed_tokens, layers.{i}, norm, lm_head``. Tied embeddings (HF's
    ``tie_word_embeddings``) become a tie group. It is called as the HF model is
    (`mp_toolkit.hf.calling`): HF's positional order (BERT: ``input_ids, attention_mask,
    token_type_ids``) or keywords, ``labels=`` giving HF's ``(loss, logits, ...)`` tuple; without
    labels, logits (B, T, V) (BertForPreTraining: prediction and next-sentence logits). The model's
    mode (train / eval) and ``attn_implementation`` are used as they are.
    """
    name = type(model).__name__
    build = ADAPTERS.get(name)
    if build is None or not type(model).__module__.startswith("transformers."):
        raise unsupported(name)
    layers = build(model)
    return HFLayerList.of(model, layers, tie_groups(layers))


def architecture_of_list(layer_list: LayerList) -> Architecture:
    """The architecture (`mp_toolkit.arch.architectures`: gpt2, bert or llama, the Llama family being
    Mistral and Qwen2 too) of a LayerList `from_hf` built, read off its layer names."""
    arch = architecture_of_layers(layer_list.names)
    if arch is None:
        raise ValueError(f"layer list {list(layer_list.names)[:4]}... was not built by from_hf")
    return arch


def hf_name_map(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """``{LayerList state key: (HF state key, ...)}`` for ``from_hf(model)``, matched by identity: a
    LayerList tensor *is* an HF tensor (a tied weight has several keys), e.g. for GPT-2
    ``h.0.block.attn.c_attn.weight -> transformer.h.0.attn.c_attn.weight``, ``embed.wte.weight ->
    transformer.wte.weight, lm_head.weight``. Loading (`pretrained`) and writing (`mp_toolkit.export`) use it."""
    hf_keys: dict[int, list[str]] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        hf_keys.setdefault(id(t), []).append(key)
    ours = layer_state_dict(from_hf(model), keep_vars=True)
    missing = [k for k, t in ours.items() if id(t) not in hf_keys]
    if missing:  # cannot happen for a layer list from_hf built from this model
        raise ValueError(f"LayerList tensors {missing[:3]} are not tensors of {type(model).__name__}")
    return {k: tuple(hf_keys[id(t)]) for k, t in ours.items()}
