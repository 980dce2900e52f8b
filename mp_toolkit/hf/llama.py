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

Context parallelism (`mp_toolkit.parallel.context_parallel.apply_context_parallel`) sets the two
attributes it looks for: ``LlamaEmbed.tokens`` (which tokens of each sequence this rank embeds: their
ids, and their positions as the position ids, so the rotary embedding follows the slice) and
``LlamaBlockLayer.core`` (the ring): the block's attention module then gets its own copy of the config
whose ``_attn_implementation`` is `RING_ATTENTION`, registered with HF's ``AttentionInterface``, which
hands HF's q, k, v (grouped-query heads repeated) to the ring. Sequences must be unpadded and
attention causal over the whole sequence: a sliding window narrower than the sequence and attention
dropout are refused in one line (a window as wide as the sequence is the causal mask).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import AttentionInterface

from mp_toolkit.hf.common import FinalNorm, padding_mask, whole_sequence

FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


RING_ATTENTION = "mp_toolkit_ring"
"""The ``_attn_implementation`` of a context-parallel block's attention (module docstring)."""


def ring_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """HF's attention-function signature over ``module.ring_core``: (B, H, t, hd) queries, (B, KVH, t, hd)
    keys and values -> ((B, t, H, hd), None). The ring is causal over the zig-zag tokens and unmasked."""
    if attention_mask is not None:
        raise ValueError("context parallelism: the ring attends causally over whole sequences; a padding or "
                         "window mask cannot be applied")
    if scaling is not None and not math.isclose(scaling, query.shape[-1] ** -0.5):
        raise ValueError(f"context parallelism: the ring scales scores by 1/sqrt(head_dim), not {scaling:g}")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each k/v head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = module.ring_core(query, key, value, False, dropout_p=dropout)
    return out.transpose(1, 2), None


AttentionInterface.register(RING_ATTENTION, ring_attention_forward)


class LlamaEmbed(nn.Module):
    """Token embedding; starts the mask and position ids (0..T-1, HF's default) on their way.

    ``tokens`` (None: every token): as `model_zoo.gpt.GPTEmbedding.tokens` -- the positions of the
    tokens this layer embeds; their ids are embedded and their positions become the position ids."""

    tokens = None

    def __init__(self, embed_tokens: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)  # (1, T)
        mask = padding_mask(input_ids, attention_mask)  # (B, T): the whole sequences'
        if self.tokens is not None:
            pos = self.tokens(input_ids.shape[1], input_ids.device)
            input_ids, position_ids = input_ids[:, pos], position_ids[:, pos]
        hidden = self.embed_tokens(input_ids)  # (B, T) -> (B, T, C)
        return hidden, mask, position_ids


class LlamaBlockLayer(nn.Module):
    """One HF decoder layer with its mask and rotary (cos, sin) rebuilt from the travelling ints."""

    def __init__(self, block: nn.Module, rotary_emb: nn.Module, config, mask_fn: Callable):
        super().__init__()
        self.block = block
        self.rotary_emb = rotary_emb  # shared by every block; buffers only (inv_freq)
        self.config = config
        self.mask_fn = mask_fn
        self._core = None

    @property
    def core(self):
        """The attention core under context parallelism (None: HF's own attention); setting it gives the
        block's attention module `RING_ATTENTION` (module docstring)."""
        return self._core

    @core.setter
    def core(self, core) -> None:
        attn = self.block.self_attn
        if getattr(attn, "attention_dropout", 0.0):
            raise ValueError("context parallelism: the ring has no attention dropout (attention_dropout 0)")
        attn.config = copy.copy(attn.config)
        attn.config._attn_implementation = RING_ATTENTION
        attn.ring_core = core
        self._core = core

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        if self._core is not None:  # the ring: causal over whole, unpadded sequences
            if not bool(attention_mask.all()):
                raise ValueError("context parallelism takes unpadded sequences: a padding mask reached the ring")
            window = self.config.sliding_window if self.mask_fn is not create_causal_mask else None
            if window is not None and window < attention_mask.shape[1]:
                raise ValueError(f"context parallelism: a sliding window of {window} tokens, narrower than the "
                                 f"{attention_mask.shape[1]}-token sequence, is not built for the ring")
            mask = None
        else:
            mask = self.mask_fn(config=self.config, inputs_embeds=whole_sequence(hidden, attention_mask),
                                attention_mask=attention_mask, cache=None, position_ids=position_ids)
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
