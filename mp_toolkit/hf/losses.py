"""Loss functions for HF layer lists, in OUR label convention.

Our data pipeline (`mp_toolkit.data.lm`) yields ``(input_ids, labels)`` already shifted by one: a
window of T + 1 tokens gives ``input_ids = w[:-1]`` and ``labels = w[1:]``, so ``labels[:, t]`` is
the target of position t and every position has one. HF's ``model(input_ids, labels=labels)``
instead takes *unshifted* labels (``labels = input_ids``) and shifts inside (its
``ForCausalLMLoss``: pad with -100, drop the first), so HF's last position has no target. What
HF calls ``shift_labels`` is our ``labels``; `shift_labels` converts HF-style labels to ours, and

    causal_lm_loss(logits, shift_labels(hf_labels)) == model(input_ids, labels=hf_labels).loss

bit for bit (tests/test_hf.py). -100 is ignored either way (set it on padding positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mp_toolkit.parallel.tensor_parallel import vocab_parallel_cross_entropy

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """HF-style labels (B, T) (``labels[:, t]`` is token t) -> ours (B, T) (``[:, t]`` is token t + 1;
    the last position gets ``ignore_index``), exactly as HF's ForCausalLMLoss shifts."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Mean next-token cross-entropy over positions whose label is not -100.

    ``logits`` (B, T, V) from the layer list, ``labels`` (B, T) pre-shifted (our convention, see
    the module docstring). Computed in fp32 as HF does. With tensor parallelism pass the local
    (B, T, Vp / tp) logits and ``tp_group``: the vocab-parallel cross-entropy never gathers them.
    """
    if tp_group is not None:
        return vocab_parallel_cross_entropy(logits, labels, tp_group, ignore_index=IGNORE_INDEX)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: labels "
                         "must be (B, T), already shifted (labels[:, t] is the token after position t)")
    logits = logits.float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor, tp_group=None) -> torch.Tensor:
    """BertForMaskedLM's loss: mean cross-entropy over positions whose label is not -100
    (labels (B, T) are the original tokens at masked positions; no shift). With tensor
    parallelism pass the local (B, T, Vp / tp) logits and ``tp_group`` (vocab-parallel)."""
    if tp_group is not None:
        return vocab_parallel_cross_entropy(logits, labels, tp_group, ignore_index=IGNORE_INDEX)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)


def pretraining_loss(outputs: tuple[torch.Tensor, torch.Tensor], labels: tuple[torch.Tensor, torch.Tensor],
                     tp_group=None) -> torch.Tensor:
    """BertForPreTraining's total loss: masked-LM loss + next-sentence cross-entropy.

    ``outputs`` is (prediction_logits (B, T, V), seq_relationship_logits (B, 2)); ``labels`` is
    (mlm_labels (B, T), next_sentence_label (B,)). ``tp_group``: the MLM logits are local and
    vocab-parallel (`masked_lm_loss`); the (B, 2) NSP logits are replicated.
    """
    if not isinstance(outputs, (tuple, list)) or len(outputs) != 2:
        raise TypeError(f"pretraining_loss needs (prediction_logits, seq_relationship_logits), got "
                        f"{type(outputs).__name__}")
    (mlm, nsp), (mlm_labels, nsp_labels) = outputs, labels
    return masked_lm_loss(mlm, mlm_labels, tp_group) + F.cross_entropy(nsp.view(-1, 2), nsp_labels.view(-1))
