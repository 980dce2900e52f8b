"""Activation recomputation inside a model_zoo block, switched by data on the block.

A block (`model_zoo.gpt.GPTBlock`, `model_zoo.bert.BertLayer`) carries ``recompute``, one of
`RECOMPUTE_MODES`, set by whoever composes the model (default "none"). The block acts on
"selective" itself, through `attention_core`; "full" -- the whole block run again during its
backward -- is applied by whoever runs the layer list (``mp_toolkit.layers.run_layers``), so it
works for any layer, not only ours. Imports torch only (DESIGN.md invariant 2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

RECOMPUTE_MODES = ("none", "full", "selective")


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recompute: bool, **sdpa) -> torch.Tensor:
    """softmax(q k^T / sqrt(hs) + mask) v with dropout on the probabilities: (B, nh, T, hs) x 3 -> (B, nh, T, hs).

    ``recompute``: keep only q, k, v for the backward and run the core again there (selective
    recomputation, Korthikanti et al. 2022, section 4.1: the score matmuls, softmax and dropout
    hold the a*s*s tensors of a block, yet cost few FLOPs). torch's non-reentrant checkpoint
    restores the random state first, so dropout draws the same mask again."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(F.scaled_dot_product_attention, q, k, v, use_reentrant=False, **sdpa)
    return F.scaled_dot_product_attention(q, k, v, **sdpa)
