"""HF ``GPT2LMHeadModel`` as a layer list: embed -> h.0 .. h.{L-1} -> ln_f -> lm_head.

    embed(input_ids, attention_mask=None, token_type_ids=None, position_ids=None)
                                            -> (hidden (B, T, C), attention_mask (B, T))
    h.i(hidden, attention_mask)             -> (hidden, attention_mask)
    ln_f(hidden, attention_mask)            -> hidden
    lm_head(hidden)                         -> logits (B, T, V)

``h.i`` runs HF's own ``GPT2Block``, ``ln_f`` its ``nn.LayerNorm`` and ``lm_head`` *is* HF's
``nn.Linear`` (tied to ``wte`` unless ``tie_word_embeddings=False``). GPT2Model has no embedding
module, so ``embed`` holds its ``wte`` / ``wpe`` / ``drop`` and repeats its three lines.
The c_attn / c_proj / c_fc projections stay HF ``Conv1D`` (weight (in, out)), so the math and the
parameter layout are HF's; `mp_toolkit.hf.tp_plans` shards them in that layout.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from mp_toolkit.hf.common import FinalNorm, padding_mask, whole_sequence


class GPT2Embed(nn.Module):
    """Token + learned position (+ token type) embedding and dropout, as GPT2Model.forward computes
    them. The arguments follow GPT2LMHeadModel.forward's order without its ``cache``."""

    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None):
        inputs_embeds = self.wte(input_ids)  # (B, T) -> (B, T, C)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)  # (1, T)
        hidden = inputs_embeds + self.wpe(position_ids)  # (B, T, C) + (1 or B, T, C)
        if token_type_ids is not None:  # GPT-2 embeds token types with the token embedding
            hidden = hidden + self.wte(token_type_ids)
        return self.drop(hidden), padding_mask(input_ids, attention_mask)


class GPT2BlockLayer(nn.Module):
    """One HF GPT2Block; its causal (+ padding) mask is rebuilt here from the (B, T) mask."""

    def __init__(self, block: nn.Module, config):
        super().__init__()
        self.block = block
        self.config = config  # HF config (not a module): attn_implementation picks the mask's form

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor):
        # As GPT2Model.forward: no cache; position ids only matter to HF when no mask is given.
        mask = create_causal_mask(config=self.config, inputs_embeds=whole_sequence(hidden, attention_mask),
                                  attention_mask=attention_mask,
                                  cache=None)
        return self.block(hidden, attention_mask=mask), attention_mask


def gpt2_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The named layers of a ``GPT2LMHeadModel`` (sharing its modules)."""
    config = model.config
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT2LMHeadModel with add_cross_attention=True is not supported: the layer list "
                         "has no encoder_hidden_states to carry; use a config with add_cross_attention=False")
    t = model.transformer
    return ([("embed", GPT2Embed(t))]
            + [(f"h.{i}", GPT2BlockLayer(block, config)) for i, block in enumerate(t.h)]
            + [("ln_f", FinalNorm(t.ln_f)), ("lm_head", model.lm_head)])
