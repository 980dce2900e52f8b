"""Megatron-style tensor-parallel layers and `apply_tensor_parallel`, which applies a plan (data).

Megatron-LM (Shoeybi et al. 2019) splits each transformer block so that one all-reduce closes it:

* attention: the fused ``qkv`` projection is column-parallel with a stride-3 split, so rank r
  keeps the q, k and v rows of *its* heads (``[q_r; k_r; v_r]``); attention runs on the local
  heads; ``proj`` is row-parallel and sums the partial outputs.
* MLP: ``fc`` is column-parallel (GELU is elementwise, so it runs on the shard); ``proj`` is
  row-parallel.
* the token embedding and the LM head split the vocabulary rows, padded to a multiple of
  ``128 x tp`` (`mp_toolkit.parallel.vocab_parallel`: any vocabulary splits; padded ids are never
  looked up, get -inf logits and stay zero); the loss is computed on the local vocab shard by
  `vocab_parallel_cross_entropy` without gathering (B, T, V) logits.

Every sharded Parameter carries Megatron's attributes ``tensor_model_parallel = True``,
``partition_dim`` and ``partition_stride`` (a padded one also ``unpadded_size``); replicated ones
(LayerNorm, row-parallel bias) carry none. `gather_full` / `shard_full`
(`mp_toolkit.parallel.layouts`, re-exported here) use them to move between layouts (checkpoints,
export, tests); the full form never holds padding.

A plan is a table next to the model (``model_zoo.gpt.TP_PLAN``)::

    apply_tensor_parallel(LayerList.from_model(gpt), ctx, TP_PLAN)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mp_toolkit.layers import LayerList
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.layouts import (
    TP_ATTRIBUTES,
    full_shape,
    gather_full,
    mark_tensor_parallel,
    shard_full,
    shard_parameter,
    shard_ranges,
)
from mp_toolkit.parallel.tp_comms import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    gathered_projection,
    row_parallel_sum,
    scatter_to_tensor_model_parallel_region,
)
from mp_toolkit.parallel.vocab_parallel import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    gather_vocab_parallel_logits,
    padded_vocab_size,
    vocab_parallel_cross_entropy,
)

STYLES = ("column", "qkv", "row", "vocab")


def _check_divides(what: str, n: int, tp: int, stride: int = 1) -> None:
    if n % (tp * stride) != 0:
        per = f"tp*{stride} = {tp * stride}" if stride > 1 else f"tp = {tp}"
        raise ValueError(f"{what} = {n} is not divisible by {per}: choose a tp that divides {n // stride}")


# ---------------------------------------------------------------- layers

class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A's output rows split: (.., in) replicated -> (.., out / tp) local.

    ``stride`` > 1 splits a fused projection (stride 3 for [q; k; v]) so every rank keeps its own
    slice of each part. ``gather_output=True`` all-gathers (.., out) on every rank (stride 1 only).
    Without ``full_weight`` the layer is initialised like ``nn.Linear(in, out)`` on one device under
    the same RNG state, then sliced, so a TP run starts from the single-device weights.
    Under sequence parallelism (``sequence_parallel``, set by `apply_sequence_parallel`) the input
    is already whole, gathered by the region around the layer, which also sums its gradient: no ``f``.
    """

    tp_region = "open"
    sequence_parallel = False

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, *, bias: bool = True,
                 gather_output: bool = False, stride: int = 1,
                 full_weight: torch.Tensor | None = None, full_bias: torch.Tensor | None = None):
        super().__init__()
        _check_divides("ColumnParallelLinear out_features", out_features, ctx.tp, stride)
        if gather_output and stride != 1:
            raise ValueError("gather_output=True needs stride 1: a strided output is not contiguous per rank")
        if full_weight is None:
            ref = nn.Linear(in_features, out_features, bias=bias)
            full_weight, full_bias = ref.weight, ref.bias
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.stride, self.tp_group = gather_output, stride, ctx.tp_group
        self.weight = shard_parameter(full_weight, 0, stride, ctx)  # (out / tp, in)
        self.bias = shard_parameter(full_bias, 0, stride, ctx) if bias else None  # (out / tp,)

    @classmethod
    def from_full(cls, linear: nn.Linear, ctx: ParallelContext, *, gather_output: bool = False,
                  stride: int = 1) -> "ColumnParallelLinear":
        """This rank's shard of an existing ``nn.Linear``."""
        return cls(linear.in_features, linear.out_features, ctx, bias=linear.bias is not None,
                   gather_output=gather_output, stride=stride, full_weight=linear.weight, full_bias=linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)  # f: sum input grads backward
        y = gathered_projection(x, self.weight, self.bias)  # (.., in) -> (.., out / tp)
        return gather_from_tensor_model_parallel_region(y, self.tp_group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), stride={self.stride}"


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A's input columns split: (.., in / tp) local -> (.., out) replicated.

    The partial products are summed by ``g`` (one all-reduce); the bias is replicated and added
    once, after the reduce. ``input_is_parallel=False`` first scatters a replicated input.
    Under sequence parallelism (``sequence_parallel``) the sum is a reduce-scatter along the
    sequence: each rank keeps (B, T / tp, out), and adds the bias to its slice.
    """

    tp_region = "close"
    sequence_parallel = False

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, *, bias: bool = True,
                 input_is_parallel: bool = True,
                 full_weight: torch.Tensor | None = None, full_bias: torch.Tensor | None = None):
        super().__init__()
        _check_divides("RowParallelLinear in_features", in_features, ctx.tp)
        if full_weight is None:
            ref = nn.Linear(in_features, out_features, bias=bias)
            full_weight, full_bias = ref.weight, ref.bias
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.tp_group = input_is_parallel, ctx.tp_group
        self.weight = shard_parameter(full_weight, 1, 1, ctx)  # (out, in / tp)
        # Replicated: the same full bias on every rank, left unmarked.
        self.bias = (full_bias if isinstance(full_bias, nn.Parameter) else nn.Parameter(full_bias.detach().clone())) \
            if bias else None

    @classmethod
    def from_full(cls, linear: nn.Linear, ctx: ParallelContext, *, input_is_parallel: bool = True
                  ) -> "RowParallelLinear":
        """This rank's shard of an existing ``nn.Linear`` (its bias Parameter is kept, replicated)."""
        return cls(linear.in_features, linear.out_features, ctx, bias=linear.bias is not None,
                   input_is_parallel=input_is_parallel, full_weight=linear.weight, full_bias=linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)  # (.., in) -> (.., in / tp)
        y = row_parallel_sum(F.linear(x, self.weight), self.tp_group, self.sequence_parallel)  # g
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}"


# ---------------------------------------------------------------- plans

def check_tensor_parallel(tp: int, *, n_head: int | None = None, hidden: int | None = None,
                          inner: int | None = None) -> None:
    """Raise ValueError (one line, for the CLI's exit 2) unless ``tp`` divides every size given.
    The vocabulary needs no check: it is padded to a multiple of 128 x tp (`padded_vocab_size`)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"--tp {tp!r} is not a positive integer")
    sizes = {k: v for k, v in (("n_head", n_head), ("hidden", hidden), ("inner", inner)) if v is not None}
    for name, value in sizes.items():
        if value % tp:
            common = math.gcd(*sizes.values())
            ok = [d for d in range(1, common + 1) if common % d == 0]
            raise ValueError(f"--tp {tp} does not divide {name}={value}: choose --tp in {ok}")


def _match_plan(layer_list: LayerList, plan: dict[str, str]) -> list[tuple[int, str, str, str]]:
    """(layer index, module path in the layer, style, full name) of every module a plan key names."""
    bad = {k: s for k, s in plan.items() if s not in STYLES}
    if bad:
        raise ValueError(f"TP plan: unknown style(s) {bad}; choose one of {', '.join(STYLES)}")
    found, used = [], set()
    for i, (layer_name, layer) in enumerate(zip(layer_list.names, layer_list.layers)):
        for path, module in layer.named_modules():
            full = f"{layer_name}.{path}" if path else layer_name
            keys = [k for k in plan if full == k or full.endswith("." + k)]
            if len(keys) > 1:
                raise ValueError(f"TP plan: keys {keys} all match {full!r}; keep one")
            if keys:
                used.add(keys[0])
                _check_style(module, plan[keys[0]], full)
                found.append((i, path, plan[keys[0]], full))
    missing = [k for k in plan if k not in used]
    if missing:
        raise ValueError(f"TP plan: key(s) {missing} match no module of layers {list(layer_list.names)}")
    return found


def _check_style(module: nn.Module, style: str, name: str) -> None:
    """Module type vs style, checked for every tp (so a tp=1 run already reports a wrong plan)."""
    if style in ("column", "qkv", "row"):
        ok, need = isinstance(module, nn.Linear), "an nn.Linear"
        if ok and style == "qkv" and module.out_features % 3:
            ok, need = False, "a fused [q; k; v] nn.Linear (out_features divisible by 3)"
    else:
        params = [(k, tuple(v.shape)) for k, v in module.named_parameters()]
        ok = isinstance(module, (nn.Embedding, nn.Linear)) or (len(params) == 1 and params[0][0] == "weight"
                                                               and len(params[0][1]) == 2)
        need = "an nn.Embedding, an nn.Linear or an LM head whose only parameter is a (V, C) weight"
    if not ok:
        raise ValueError(f"TP plan: {name} is a {type(module).__name__}; style {style!r} needs {need}")


def _convert(module: nn.Module, style: str, ctx: ParallelContext) -> nn.Module:
    if style in ("column", "qkv", "row"):
        if style == "row":
            return RowParallelLinear.from_full(module, ctx, input_is_parallel=True)
        return ColumnParallelLinear.from_full(module, ctx, stride=3 if style == "qkv" else 1)
    if isinstance(module, nn.Embedding):
        return VocabParallelEmbedding.from_full(module, ctx)
    return VocabParallelLMHead.from_full(module, ctx)


def _keep_ties(old: nn.Module, new: nn.Module, seen: dict[int, nn.Parameter], name: str) -> None:
    """A Parameter shared by several modules of the unsplit model stays ONE shard Parameter."""
    for pname, full in old.named_parameters(recurse=False):
        shard = getattr(new, pname)
        if id(full) not in seen:
            seen[id(full)] = shard
            continue
        first = seen[id(full)]
        same = first.shape == shard.shape and all(getattr(first, a, None) == getattr(shard, a, None)
                                                  for a in TP_ATTRIBUTES)
        if not same:
            raise ValueError(f"TP plan: {name}.{pname} is tied to a parameter sharded another way; "
                             "give tied modules styles with the same layout (e.g. 'vocab' for both)")
        setattr(new, pname, first)


def apply_tensor_parallel(layer_list: LayerList, ctx: ParallelContext, plan: dict[str, str]) -> LayerList:
    """Swap every module the plan names for its tensor-parallel shard on this rank.

    ``plan`` maps a module path suffix to a style: ``"attn.qkv"`` matches ``"h.0.attn.qkv"`` (names
    are ``"{layer name}.{module path}"``, a whole layer is its name, e.g. ``"lm_head"``); styles are
    "column", "qkv", "row", "vocab" (module docstring). The plan is validated even for tp == 1,
    which returns ``layer_list`` itself. For tp > 1 the layers are modified in place (copy the model
    first to keep an unsplit one) and a new LayerList with the same names and tie groups is
    returned; tied parameters stay one Parameter.
    """
    matches = _match_plan(layer_list, plan)
    if ctx.tp_group is None:
        return layer_list
    layers, seen = list(layer_list.layers), {}
    for i, path, style, name in matches:
        old = layers[i].get_submodule(path) if path else layers[i]
        try:
            new = _convert(old, style, ctx)
        except ValueError as e:
            raise ValueError(f"TP plan: {name}: {e}") from None
        _keep_ties(old, new, seen, name)
        if not path:
            layers[i] = new
        else:
            layers[i].set_submodule(path, new)
    out = LayerList(list(zip(layer_list.names, layers)), layer_list.tie_groups)
    for group in out.tie_groups:  # e.g. a plan that shards the embedding but not the tied LM head
        if len({id(out[layer].get_parameter(p)) for layer, p in group}) != 1:
            raise ValueError(f"TP plan: tie group {list(group)} is split inconsistently; shard every member alike")
    return out


# The vocab-parallel layers and the layout functions live in their own modules; they are
# re-exported here, where the plan that uses them is applied.
__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelLMHead",
    "vocab_parallel_cross_entropy", "gather_vocab_parallel_logits", "padded_vocab_size",
    "apply_tensor_parallel", "check_tensor_parallel",
    "gather_full", "shard_full", "shard_ranges", "full_shape", "mark_tensor_parallel", "TP_ATTRIBUTES", "STYLES",
]
