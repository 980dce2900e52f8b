"""BERT hyper-parameters (HF ``BertConfig`` spellings), validation and presets.

Kept apart from ``model_zoo.bert`` (the modules) so each file holds one concern; import either
from ``model_zoo.bert``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch.nn.functional as F

from model_zoo.config_io import check_type, read_config_json

# hidden_act -> the function (HF's ACT2FN spellings). HF's "gelu" is the exact erf form;
# "gelu_new" is the tanh approximation, which F.gelu(approximate="tanh") computes to ~1e-7.
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class BertConfig:
    """BERT hyper-parameters, spelled like HuggingFace's ``BertConfig``."""

    vocab_size: int = 30522
    """Number of token ids (rows of the word embedding and of the MLM decoder)."""
    hidden_size: int = 768
    """Hidden size C."""
    num_hidden_layers: int = 12
    """Number of encoder layers."""
    num_attention_heads: int = 12
    """Attention heads per layer; must divide hidden_size."""
    intermediate_size: int = 3072
    """Feed-forward hidden size."""
    hidden_act: str = "gelu"
    """Feed-forward and MLM-transform activation: "gelu" (exact, BERT's), "gelu_new", "relu"..."""
    hidden_dropout_prob: float = 0.1
    """Dropout on embeddings and on each sub-layer's output before its residual add."""
    attention_probs_dropout_prob: float = 0.1
    """Dropout on attention probabilities (training only)."""
    max_position_embeddings: int = 512
    """Longest sequence the learned position embedding covers."""
    type_vocab_size: int = 2
    """Number of segment (token type) ids; 2 for sentence A / sentence B."""
    layer_norm_eps: float = 1e-12
    """LayerNorm epsilon (BERT's 1e-12, not GPT-2's 1e-5)."""
    initializer_range: float = 0.02
    """Std of the normal init of Linear and Embedding weights."""
    pad_token_id: Optional[int] = 0
    """Padding id: its word-embedding row is zero at init and gets no gradient from the lookup."""
    tie_word_embeddings: bool = True
    """Share one Parameter between the word embedding and the MLM decoder."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_type("BertConfig", f.name, getattr(self, f.name), f.type)
            if f.type == "float":  # JSON may spell 0.0 as 0
                object.__setattr__(self, f.name, float(getattr(self, f.name)))
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"BertConfig.{name}={getattr(self, name)} must be a positive integer")
        if self.hidden_size % self.num_attention_heads != 0:
            divisors = [h for h in range(1, min(self.hidden_size, 64) + 1) if self.hidden_size % h == 0]
            raise ValueError(
                f"BertConfig.hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}: choose num_attention_heads in {divisors}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"BertConfig.hidden_act={self.hidden_act!r} is not supported: "
                             f"choose one of {', '.join(ACTIVATIONS)}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"BertConfig.{name}={getattr(self, name)} must be in [0, 1)")
        for name in ("layer_norm_eps", "initializer_range"):
            if getattr(self, name) <= 0:
                raise ValueError(f"BertConfig.{name}={getattr(self, name)} must be > 0")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"BertConfig.pad_token_id={self.pad_token_id} must be in [0, vocab_size="
                             f"{self.vocab_size}) or null")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BertConfig":
        """Build from a dict such as HF's config.json; unknown keys ("architectures", ...) are ignored.

        Keys that would change the architecture into something this model does not compute
        (relative position embeddings, a decoder) are refused rather than ignored.
        """
        if not isinstance(d, dict):
            raise ValueError(f"BERT config must be a JSON object, got {type(d).__name__}")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"BERT config position_embedding_type={d['position_embedding_type']!r} "
                             f"is not supported: only 'absolute'")
        if d.get("is_decoder") or d.get("add_cross_attention"):
            raise ValueError("BERT config with is_decoder / add_cross_attention is not supported: "
                             "this is the bidirectional encoder")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, path: str | Path) -> "BertConfig":
        """Read a BERT ``config.json`` (or a directory holding one)."""
        return cls.from_dict(read_config_json(path, "BERT"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS: dict[str, BertConfig] = {
    # Used by the tests. Dropout is off so pipeline-vs-single-process comparisons are exact:
    # stages draw dropout masks in schedule order, not in the single process's order.
    "bert-tiny": BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=64,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    # Devlin et al. 2019: BERT-Base 110M and BERT-Large 336M (with the pre-training heads).
    "bert-base": BertConfig(),
    "bert-large": BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                             intermediate_size=4096),
}


def get_config(name_or_path: str | Path) -> BertConfig:
    """A preset by name, or a BERT ``config.json`` (file or model directory) by path."""
    if isinstance(name_or_path, str) and name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return BertConfig.from_json(path)
    raise ValueError(f"unknown model {str(name_or_path)!r}: choose one of {', '.join(PRESETS)} "
                     f"or a path to a BERT config.json")
