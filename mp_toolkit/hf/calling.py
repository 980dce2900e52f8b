"""Calling a `from_hf` layer list as one calls its HF model: HF's positional order and keywords.

    layers = from_hf(model)
    layers(input_ids, attention_mask)                       # Llama / Mistral / Qwen2, as model(...)
    layers(input_ids, attention_mask, token_type_ids)       # BERT, HF's order
    layers(input_ids=ids, attention_mask=mask)              # every family
    loss, logits = layers(input_ids=ids, labels=ids)        # HF's return_dict=False tuple

The call is bound to the HF class's own ``forward`` signature (read off the class, so it follows
the installed transformers), so a positional argument means what it means to HF: GPT-2's second
parameter is its ``cache`` (``past_key_values`` in older versions), not the mask. Of HF's
parameters the list takes the inputs its first layer takes (``input_ids``, ``attention_mask``,
``token_type_ids`` for GPT-2 and BERT, ``position_ids``) and the labels; any other one given a
value (a cache, ``inputs_embeds``, ...) is refused in one line, never ignored.

Without labels the result is what the layers return (logits (B, T, V); BertForPreTraining:
(prediction_logits, seq_relationship_logits)). With labels it is HF's ``return_dict=False``
tuple, the loss first, computed as HF computes it: causal LMs shift ``labels`` inside
(`mp_toolkit.hf.losses.shift_labels`), BERT's MLM loss ignores -100, BertForPreTraining adds the
next-sentence loss and needs ``next_sentence_label`` with ``labels``.

The pipeline engine does not come through here: stage 0 calls the first layer with a
micro-batch's inputs positionally, in the order of the first layer's signature (HF's, without
GPT-2's cache).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn

from mp_toolkit.hf.losses import causal_lm_loss, masked_lm_loss, pretraining_loss, shift_labels
from mp_toolkit.layers import LayerList

LABELS = ("labels", "next_sentence_label")
IGNORED_FALSE = ("use_cache", "return_dict")  # accepted when they ask for nothing (None or False)


def causal_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``*ForCausalLM(labels=...)``'s loss: HF-style (unshifted) labels, shifted here."""
    return causal_lm_loss(outputs, shift_labels(labels))


def mlm_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``BertForMaskedLM(labels=...)``'s loss."""
    return masked_lm_loss(outputs, labels)


def bert_pretraining_loss(outputs: tuple, labels: torch.Tensor | None = None,
                          next_sentence_label: torch.Tensor | None = None) -> torch.Tensor:
    """``BertForPreTraining(labels=..., next_sentence_label=...)``'s total loss (MLM + NSP)."""
    if labels is None or next_sentence_label is None:
        raise ValueError("BertForPreTraining's loss is the MLM loss plus the next-sentence loss: give labels= "
                         "and next_sentence_label= together (HF computes no loss from either alone)")
    return pretraining_loss(outputs, (labels, next_sentence_label))


LOSSES = {"GPT2LMHeadModel": causal_loss, "BertForMaskedLM": mlm_loss, "BertForPreTraining": bert_pretraining_loss}


class HFLayerList(LayerList):
    """A LayerList that ``from_hf`` built, callable with its HF model's arguments (module docstring).

    ``hf_class``: the HF model's class name; ``signature``: its ``forward``'s parameters (without
    ``self`` and ``**kwargs``); the first layer's parameter names are the inputs it takes.
    """

    def __init__(self, layers: Sequence[tuple[str, nn.Module]], tie_groups, hf_class: str,
                 signature: inspect.Signature, loss: Callable):
        super().__init__(layers, tie_groups)
        self.hf_class, self.signature, self.loss = hf_class, signature, loss
        first = inspect.signature(self.layers[0].forward).parameters
        self.inputs = tuple(name for name in first if name in signature.parameters)

    @classmethod
    def of(cls, model: nn.Module, layers: Sequence[tuple[str, nn.Module]], tie_groups) -> "HFLayerList":
        name = type(model).__name__
        params = [p for p in inspect.signature(type(model).forward).parameters.values()
                  if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
        return cls(layers, tie_groups, name, inspect.Signature(params), LOSSES.get(name, causal_loss))

    def forward(self, *args, **kwargs):
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.hf_class} layer list: {e} (it takes {self.hf_class}.forward's arguments: "
                            f"{', '.join(self.signature.parameters)})") from None
        given = {k: v for k, v in bound.arguments.items()
                 if v is not None and not (k in IGNORED_FALSE and v is False)}
        labels = {k: given.pop(k) for k in LABELS if k in given}
        unsupported = [k for k in given if k not in self.inputs]
        if unsupported:
            raise ValueError(f"{self.hf_class} layer list does not take {', '.join(unsupported)}: it takes "
                             f"{', '.join(self.inputs + tuple(k for k in LABELS if k in self.signature.parameters))}"
                             " (by keyword, or positionally in the HF model's order)")
        if "input_ids" not in given:
            raise ValueError(f"{self.hf_class} layer list needs input_ids (B, T)")
        out = super().forward(*(given.get(k) for k in self.inputs))
        if not labels:
            return out
        return (self.loss(out, **labels), *(out if isinstance(out, tuple) else (out,)))
