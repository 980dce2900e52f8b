"""An HF ``config.json`` read as a `ModelShape`, its values checked first: the one check that
`mpt plan --model config.json`, `mpt train --hf DIR`, the run's cut and `mpt export --config` share.

Every size is a positive integer (JSON ``12``, not ``"12"``, ``12.0`` or ``true``), every dropout a number
in [0, 1), every epsilon a positive number; the heads divide the width; at most `MAX_LAYERS` blocks and
`MAX_PARAMETERS` parameters, so that nothing is built (not even on the meta device, where a billion
blocks still take hours and a billion-wide matrix overflows torch's storage arithmetic) from a config
no cluster could train. Each failure is one `CostModelError` line naming the file and the key.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from mp_toolkit.arch.architectures import BY_MODEL_TYPE
from mp_toolkit.arch.shape import ModelShape
from mp_toolkit.errors import CostModelError

MAX_LAYERS = 10_000
"""More blocks than any model trained so far; beyond it a plan would not fit in memory."""

MAX_PARAMETERS = 10**13
"""Ten trillion: more than any model trained so far (each parameter's fp32 weight alone is 40 TB)."""

SIZE_KEYS = ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_inner", "hidden_size",
             "num_hidden_layers", "num_attention_heads", "intermediate_size", "num_key_value_heads",
             "max_position_embeddings", "type_vocab_size", "head_dim")
"""Sizes a config may give; ``n_inner``, ``num_key_value_heads`` and ``head_dim`` may also be null."""

OPTIONAL_SIZES = ("n_inner", "num_key_value_heads", "head_dim")

DROPOUT_KEYS = ("attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
                "attention_dropout", "classifier_dropout")

EPSILON_KEYS = ("layer_norm_epsilon", "layer_norm_eps", "rms_norm_eps")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_values(d: Mapping, source: str) -> None:
    """One-line CostModelError unless every size, dropout and epsilon ``d`` gives is in range."""
    for k in SIZE_KEYS:
        v = d.get(k)
        if v is None and (k in OPTIONAL_SIZES or k not in d):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise CostModelError(f"{source}: {k}={_show(v)} must be a positive integer")
    for k in DROPOUT_KEYS:
        v = d.get(k)
        if v is not None and not (_number(v) and 0 <= v < 1):
            raise CostModelError(f"{source}: {k}={_show(v)} must be a dropout probability in [0, 1)")
    for k in EPSILON_KEYS:
        v = d.get(k)
        if k in d and not (_number(v) and v > 0):
            raise CostModelError(f"{source}: {k}={_show(v)} must be a positive number")


def _show(v) -> str:
    text = repr(v)
    return text if len(text) < 40 else text[:37] + "..."


def shape_from_hf_config(d: Mapping, source: str = "config", hf_modules: bool = False) -> ModelShape:
    """A `ModelShape` from a HuggingFace ``config.json`` dict of the GPT-2, BERT or Llama families
    (read by its architecture's record, `mp_toolkit.arch.architectures`), its values checked
    (`check_values`, the layer and parameter bounds, heads dividing the width); ``hf_modules``: the
    model is built from transformers' modules (`ModelShape.hf_modules`)."""
    mt = d.get("model_type")
    arch = BY_MODEL_TYPE.get(mt) if isinstance(mt, str) else None
    if arch is None:
        raise CostModelError(f"{source}: model_type {_show(mt)} is not supported: choose a config of "
                             f"{', '.join(sorted(BY_MODEL_TYPE))}")
    check_values(d, source)
    try:
        shape = arch.read(d, mt, hf_modules)
    except KeyError as e:
        raise CostModelError(f"{source}: a {mt} config needs the key {e.args[0]!r}") from None
    if shape.num_layers > MAX_LAYERS:
        raise CostModelError(f"{source}: {shape.num_layers} layers is more than the planner handles "
                             f"(at most {MAX_LAYERS})")
    if not shape.head_dim and shape.hidden % shape.heads:
        raise CostModelError(f"{source}: hidden size {shape.hidden} is not divisible by {shape.heads} heads")
    if shape.heads % shape.kvh:
        raise CostModelError(f"{source}: {shape.heads} attention heads are not a multiple of {shape.kvh} "
                             f"key/value heads")
    params = rough_parameters(shape)
    if params > MAX_PARAMETERS:
        raise CostModelError(f"{source}: about {params:.2g} parameters is more than any model trained so far "
                             f"(at most {MAX_PARAMETERS:.0e}): check its sizes")
    return shape


def rough_parameters(shape: ModelShape) -> int:
    """The parameters' count to a few percent (matrices only: embeddings, attention, MLP, head), for the
    bound alone; the cost model counts them exactly (`mp_toolkit.partition.cost.total_parameters`)."""
    h, hd = shape.hidden, shape.hd
    attention = h * hd * (2 * shape.heads + 2 * shape.kvh)
    mlp = h * shape.ffn * (3 if shape.family == "llama" else 2)
    embeddings = (shape.vocab_size + shape.positions + shape.type_vocab) * h
    return embeddings * (1 if shape.tied else 2) + shape.num_layers * (attention + mlp)
