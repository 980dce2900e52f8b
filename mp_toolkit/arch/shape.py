"""`ModelShape`: what the cost model knows of a Transformer (`mp_toolkit.partition.cost`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about a Transformer."""

    family: str
    """Its architecture's name (`mp_toolkit.arch.architectures.ARCHITECTURES`): "gpt2" (pre-LN,
    learned positions), "bert" (post-LN encoder, pretraining heads) or "llama" (RMSNorm, rotary
    positions, gated MLP; also Mistral and Qwen2)."""
    vocab_size: int
    hidden: int
    num_layers: int
    heads: int
    ffn: int
    """MLP inner size."""
    positions: int = 0
    """Learned position embeddings (gpt2, bert); rotary models have none."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means ``heads``."""
    head_dim: int = 0
    """0 means ``hidden // heads``."""
    tied: bool = True
    """Input embedding and LM head share one weight (each stage that holds one stores it)."""
    type_vocab: int = 0
    """BERT token-type embeddings."""
    qkv_bias: bool = False
    """Biases on q/k/v (Qwen2); gpt2 and bert always have biases."""
    attn_dropout: float = 0.0
    """Dropout on the attention probabilities (GPT-2 ``attn_pdrop``, BERT ``attention_probs_dropout_prob``)."""
    hidden_dropout: float = 0.0
    """Dropout on each sub-layer's output (GPT-2 ``resid_pdrop``, BERT ``hidden_dropout_prob``)."""
    embd_dropout: float = 0.0
    """Dropout on the embedding's output (GPT-2 ``embd_pdrop``; BERT's is ``hidden_dropout_prob``)."""
    hf_modules: bool = False
    """Built from transformers' own modules (``mpt train --hf``), not model_zoo's: HF GPT-2's
    ``gelu_new`` is composed of elementwise ops that keep four (b, s, f) tensors, and an absent
    dropout key means HF's default 0.1 (model_zoo's GPT: 0)."""

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kvh(self) -> int:
        return self.kv_heads or self.heads
