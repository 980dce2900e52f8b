"""The vocabulary split over the tensor-parallel ranks: embedding, LM head and their cross-entropy.

Padding (Megatron's ``--make-vocab-size-divisible-by``, default 128): when tp > 1 splits the
vocabulary, V rows are padded to ``Vp``, the next multiple of ``128 x tp``
(`padded_vocab_size`), so any V splits (GPT-2's 50257 -> 50432 at tp 2) and every rank's shard is
a multiple of 128 rows. Rank r holds ids [r Vp/tp, (r+1) Vp/tp); rows V..Vp-1 exist only in the
shards and are inert:

* they start zero (the full weights are padded with zeros, then split);
* the embedding never looks them up (no real id reaches them), so their gradient is zero;
* the LM head returns their logits as -inf, so softmax gives them probability 0 and
  `vocab_parallel_cross_entropy` (or anything else reading the local logits) gives them gradient
  0, and the head's weight and bias rows get gradient 0;
* zero gradient keeps them zero under AdamW / LAMB / LARS (weight decay of 0 is 0; Adam moments
  stay 0) and their zero rows add nothing to the norms of clipping and trust ratios.

`gather_full` strips them (the shards carry ``unpadded_size``, `mp_toolkit.parallel.layouts`), so
checkpoints and ``mpt export`` hold the model's own (V, C) tensors and load at any tp, tp = 1 and
in transformers; `gather_vocab_parallel_logits` strips padded logits the same way. tp = 1 pads
nothing: the layers are then the plain computation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.layouts import shard_parameter
from mp_toolkit.parallel.tp_comms import (
    all_reduce,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    gathered_projection,
    group_rank,
    reduce_from_tensor_model_parallel_region,
)

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
"""Megatron's default: each rank's vocabulary shard is a multiple of this many rows."""


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by x tp``; itself when tp == 1."""
    if tp == 1:
        return vocab_size
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocabulary rows split: rank r holds ids [r Vp/tp, (r+1) Vp/tp).

    Ids owned by another rank look up zeros here; ``g`` sums the ranks so every rank gets the full
    (B, T, C) embedding. Initialised like ``nn.Embedding`` (N(0, 1)) when no ``full_weight`` is
    given; padded rows (module docstring) are zero.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ParallelContext, *,
                 padding_idx: int | None = None, full_weight: torch.Tensor | None = None,
                 divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY):
        super().__init__()
        if full_weight is None:
            full_weight = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx).weight
        self.num_embeddings, self.embedding_dim, self.tp_group = num_embeddings, embedding_dim, ctx.tp_group
        self.padded_size = padded_vocab_size(num_embeddings, ctx.tp, divisible_by)
        per = self.padded_size // ctx.tp
        self.vocab_start, self.vocab_end = ctx.tp_rank * per, (ctx.tp_rank + 1) * per
        # padding_idx only zeroes that row's gradient; it matters on the rank that owns the row.
        owns_pad = padding_idx is not None and self.vocab_start <= padding_idx % num_embeddings < self.vocab_end
        self.local_padding_idx = padding_idx % num_embeddings - self.vocab_start if owns_pad else None
        self.weight = shard_parameter(full_weight, 0, 1, ctx, self.padded_size)  # (Vp / tp, C)

    @classmethod
    def from_full(cls, emb: nn.Embedding, ctx: ParallelContext, *,
                  divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY) -> "VocabParallelEmbedding":
        """This rank's rows of an existing ``nn.Embedding`` (max_norm / sparse are not supported)."""
        if emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
            raise ValueError("VocabParallelEmbedding supports no max_norm, sparse or scale_grad_by_freq")
        return cls(emb.num_embeddings, emb.embedding_dim, ctx, padding_idx=emb.padding_idx, full_weight=emb.weight,
                   divisible_by=divisible_by)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return F.embedding(ids, self.weight, self.local_padding_idx)
        foreign = (ids < self.vocab_start) | (ids >= self.vocab_end)  # (B, T) ids of other ranks
        local_ids = torch.where(foreign, 0, ids - self.vocab_start)
        out = F.embedding(local_ids, self.weight, self.local_padding_idx)  # (B, T, C)
        out = out.masked_fill(foreign.unsqueeze(-1), 0.0)  # also stops their gradient reaching row 0
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (padded {self.padded_size}, local {self.weight.shape[0]}), {self.embedding_dim}"


class VocabParallelLMHead(nn.Module):
    """Output projection with the (padded) vocab rows split: (B, T, C) -> local logits (B, T, Vp / tp).

    Logits of padded ids are -inf (module docstring). Feed the local logits to
    `vocab_parallel_cross_entropy`; the full (B, T, V) never exists. ``bias`` (B = BERT's MLM
    decoder) is split like the rows. Under sequence parallelism (``sequence_parallel``) its input
    is already whole, gathered by the region around it, which also sums its gradient: no ``f``.
    """

    tp_region = "open"
    sequence_parallel = False

    def __init__(self, vocab_size: int, hidden: int, ctx: ParallelContext, *,
                 full_weight: torch.Tensor | None = None, full_bias: torch.Tensor | None = None,
                 init_std: float = 0.02, divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY):
        super().__init__()
        if full_weight is None:
            full_weight = nn.init.normal_(torch.empty(vocab_size, hidden), std=init_std)
        self.vocab_size, self.hidden, self.tp_group = vocab_size, hidden, ctx.tp_group
        self.padded_size = padded_vocab_size(vocab_size, ctx.tp, divisible_by)
        per = self.padded_size // ctx.tp
        self.real_local = max(0, min(per, vocab_size - ctx.tp_rank * per))  # this rank's real (unpadded) rows
        self.weight = shard_parameter(full_weight, 0, 1, ctx, self.padded_size)  # (Vp / tp, C)
        self.bias = None if full_bias is None else shard_parameter(full_bias, 0, 1, ctx, self.padded_size)

    @classmethod
    def from_full(cls, head: nn.Module, ctx: ParallelContext, *,
                  divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY) -> "VocabParallelLMHead":
        """Shard an ``nn.Linear`` (with or without bias) or a module whose only parameter is a (V, C)
        ``weight`` and whose forward is ``F.linear(x, weight)`` (model_zoo's GPTLMHead)."""
        params = dict(head.named_parameters())
        if isinstance(head, nn.Linear):
            return cls(head.out_features, head.in_features, ctx, full_weight=head.weight, full_bias=head.bias,
                       divisible_by=divisible_by)
        if list(params) != ["weight"] or params["weight"].dim() != 2:
            shapes = [(k, tuple(v.shape)) for k, v in params.items()]
            raise ValueError(f"{type(head).__name__} is not an LM head: it needs one (V, C) weight, got {shapes}")
        vocab_size, hidden = params["weight"].shape
        return cls(vocab_size, hidden, ctx, full_weight=params["weight"], divisible_by=divisible_by)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)  # f
        logits = gathered_projection(x, self.weight, self.bias)
        if self.real_local == logits.shape[-1]:
            return logits
        padded = torch.arange(logits.shape[-1], device=logits.device) >= self.real_local  # (Vp / tp,)
        return logits.masked_fill(padded, float("-inf"))  # no probability, no gradient to padded rows

    def extra_repr(self) -> str:
        return (f"{self.hidden} -> {self.vocab_size} (padded {self.padded_size}, local {self.weight.shape[0]}), "
                f"bias={self.bias is not None}")


def gather_vocab_parallel_logits(local_logits: torch.Tensor, group, vocab_size: int) -> torch.Tensor:
    """(.., Vp / tp) local logits on each rank -> the full (.., V) on every rank, padding stripped."""
    return gather_from_tensor_model_parallel_region(local_logits, group)[..., :vocab_size]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token -log softmax(logits)[label] with the vocab split over ``group``.

    Stable: logits are shifted by the global max (all-reduce MAX); the target logit (non-zero only
    on the owning rank) and the sum of exponentials travel in one all-reduce SUM. -inf logits (the
    head's padded ids) get probability 0 and gradient 0, even on a rank that holds only padding.
    """

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start):
        # logits (N, V / tp) fp32, labels (N,) int64
        shifted = logits - all_reduce(logits.max(dim=-1).values, group, op="max").unsqueeze(-1)
        mine = (labels >= vocab_start) & (labels < vocab_start + logits.shape[-1])  # (N,)
        local = torch.where(mine, labels - vocab_start, 0)
        # where, not a product: off the owner the gathered logit may be a padded -inf (and -inf * 0 is nan)
        target = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)  # (N,)
        exp = shifted.exp()
        target, sum_exp = all_reduce(torch.stack([target, exp.sum(dim=-1)]), group)  # 2 x (N,)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mine)
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad):
        # d loss_i / d logit_ij = softmax_ij - [j == label_i]; the owner subtracts the 1
        softmax, local, mine = ctx.saved_tensors
        onehot = mine.to(softmax.dtype).unsqueeze(-1)
        g = softmax.scatter_add(-1, local.unsqueeze(-1), -onehot)  # out of place: retain_graph-safe
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, group,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of (.., Vp / tp) local logits, equal to F.cross_entropy over the full
    (.., V) logits with ``ignore_index``; rank r's shard holds vocab ids [r Vp/tp, (r+1) Vp/tp) and
    the padded ids' logits are -inf (`VocabParallelLMHead`), so they take no part.
    Computed and returned in fp32. ``group=None`` is plain single-device cross-entropy.
    """
    v_local = local_logits.shape[-1]
    flat, labels = local_logits.reshape(-1, v_local).float(), labels.reshape(-1)
    if flat.shape[0] != labels.shape[0]:
        raise ValueError(f"logits {tuple(local_logits.shape)} and labels {tuple(labels.shape)} disagree")
    per_token = _VocabParallelCrossEntropy.apply(flat, labels, group, group_rank(group) * v_local)
    valid = labels != ignore_index
    return (per_token * valid).sum() / valid.sum()  # all ignored -> nan, as F.cross_entropy


__all__ = [
    "MAKE_VOCAB_SIZE_DIVISIBLE_BY", "padded_vocab_size", "VocabParallelEmbedding", "VocabParallelLMHead",
    "gather_vocab_parallel_logits", "vocab_parallel_cross_entropy",
]
