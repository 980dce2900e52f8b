"""State-dict names between ``model_zoo.gpt.GPT`` and HF's ``GPT2LMHeadModel``.

Ours are nanoGPT's (``model_zoo.gpt``'s docstring), HF's are GPT-2's, and our projections are
``nn.Linear`` (weight (out, in)) where HF's are ``Conv1D`` (weight (in, out)), so those four weights
are transposed::

    embed.wte.weight / embed.wpe.weight  -> transformer.wte.weight / transformer.wpe.weight
    h.{i}.ln_1.* / h.{i}.ln_2.*          -> transformer.h.{i}.ln_1.* / ln_2.*
    h.{i}.attn.qkv.weight (3C, C)        -> transformer.h.{i}.attn.c_attn.weight (C, 3C)   (q, k, v order kept)
    h.{i}.attn.proj / mlp.fc / mlp.proj  -> attn.c_proj / mlp.c_fc / mlp.c_proj            (weights transposed)
    ln_f.ln_f.*                          -> transformer.ln_f.*
    lm_head.weight                       -> lm_head.weight   (the embedding itself when tied)

Strings only: nothing here imports transformers (or torch).
"""
from __future__ import annotations

_PREFIXES = (("embed.wte.", "transformer.wte."), ("embed.wpe.", "transformer.wpe."),
             ("ln_f.ln_f.", "transformer.ln_f."), ("lm_head.", "lm_head."))
_BLOCK = {"ln_1": "ln_1", "ln_2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
          "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
_CONV1D = frozenset({"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"})  # nn.Linear here, Conv1D in HF


def hf_name(name: str) -> tuple[str, bool]:
    """(HF GPT2LMHeadModel key, whether the weight is transposed) of one of our GPT's state keys."""
    for ours, theirs in _PREFIXES:
        if name.startswith(ours):
            return theirs + name[len(ours):], False
    parts = name.split(".")  # h.{i}.{module path}.{weight|bias}
    module = ".".join(parts[2:-1])
    if parts[0] != "h" or module not in _BLOCK:
        raise ValueError(f"parameter {name!r} has no HF GPT2LMHeadModel name")
    return f"transformer.h.{parts[1]}.{_BLOCK[module]}.{parts[-1]}", module in _CONV1D and parts[-1] == "weight"
