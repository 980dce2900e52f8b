"""HF ``BertForPreTraining`` / ``BertForMaskedLM`` as a layer list:
embeddings -> encoder.layer.0 .. encoder.layer.{L-1} -> heads (the names of `model_zoo.bert`).

    embeddings(input_ids, attention_mask=None, token_type_ids=None, position_ids=None)
                                                                    -> (hidden (B, T, C), attention_mask (B, T))
    encoder.layer.i(hidden, attention_mask)                         -> (hidden, attention_mask)
    heads(hidden, attention_mask) -> (prediction_logits (B, T, V), seq_relationship_logits (B, 2))  # PreTraining
                                  -> prediction_logits (B, T, V)                                    # MaskedLM

Every layer runs HF's own modules: ``BertEmbeddings``, ``BertLayer``, and for the heads
``BertPooler`` + ``BertPreTrainingHeads`` (or ``BertOnlyMLMHead``). The (B, T) padding mask
travels; each layer rebuilds the 4-D mask as ``BertModel._create_attention_masks`` does
(bidirectional; causal when ``config.is_decoder``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

from mp_toolkit.hf.common import padding_mask, whole_sequence


class BertEmbed(nn.Module):
    """HF BertEmbeddings (word + token type + position, LayerNorm, dropout); starts the mask.

    The arguments follow BertForPreTraining.forward's order: the mask before the token types
    (`model_zoo.bert` and our MLM data put the token types second; `MLMMicroBatches` yields HF's
    order for HF models)."""

    def __init__(self, embeddings: nn.Module):
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None):
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids,
                                 position_ids=position_ids)  # (B, T, C)
        return hidden, padding_mask(input_ids, attention_mask)


class BertBlockLayer(nn.Module):
    """One HF BertLayer (post-LN attention + feed-forward)."""

    def __init__(self, block: nn.Module, config):
        super().__init__()
        self.block = block
        self.config = config

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor):
        if self.config.is_decoder:
            mask = create_causal_mask(config=self.config, inputs_embeds=whole_sequence(hidden, attention_mask),
                                      attention_mask=attention_mask,
                                      cache=None)
        else:
            mask = create_bidirectional_mask(config=self.config, inputs_embeds=whole_sequence(hidden, attention_mask),
                                             attention_mask=attention_mask)
        return self.block(hidden, mask), attention_mask


class BertPreTrainingHeadsLayer(nn.Module):
    """Pooler (tanh of the first token's dense) + MLM and NSP heads; the mask is not needed."""

    def __init__(self, pooler: nn.Module, cls: nn.Module):
        super().__init__()
        self.pooler, self.cls = pooler, cls

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor):
        return self.cls(hidden, self.pooler(hidden))  # (B, T, V), (B, 2)


class BertMLMHeadLayer(nn.Module):
    """The MLM head alone (BertForMaskedLM has no pooler)."""

    def __init__(self, cls: nn.Module):
        super().__init__()
        self.cls = cls

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.cls(hidden)  # (B, T, V)


def bert_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The named layers of a ``BertForPreTraining`` or ``BertForMaskedLM`` (sharing its modules)."""
    bert, config = model.bert, model.config
    if type(model).__name__ == "BertForPreTraining":
        heads = BertPreTrainingHeadsLayer(bert.pooler, model.cls)
    else:
        heads = BertMLMHeadLayer(model.cls)
    return ([("embeddings", BertEmbed(bert.embeddings))]
            + [(f"encoder.layer.{i}", BertBlockLayer(block, config)) for i, block in enumerate(bert.encoder.layer)]
            + [("heads", heads)])
