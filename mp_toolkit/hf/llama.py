"""HF Llama-family causal LMs (Llama, Mistral, Qwen2) as a layer list:
embed_tokens -> layers.0 .. layers.{L-1} -> norm -> lm_head.

    embed_tokens(input_ids, attention_mask=None, position_ids=None)
                                    -> (hidden (B, T, C), attention_mask (B, T), position_ids (1, T))
    layers.i(hidden, attention_mask, position_ids) -> (hidden, attention_mask, position_ids)
    norm(hidden, attention_mask, position_ids)     -> hidden
    lm_head(hidden)                                -> logits (B, T, V)

``layers.i`` runs HF's own decoder layer, ``norm`` its RMSNorm, ``lm_head`` *is* HF's nn.Linear.

Rotary embeddings are recomputed in every block from the int64 position ids, with HF's own rotary
module (one module object shared by all blocks; it has no parameters). HF computes (cos, sin) once
per forward; recomputing gives the same bits (the same function of the same positions) and costs
two (B, T, head_dim) elementwise maps per block, whereas sending them would add two float tensors
per stage boundary, each with a gradient travelling back for nothing.

Masks are rebuilt per block as the HF model builds them (`mp_toolkit.hf.common`): Llama uses the
causal mask, Mistral the sliding-window mask when ``config.sliding_window`` is set, Qwen2 the
mask of each layer's ``config.layer_types[i]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from mp_toolkit.hf.common import FinalNorm, padding_mask, whole_sequence

FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


class LlamaEmbed(nn.Module):
    """Token embedding; starts the mask and position ids (0..T-1, HF's default) on their way."""

    def __init__(self, embed_tokens: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None):
        hidden = self.embed_tokens(input_ids)  # (B, T) -> (B, T, C)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)  # (1, T)
        return hidden, padding_mask(input_ids, attention_mask), position_ids


class LlamaBlockLayer(nn.Module):
    """One HF decoder layer with its mask and rotary (cos, sin) rebuilt from the travelling ints."""

    def __init__(self, block: nn.Module, rotary_emb: nn.Module, config, mask_fn: Callable):
        super().__init__()
        self.block = block
        self.rotary_emb = rotary_emb  # shared by every block; buffers only (inv_freq)
        self.config = config
        self.mask_fn = mask_fn

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        mask = self.mask_fn(config=self.config, inputs_embeds=whole_sequence(hidden, attention_mask),
                            attention_mask=attention_mask,
                            cache=None, position_ids=position_ids)
        cos_sin = self.rotary_emb(hidden, position_ids=position_ids)  # 2 x (B or 1, T, head_dim)
        hidden = self.block(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin)
        return hidden, attention_mask, position_ids


def _mask_fn(family: str, config, i: int) -> Callable:
    """The mask function HF's model forward uses for decoder layer ``i``."""
    if family == "mistral":
        return create_causal_mask if config.sliding_window is None else create_sliding_window_causal_mask
    if family == "qwen2" and config.layer_types[i] == "sliding_attention":
        return create_sliding_window_causal_mask
    return create_causal_mask


def llama_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The named layers of a Llama / Mistral / Qwen2 ``*ForCausalLM`` (sharing its modules)."""
    family, config, base = FAMILIES[type(model).__name__], model.config, model.model
    blocks = [(f"layers.{i}", LlamaBlockLayer(block, base.rotary_emb, config, _mask_fn(family, config, i)))
              for i, block in enumerate(base.layers[:config.num_hidden_layers])]
    return ([("embed_tokens", LlamaEmbed(base.embed_tokens))] + blocks
            + [("norm", FinalNorm(base.norm)), ("lm_head", model.lm_head)])
