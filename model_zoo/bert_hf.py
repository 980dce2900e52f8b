"""State-dict names between ``model_zoo.bert.BertForPreTraining`` and HF's ``BertForPreTraining``.

Our names are HF's with the top-level module replaced by the layer that holds the parameter:

    embeddings.*          <-> bert.embeddings.*
    encoder.layer.i.*     <-> bert.encoder.layer.i.*
    heads.pooler.*        <-> bert.pooler.*
    heads.predictions.*   <-> cls.predictions.*       (HF also stores decoder.bias as cls.predictions.bias)
    heads.seq_relationship.* <-> cls.seq_relationship.*

Used to load HF weights for the equivalence tests and to export trained weights. Plain tensors
in, plain tensors out: nothing here imports transformers.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

# (our prefix, HF prefix), most specific first.
_PREFIXES = (
    ("heads.pooler.", "bert.pooler."),
    ("heads.predictions.", "cls.predictions."),
    ("heads.seq_relationship.", "cls.seq_relationship."),
    ("embeddings.", "bert.embeddings."),
    ("encoder.", "bert.encoder."),
)
# HF keeps the decoder bias twice (cls.predictions.bias is cls.predictions.decoder.bias).
_HF_ALIASES = {"cls.predictions.decoder.bias": ("cls.predictions.bias",)}


def hf_name(name: str) -> str:
    """Our state-dict key -> HF BertForPreTraining's key."""
    for ours, theirs in _PREFIXES:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise ValueError(f"parameter {name!r} has no HF BertForPreTraining name")


def hf_state_dict_map(model: nn.Module) -> dict[str, str]:
    """Every key of ``model.state_dict()`` (tied weights under each name) -> its HF key."""
    return {name: hf_name(name) for name in model.state_dict()}


def load_hf_state_dict(model: nn.Module, hf_sd: Mapping[str, torch.Tensor]) -> nn.Module:
    """Copy an HF ``BertForPreTraining`` state dict into ``model`` (in place); returns the model.

    Every parameter must be found with the right shape; HF buffers (position_ids) and keys of
    other heads are ignored. A tied decoder weight is the embedding, loaded once.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():  # de-duplicated: tied weights appear once
            key = hf_name(name)
            candidates = (key,) + _HF_ALIASES.get(key, ())
            found = next((k for k in candidates if k in hf_sd), None)
            if found is None:
                raise ValueError(f"HF state dict has no {key!r} (for our {name!r}): is it a "
                                 f"BertForPreTraining state dict with {len(model.encoder.layer)} layers?")
            src = hf_sd[found]
            if tuple(src.shape) != tuple(param.shape):
                raise ValueError(f"HF {found!r} has shape {tuple(src.shape)} but our {name!r} has "
                                 f"{tuple(param.shape)}: the configs differ")
            param.copy_(src)
    return model


def to_hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights under HF BertForPreTraining's keys, loadable with strict=True.

    Tensors are detached views of the model's (tied ones shared), as ``state_dict()`` returns.
    """
    out = {hf_name(name): t.detach() for name, t in model.state_dict().items()}
    for key, aliases in _HF_ALIASES.items():
        for alias in aliases:
            out[alias] = out[key]
    return out
