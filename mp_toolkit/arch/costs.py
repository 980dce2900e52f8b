"""Per-layer arithmetic of each architecture, for one micro-batch of ``b`` sequences of ``s`` tokens
on one of ``tp`` tensor-parallel ranks, ``d`` bytes per activation element (``n = b*s`` tokens).

`mp_toolkit.partition.cost.layer_costs` assembles a model's layer list from its architecture's four
pieces (`LayerArithmetic`); the accounting (what counts as a FLOP, what autograd keeps) is that
module's docstring. Each piece returns parameters, forward FLOPs (layers without matrix products:
none) and the bytes kept from forward to backward, as saved-tensor hooks count them on CPU
(`tests/test_cost.py`, `tests/test_cost_families.py`). A fifth (`LargestParameters`) gives the
elements of each kind of layer's largest parameter: the largest gradient its backward hands to
``.grad`` at once.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mp_toolkit.arch.shape import ModelShape


@dataclass(frozen=True)
class LargestParameters:
    """Elements of the largest parameter of each kind of layer on one tensor-parallel rank."""

    embedding: int
    """The vocabulary table's shard (the position and token-type tables are smaller)."""
    block: int
    """The block's largest matrix (GPT-2: the MLP's h x f, or the fused qkv's 3h x h where larger)."""
    final_norm: int
    head: int
    """The vocabulary projection's shard."""


@dataclass(frozen=True)
class LayerArithmetic:
    """An architecture's four kinds of layer, as the cost model counts them."""

    embedding: Callable[[ModelShape, int, int, int, int], tuple[int, int]]
    """(shape, b, s, d, tp) -> (parameters, kept bytes)."""
    block: Callable[[ModelShape, int, int, int, int], tuple[int, float, int]]
    """(shape, b, s, d, tp) -> (parameters, forward FLOPs, kept bytes) of one transformer block."""
    final_norm: Callable[[ModelShape, int, int], tuple[int, int]] | None
    """(shape, n, d) -> (parameters, kept bytes); None: the architecture has no final norm layer."""
    head: Callable[[ModelShape, int, int, int, int], tuple[int, float, int]]
    """(shape, b, s, d, tp) -> (parameters, forward FLOPs, kept bytes) of the head with its loss."""
    largest: Callable[[ModelShape, int], LargestParameters]
    """(shape, tp) -> each kind of layer's largest parameter."""
    block_split: Callable[[ModelShape, int, int], int] | None = None
    """(shape, n, d) -> the bytes of a block's kept ones (at tp 1) that sequence parallelism splits
    over the tp ranks: its norms' saved tensors and its hidden dropout masks, which run on seq / tp of
    the tokens, and the column-parallel projections' inputs, kept as the local slice and gathered
    again in the backward (`mp_toolkit.parallel.sequence_parallel`, `tp_comms.gathered_projection`)."""
    head_input_split: bool = False
    """Under sequence parallelism the head's projection keeps its input's local slice (an LM head;
    not BERT's heads, whose replicated transform reads the gathered whole)."""
    mask_bytes: int = 0
    """Bytes per token every message carries beside the hidden state (BERT: its int64 padding mask)."""


def dropout_mask_bytes(p: float, d: int) -> int:
    """Bytes per element a training-mode ``nn.Dropout`` keeps for backward: on CPU its mask, in the
    activation's dtype (``d`` bytes; CUDA's fused kernel keeps 1-byte masks: not modelled)."""
    return d if p > 0 else 0


# Embeddings: the int64 ids are saved; the vocabulary table shards over tp, and its shard keeps the
# (B, T) bool mask of the ids other ranks hold (`VocabParallelEmbedding`).

def foreign_mask_bytes(n: int, tp: int) -> int:
    """A vocabulary-parallel table's mask of the ids outside its shard: one byte per token at tp > 1."""
    return n if tp > 1 else 0


def learned_embedding(shape: ModelShape, b: int, s: int, d: int, tp: int) -> tuple[int, int]:
    """GPT-2: token + learned position table; keeps the ids, the positions and the dropout mask."""
    n, h = b * s, shape.hidden
    params = shape.vocab_size * h // tp + shape.positions * h + shape.type_vocab * h
    return params, n * 8 + s * 8 + n * h * dropout_mask_bytes(shape.embd_dropout, d) + foreign_mask_bytes(n, tp)


def bert_embedding(shape: ModelShape, b: int, s: int, d: int, tp: int) -> tuple[int, int]:
    """BERT: `learned_embedding` with token types (HF: a slice of its buffer, with its position-id
    buffer) and a LayerNorm."""
    n, h = b * s, shape.hidden
    params, kept = learned_embedding(shape, b, s, d, tp)
    kept += n * (h * d + 2 * d) + (shape.positions * 8 if shape.hf_modules else n * 8)
    return params + 2 * h, kept


def rotary_embedding(shape: ModelShape, b: int, s: int, d: int, tp: int) -> tuple[int, int]:
    """Llama family: the token table only (positions are rotary, applied in the blocks)."""
    n, h = b * s, shape.hidden
    params = shape.vocab_size * h // tp + shape.type_vocab * h
    return params, n * 8 + n * h * dropout_mask_bytes(shape.embd_dropout, d) + foreign_mask_bytes(n, tp)


# Blocks.

def attention_kept(shape: ModelShape, b: int, s: int, d: int, tp: int) -> int:
    """What scaled_dot_product_attention keeps beyond its q/k/v input's producer, on CPU.

    Without dropout the fused (flash) kernel keeps the fused qkv output (3h), its output (h) and
    the fp32 log-sum-exp per head. With dropout on the probabilities it falls back to the math
    kernel, which computes in fp32 whatever the dtype: fp32 copies of q, k and v (3h x 4 bytes),
    and three fp32 (heads, s, s) tensors per sequence (the softmax, the dropout mask and the
    dropped probabilities); its output reaches the projection in the activation dtype (h x d).
    """
    n, hl, heads = b * s, shape.hidden // tp, shape.heads // tp
    if shape.attn_dropout > 0:
        return n * hl * (3 * 4 + d) + 3 * b * heads * s * s * 4
    return n * hl * 4 * d + n * heads * 4


def _layernorm_block(shape: ModelShape, b: int, s: int, d: int, tp: int, causal: bool) -> tuple[int, float, int]:
    """(parameters, forward FLOPs, kept bytes) of a GPT-2 (pre-LN) or BERT (post-LN) block.

    Weights and column-parallel biases (qkv, fc) shard; row-parallel biases and norms replicate.
    Causal attention counts the lower triangle of Q K^T and P V only. Kept: two LayerNorm inputs and
    their mean / rstd, the qkv input and the MLP input (all four whole on every tp rank: a column
    projection reads the replicated input), the attention (`attention_kept`), the activation's input
    and the second projection's input, each sub-layer's dropout mask (measured at tp 2 with
    saved-tensor hooks, sequence parallel or not: `tests/test_sequence_parallel.py`)."""
    n, h, f = b * s, shape.hidden, shape.ffn
    params = (4 * h * h + 2 * h * f) // tp + (3 * h + f) // tp + 2 * h + 4 * h
    attn = (2.0 if causal else 4.0) * b * s * s * h / tp
    flops = 2.0 * n * (4 * h * h + 2 * h * f) / tp + attn
    fl = f // tp
    kept = n * d * (4 * h + 2 * fl) + 4 * n * d + attention_kept(shape, b, s, d, tp)
    kept += 2 * n * h * dropout_mask_bytes(shape.hidden_dropout, d)
    return params, flops, kept


def gpt2_block(shape: ModelShape, b: int, s: int, d: int, tp: int) -> tuple[int, float, int]:
    """`_layernorm_block`, causal; HF GPT-2's composed ``gelu_new`` keeps three (b, s, f) tensors more."""
    params, flops, kept = _layernorm_block(shape, b, s, d, tp, causal=True)
    if shape.hf_modules:
        kept += 3 * b * s * (shape.ffn // tp) * d
    return params, flops, kept


def bert_block(shape: ModelShape, b: int, s: int, d: int, tp: int) -> tuple[int, float, int]:
    """`_layernorm_block`, bidirectional; model_zoo's fused path also keeps its padding mask."""
    params, flops, kept = _layernorm_block(shape, b, s, d, tp, causal=False)
    if not shape.hf_modules and shape.attn_dropout == 0:
        kept += b * s * d
    return params, flops, kept


def llama_block(shape: ModelShape, b: int, s: int, d: int, tp: int) -> tuple[int, float, int]:
    """(parameters, forward FLOPs, kept bytes) of an HF Llama / Mistral / Qwen2 decoder layer.

    Each of the two RMSNorms upcasts its input to fp32 and keeps that copy (h x 4; in fp32 the input
    itself), its fp32 rstd, the normalised value it multiplies by the weight and the output the
    projections read (2 x h x d). Rotary positions keep cos and sin (s x head_dim each, shared by the
    micro-batch). Attention (the fused kernel, grouped-query heads as they are) keeps the rotated q,
    k, v, its output and the fp32 log-sum-exp. The gated MLP keeps gate, up and SiLU outputs and the
    down projection's input (4 x f).
    """
    n, h, f = b * s, shape.hidden, shape.ffn
    qd, kvd = shape.heads * shape.hd, shape.kvh * shape.hd
    params = (2 * h * qd + 2 * h * kvd + 3 * h * f) // tp + 2 * h
    if shape.qkv_bias:
        params += (qd + 2 * kvd) // tp
    flops = 2.0 * n * (2 * h * qd + 2 * h * kvd + 3 * h * f) / tp + 2.0 * b * s * s * qd / tp
    qdl, kvdl, fl = qd // tp, kvd // tp, f // tp
    norms = 2 * n * (4 * h + 4 + 2 * h * d)
    attention = n * d * (2 * qdl + 2 * kvdl) + n * (shape.heads // tp) * 4 + 2 * s * shape.hd * d
    return params, flops, norms + attention + 4 * n * fl * d


def layernorm_block_split(shape: ModelShape, n: int, d: int) -> int:
    """GPT-2 and BERT blocks under sequence parallelism: the two LayerNorms' inputs, means and
    rstds, the attention's and the MLP's projection inputs, and the two sub-layer output dropout
    masks (measured with saved-tensor hooks at tp 2: `tests/test_sequence_parallel.py`)."""
    return n * (4 * shape.hidden * d + 4 * d + 2 * shape.hidden * dropout_mask_bytes(shape.hidden_dropout, d))


def rms_block_split(shape: ModelShape, n: int, d: int) -> int:
    """Llama-family blocks under sequence parallelism: each RMSNorm's fp32 input copy, rstd,
    normalised value and output (the projections' input, kept as its local slice)."""
    return 2 * n * (4 * shape.hidden + 4 + 2 * shape.hidden * d)


# Final norms.

def layer_norm(shape: ModelShape, n: int, d: int) -> tuple[int, int]:
    """LayerNorm: weight and bias; keeps its input, mean and rstd."""
    return 2 * shape.hidden, n * shape.hidden * d + 2 * n * d


def rms_norm(shape: ModelShape, n: int, d: int) -> tuple[int, int]:
    """HF RMSNorm: weight; keeps its fp32 input copy, rstd and normalised value."""
    h = shape.hidden
    return h, n * (4 * h + 4 + h * d)


# Heads, with the loss: the vocabulary projection shards over tp.

def lm_head(shape: ModelShape, b: int, s: int, d: int, tp: int) -> tuple[int, float, int]:
    """The LM head and its cross-entropy: keeps its input, the fp32 log-softmax and the labels."""
    n, h, v = b * s, shape.hidden, shape.vocab_size
    return v * h // tp, 2.0 * n * h * v / tp, n * h * d + n * (v // tp) * 4 + n * 8


def bert_heads(shape: ModelShape, b: int, s: int, d: int, tp: int) -> tuple[int, float, int]:
    """`lm_head` (the MLM decoder) with the pooler + NSP, the MLM transform (h x h, LayerNorm) and
    the decoder's bias."""
    n, h, v = b * s, shape.hidden, shape.vocab_size
    params, flops, kept = lm_head(shape, b, s, d, tp)
    params += 2 * h * h + 2 * h + 2 * h + 2 + 2 * h + v // tp
    flops += 2.0 * n * h * h + 2.0 * b * (h * h + 2 * h)
    return params, flops, kept + 3 * n * h * d


# Largest parameters: the vocabulary table and projection shard over tp, and so do the block's matrices.

def _largest(shape: ModelShape, tp: int, block_matrix: int) -> LargestParameters:
    """The vocabulary tables and a block's largest ``block_matrix`` elements (before sharding) on one rank."""
    table = shape.vocab_size // tp * shape.hidden
    return LargestParameters(table, block_matrix // tp, shape.hidden, table)


def gpt2_largest(shape: ModelShape, tp: int) -> LargestParameters:
    """GPT-2: the fused qkv (3h x h) or an MLP matrix (f x h)."""
    return _largest(shape, tp, max(3 * shape.hidden, shape.ffn) * shape.hidden)


def bert_largest(shape: ModelShape, tp: int) -> LargestParameters:
    """BERT: q, k, v and the output projection are h x h each; the MLP's f x h. Its heads' largest is
    the MLM decoder (the transform is h x h)."""
    return _largest(shape, tp, max(shape.hidden, shape.ffn) * shape.hidden)


def llama_largest(shape: ModelShape, tp: int) -> LargestParameters:
    """Llama family: q (and o) are heads x head_dim by h, gate, up and down f x h."""
    return _largest(shape, tp, max(shape.heads * shape.hd, shape.ffn) * shape.hidden)


GPT2_LAYERS = LayerArithmetic(learned_embedding, gpt2_block, layer_norm, lm_head, gpt2_largest,
                              block_split=layernorm_block_split, head_input_split=True)
BERT_LAYERS = LayerArithmetic(bert_embedding, bert_block, None, bert_heads, bert_largest,
                              block_split=layernorm_block_split, mask_bytes=8)
LLAMA_LAYERS = LayerArithmetic(rotary_embedding, llama_block, rms_norm, lm_head, llama_largest,
                               block_split=rms_block_split, head_input_split=True)
