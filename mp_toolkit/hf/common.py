"""Pieces every HF adapter shares: the padding mask that travels, the final norm, tie groups.

What travels between layers (and so between pipeline stages) is tensors only:

* the hidden state (B, T, C), the only differentiable tensor;
* the HF padding mask (B, T), 1 = attend / 0 = padding, as the caller gave it (int or bool), or
  ones when the caller gave none; the executor sends int and bool tensors without gradients;
* for rotary models, the position ids (1, T) or (B, T) (int64).

Each block rebuilds the 4-D mask its HF layer expects from the (B, T) mask with HF's own mask
function (`create_causal_mask`, `create_sliding_window_causal_mask` or `create_bidirectional_mask`,
called exactly as the HF model calls it), so the result is whatever HF builds for the configured
``attn_implementation``: an additive float mask for "eager", a boolean mask or None (SDPA's
``is_causal`` fast path) for "sdpa". A (B, 1, T, T) mask is never sent: it costs T times the
(B, T) one, and None cannot travel at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def padding_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The (B, T) mask that travels: the caller's (HF semantics, 1 = attend) or ones.

    A mask of ones builds the same 4-D mask as HF's ``attention_mask=None`` (no padding; SDPA
    still takes its ``is_causal`` path). One difference: without a mask HF looks for packed
    sequences in explicit ``position_ids`` (positions restarting at 0); with this mask it does not.
    A floating mask becomes bool (HF reads it as ``mask != 0`` too) so that it carries no gradient.
    """
    if attention_mask is None:
        return torch.ones(input_ids.shape, dtype=torch.long, device=input_ids.device)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected (B, T) = "
                         f"{tuple(input_ids.shape)} like input_ids (1 = attend, 0 = padding)")
    return attention_mask != 0 if attention_mask.is_floating_point() else attention_mask


def whole_sequence(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What HF's mask functions read from ``inputs_embeds`` (batch, length, dtype, device) for the
    whole sequence: ``hidden`` itself, or under sequence parallelism (``hidden`` holds T / tp of
    the tokens, the (B, T) ``mask`` all of them) a broadcast view of the whole length, no copy.
    The attention it is built for sees the whole sequence (`mp_toolkit.parallel.sequence_parallel`)."""
    if hidden.shape[1] == mask.shape[-1]:
        return hidden
    return hidden[:, :1].expand(-1, mask.shape[-1], *hidden.shape[2:])


class FinalNorm(nn.Module):
    """The model's last norm (HF's own module): (hidden, *masks) -> norm(hidden) (B, T, C).

    The masks and positions travel no further: the LM head after it takes one tensor.
    """

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, hidden: torch.Tensor, *travelling: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


def tie_groups(layers: Sequence[tuple[str, nn.Module]]) -> list[list[tuple[str, str]]]:
    """Groups of (layer name, parameter path) that are one Parameter held by several layers.

    Read off identity, so whatever HF tied (``tie_word_embeddings``: the input embedding and the
    LM head / MLM decoder) becomes a tie group, and nothing else does. A Parameter two modules of
    the same layer share (BERT's ``predictions.bias`` is ``predictions.decoder.bias``) needs no group.
    """
    where: dict[int, list[tuple[str, str]]] = {}
    for name, layer in layers:
        for path, p in layer.named_parameters():  # de-duplicated within the layer
            where.setdefault(id(p), []).append((name, path))
    return [members for members in where.values() if len(members) > 1]


def layer_state_dict(layer_list, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """``{"{layer name}.{key}": tensor}`` over every layer's state dict (parameters and persistent
    buffers), the names checkpoints use; a tied tensor appears under each layer that holds it."""
    out: dict[str, torch.Tensor] = {}
    for name, layer in zip(layer_list.names, layer_list.layers):
        for key, t in layer.state_dict(keep_vars=keep_vars).items():
            out[f"{name}.{key}"] = t
    return out
