"""A single-device BERT with the pre-training heads (masked LM + next-sentence prediction).

The model is a plain ``nn.Module`` exposing an ordered layer list; pipeline and tensor
parallelism are applied afterwards by functions in ``mp_toolkit`` (DESIGN.md, invariant 2):

    embeddings -> encoder.layer.0 -> ... -> encoder.layer.{L-1} -> heads

    embeddings(input_ids, token_type_ids, attention_mask) -> (hidden, attention_mask)
    encoder.layer.i(hidden, attention_mask)               -> (hidden, attention_mask)
    heads(hidden, attention_mask)                         -> (mlm_logits, nsp_logits)

The padding mask (B, T) rides along with the hidden state as an integer tensor (1 = attend,
0 = padding, HF semantics), so a pipeline stage boundary can fall between any two layers and the
mask crosses it without a gradient. Every layer turns it into an additive mask on the scores.

Parameter names are HuggingFace ``BertForPreTraining``'s with ``bert.`` / ``cls.`` replaced by
the layer they live in (``bert.pooler`` and ``cls.*`` live in ``heads``); ``model_zoo.bert_hf``
converts state dicts both ways; config and presets live in ``model_zoo.bert_config`` (both
re-exported here). This module imports nothing distributed and nothing from ``mp_toolkit``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from model_zoo.bert_config import ACTIVATIONS, PRESETS, BertConfig, get_config
from model_zoo.bert_hf import hf_state_dict_map, load_hf_state_dict, to_hf_state_dict
from model_zoo.init import InitRule, draw_seed, initial_value, reset_from_rules, transformer_rules
from model_zoo.recompute import attention_core

__all__ = [
    "PRESETS", "SP_PLAN", "TP_PLAN", "BertConfig", "BertForPreTraining", "get_config", "hf_state_dict_map",
    "load_hf_state_dict", "pretraining_loss", "to_hf_state_dict",
]


# Tensor-parallel plan, as data (STYLE.md 2), applied by mp_toolkit's apply_tensor_parallel:
# {module path suffix: style}, matched against "{layer name}.{module path}" (the format of
# model_zoo.gpt.TP_PLAN). Megatron-LM styles (Shoeybi et al. 2019):
#   "column": split the Linear's output features; q/k/v are separate Linears (HF's layout), each
#             split by heads, and head_dim stays fixed, so attention runs on the local heads;
#   "row":    split the input features; one all-reduce closes the sub-layer before its LayerNorm.
#             "output.dense" names both attention.output.dense and the feed-forward output.dense;
#   "vocab":  split the vocabulary rows, padded to a multiple of 128 x tp (padding_idx handled by
#             the shard): the word embedding, and the MLM decoder (tied to it, with a bias split
#             alike), so each rank holds one tied shard; the decoder's logits stay vocab-sharded
#             (B, T, Vp / tp), padded ids at -inf, for vocab_parallel_cross_entropy.
# Position/token-type embeddings, LayerNorms, the pooler, the MLM transform and the NSP classifier
# are replicated (C x C or smaller; the pooler sees one token).
TP_PLAN: dict[str, str] = {
    "word_embeddings": "vocab",
    "attention.self.query": "column",
    "attention.self.key": "column",
    "attention.self.value": "column",
    "output.dense": "row",
    "intermediate.dense": "column",
    "predictions.decoder": "vocab",
}


# Sequence-parallel plan (model_zoo.gpt.SP_PLAN's format; HF's BERT has the same module names): the
# embeddings keep their slice of the sequence; self-attention and the feed-forward expansion gather
# the whole sequence before their column-parallel projections; both post-LN sub-layer outputs
# (dense -> dropout -> LayerNorm) run on the slices; the heads gather the whole sequence for their
# replicated transform and pooler ("gather_whole": the MLM decoder keeps its own f).
SP_PLAN: dict[str, str] = {
    "embeddings": "scatter",
    "attention.self": "gather",
    "intermediate": "gather",
    "output.dropout": "dropout",
    "heads": "gather_whole",
}


def additive_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, T) 1 = attend / 0 = pad -> (B, 1, 1, T) added to the scores: 0 or dtype's minimum (HF)."""
    keep = attention_mask[:, None, None, :].bool()  # broadcast over heads and query positions
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


class BertEmbeddings(nn.Module):
    """Word + token-type + position embedding, LayerNorm, dropout; passes the padding mask on."""

    def __init__(self, config: BertConfig):
        super().__init__()
        C = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, C, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, C)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, C)
        self.LayerNorm = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.max_positions = config.max_position_embeddings

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        T = input_ids.shape[1]
        if T > self.max_positions:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings={self.max_positions}")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        # HF's order of the sums: (word + type) + position
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)  # (B, T, C)
        x = x + self.position_embeddings(pos)  # (B, T, C) + (T, C)
        return self.dropout(self.LayerNorm(x)), attention_mask


class BertSelfAttention(nn.Module):
    """Bidirectional multi-head attention with separate query / key / value projections."""

    def __init__(self, config: BertConfig):
        super().__init__()
        C = config.hidden_size
        self.query = nn.Linear(C, C)
        self.key = nn.Linear(C, C)
        self.value = nn.Linear(C, C)
        self.dropout_p = config.attention_probs_dropout_prob
        # head_dim, not the head count, is fixed: a tensor-parallel split leaves fewer local heads.
        self.head_dim = C // config.num_attention_heads

    def forward(self, x: torch.Tensor, mask: torch.Tensor, recompute_core: bool = False) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, C') -> (B, nh, T, hs); C' = nh * hs is C, or C / tp after a tensor-parallel split
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        y = attention_core(q, k, v, recompute_core, attn_mask=mask,
                           dropout_p=self.dropout_p if self.training else 0.0
                           )  # (B, nh, T, hs); scores scaled by 1/sqrt(hs) as in BERT
        return y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C')


class BertDenseNorm(nn.Module):
    """dense -> dropout -> LayerNorm(. + residual): HF's BertSelfOutput and BertOutput (post-LN)."""

    def __init__(self, config: BertConfig, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    """Self-attention and its output projection: (B, T, C) -> (B, T, C)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertDenseNorm(config, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, recompute_core: bool = False) -> torch.Tensor:
        return self.output(self.self(x, mask, recompute_core), x)


class BertIntermediate(nn.Module):
    """The feed-forward expansion: (B, T, C) -> (B, T, intermediate_size)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    """One post-LayerNorm encoder layer; (hidden, attention_mask) in and out.

    ``recompute`` as `model_zoo.gpt.GPTBlock`'s: "selective" runs the attention core again in the
    backward."""

    recompute: str = "none"

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseNorm(config, config.intermediate_size)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.attention(x, additive_mask(attention_mask, x.dtype), self.recompute == "selective")
        return self.output(self.intermediate(x), x), attention_mask


class BertEncoder(nn.Module):
    """Holds ``layer``, so parameter names read ``encoder.layer.i...`` as in HF."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertPooler(nn.Module):
    """tanh(dense(hidden of the first, [CLS], token)): (B, T, C) -> (B, C)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x[:, 0]))


class BertPredictionHeadTransform(nn.Module):
    """dense -> activation -> LayerNorm before the MLM decoder: (B, T, C) -> (B, T, C)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    """Transform, then a decoder with the word embedding's weight and its own bias: -> (B, T, V)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)  # HF's cls.predictions.bias is decoder.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(x))


class BertPreTrainingHeads(nn.Module):
    """Pooler + NSP classifier and the MLM head: (hidden, mask) -> (mlm_logits, nsp_logits)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.pooler = BertPooler(config)
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
        # The mask is accepted (the previous layer passes it) but not needed: every position is scored.
        return self.predictions(x), self.seq_relationship(self.pooler(x))  # (B, T, V), (B, 2)


class BertForPreTraining(nn.Module):
    """BERT with MLM and NSP heads as an ordered list of layers (see the module docstring).

    Built inside ``with torch.device("meta")`` it holds shapes only: `initial_value` draws any one
    parameter's starting value on demand (model_zoo/init.py)."""

    def __init__(self, config: BertConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        self.init_seed = draw_seed() if seed is None else seed
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.heads = BertPreTrainingHeads(config)
        if config.tie_word_embeddings:
            # One Parameter object in two places; pipeline stages holding one end each keep a copy
            # and sum gradients through tie_groups().
            self.heads.predictions.decoder.weight = self.embeddings.word_embeddings.weight
        self.init_rules = self._init_rules()
        self.reset_parameters()

    def _init_rules(self) -> dict[str, InitRule]:
        """HF's BERT init as data: N(0, initializer_range) for Linear and Embedding weights (the
        padding row zero), zero biases, unit LayerNorms; a tied decoder is the word embedding."""
        std = self.config.initializer_range
        rules = transformer_rules(self.named_layers(), lambda path, module, name, shape: InitRule(
            shape, "normal", name, std, zero_row=module.padding_idx if isinstance(module, nn.Embedding) else None))
        if self.config.tie_word_embeddings:
            rules["heads.predictions.decoder.weight"] = rules["embeddings.word_embeddings.weight"]
        return rules

    def initial_value(self, name: str) -> torch.Tensor:
        """The starting value of parameter ``name`` ("{layer}.{path}"), full size, float32 on CPU."""
        return initial_value(self.init_rules[name], self.init_seed)

    def reset_parameters(self) -> None:
        """Every parameter from its own generator, seeded by (init_seed, its name); nothing is drawn
        on the meta device."""
        reset_from_rules(self, self.init_rules, self.init_seed)

    def named_layers(self) -> list[tuple[str, nn.Module]]:
        """Layers in execution order: embeddings, encoder.layer.0 ... encoder.layer.{L-1}, heads."""
        return ([("embeddings", self.embeddings)]
                + [(f"encoder.layer.{i}", layer) for i, layer in enumerate(self.encoder.layer)]
                + [("heads", self.heads)])

    def tie_groups(self) -> list[list[tuple[str, str]]]:
        """Groups of (layer name, parameter name) that are one Parameter; empty when untied."""
        if self.config.tie_word_embeddings:
            return [[("embeddings", "word_embeddings.weight"), ("heads", "predictions.decoder.weight")]]
        return []

    def num_parameters(self) -> int:
        """Number of parameters, counting tied ones once."""
        return sum(p.numel() for p in self.parameters())  # parameters() de-duplicates shared ones

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embeddings(input_ids, token_type_ids, attention_mask)
        for layer in self.encoder.layer:
            x = layer(*x)
        return self.heads(*x)  # (B, T, V) MLM logits, (B, 2) NSP logits


def pretraining_loss(outputs: tuple[torch.Tensor, torch.Tensor],
                     labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """HF BertForPreTraining's total loss: mean MLM cross-entropy (-100 ignored) + mean NSP CE.

    ``outputs`` is (mlm_logits (B, T, V), nsp_logits (B, 2)); ``labels`` is (mlm_labels (B, T),
    nsp_labels (B,)) with NSP label 0 = B follows A, 1 = B is random.
    """
    if not isinstance(outputs, (tuple, list)) or len(outputs) != 2:
        # A lone tensor would unpack along its batch dimension and give a wrong loss silently.
        raise TypeError(f"pretraining_loss needs (mlm_logits, nsp_logits), got {type(outputs).__name__}"
                        f"{'' if not isinstance(outputs, torch.Tensor) else ' of shape ' + str(tuple(outputs.shape))}")
    mlm_logits, nsp_logits = outputs
    mlm_labels, nsp_labels = labels
    mlm = F.cross_entropy(mlm_logits.reshape(-1, mlm_logits.shape[-1]), mlm_labels.reshape(-1), ignore_index=-100)
    return mlm + F.cross_entropy(nsp_logits, nsp_labels.reshape(-1))
