"""Megatron-style tensor-parallel layers and `apply_tensor_parallel`, which applies a plan (data).

Megatron-LM (Shoeybi et al. 2019) splits each transformer block so that one all-reduce closes it:

* attention: the fused ``qkv`` projection is column-parallel with a stride-3 split, so rank r
  keeps the q, k and v rows of *its* heads (``[q_r; k_r; v_r]``); attention runs on the local
  heads; ``proj`` is row-parallel and sums the partial outputs.
* MLP: ``fc`` is column-parallel (GELU is elementwise, so it runs on the shard); ``proj`` is
  row-parallel.
* the token embedding and the LM head split the vocabulary rows; the loss is computed on the
  local vocab shard by `vocab_parallel_cross_entropy` without gathering (B, T, V) logits.

Every sharded Parameter carries Megatron's attributes ``tensor_model_parallel = True``,
``partition_dim`` and ``partition_stride``; replicated ones (LayerNorm, row-parallel bias) carry
none. `gather_full` / `shard_full` use them to move between layouts (checkpoints, tests).

A plan is a table next to the model (``model_zoo.gpt.TP_PLAN``)::

    apply_tensor_parallel(LayerList.from_model(gpt), ctx, TP_PLAN)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mp_toolkit.layers import LayerList
from mp_toolkit.optim.groups import is_tensor_parallel
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.tp_comms import (
    all_gather, all_reduce, copy_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region,
    group_rank, group_size, reduce_from_tensor_model_parallel_region, scatter_to_tensor_model_parallel_region,
)

STYLES = ("column", "qkv", "row", "vocab")


# ---------------------------------------------------------------- layouts: full <-> shard

def shard_full(full: torch.Tensor, layout, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of ``full``. ``layout`` is a sharded parameter (its ``partition_dim`` /
    ``partition_stride``) or a ``(dim, stride)`` pair; a replicated parameter returns ``full``.

    The dim is cut into ``tp * stride`` equal chunks and rank r keeps chunks r, r + tp, ... . With
    stride 3 on a fused (3C, C) qkv weight the chunks are q_0..q_{tp-1}, k_0.., v_0.., so rank r
    keeps [q_r; k_r; v_r] (Megatron's strided split).
    """
    if isinstance(layout, torch.Tensor):
        if not is_tensor_parallel(layout):
            return full
        layout = (layout.partition_dim, layout.partition_stride)
    dim, stride = layout
    ranges = shard_ranges(full.shape[dim], stride, tp_rank, tp, dim)
    return torch.cat([full.narrow(dim, start, stop - start) for start, stop in ranges], dim=dim)


def shard_ranges(n: int, stride: int, tp_rank: int, tp: int, dim: int = 0) -> list[tuple[int, int]]:
    """The [start, stop) ranges of a size-``n`` dim that rank ``tp_rank`` keeps, in order: chunks
    r, r + tp, ... of ``tp * stride`` equal chunks (`shard_full`; a file is read as these slices)."""
    if n % (tp * stride) != 0:
        raise ValueError(f"dim {dim} of size {n} is not divisible by tp*stride = {tp}*{stride}")
    size = n // (tp * stride)
    return [(k * size, (k + 1) * size) for k in range(tp_rank, tp * stride, tp)]


def gather_full(param: torch.Tensor, group, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The full (unsharded) tensor of a sharded parameter, on every rank of ``group``.

    ``tensor`` (default: ``param`` itself) is anything laid out like ``param``, e.g. ``param.grad``.
    Replicated parameters, or ``group=None``, return ``tensor`` as it is. Not differentiable.
    """
    t = param if tensor is None else tensor
    if not is_tensor_parallel(param) or group_size(group) == 1:
        return t
    dim, stride = param.partition_dim, param.partition_stride
    # shards[r] = [chunk r, chunk r + tp, ...]; the full tensor lists chunk 0, 1, 2, ... in order
    pieces = [s.chunk(stride, dim=dim) for s in all_gather(t.detach(), group)]
    return torch.cat([p[s] for s in range(stride) for p in pieces], dim=dim)


def mark_tensor_parallel(param: nn.Parameter, dim: int, stride: int = 1) -> nn.Parameter:
    """Set Megatron's sharding attributes on ``param`` (read by optimizers, clipping, checkpoints)."""
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = stride
    return param


def _shard_parameter(full: torch.Tensor, dim: int, stride: int, ctx: ParallelContext) -> nn.Parameter:
    shard = shard_full(full.detach(), (dim, stride), ctx.tp_rank, ctx.tp).clone()
    return mark_tensor_parallel(nn.Parameter(shard, requires_grad=full.requires_grad), dim, stride)


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
    """

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
        self.weight = _shard_parameter(full_weight, 0, stride, ctx)  # (out / tp, in)
        self.bias = _shard_parameter(full_bias, 0, stride, ctx) if bias else None  # (out / tp,)

    @classmethod
    def from_full(cls, linear: nn.Linear, ctx: ParallelContext, *, gather_output: bool = False,
                  stride: int = 1) -> "ColumnParallelLinear":
        """This rank's shard of an existing ``nn.Linear``."""
        return cls(linear.in_features, linear.out_features, ctx, bias=linear.bias is not None,
                   gather_output=gather_output, stride=stride, full_weight=linear.weight, full_bias=linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_model_parallel_region(x, self.tp_group)  # f: sum input grads backward
        y = F.linear(x, self.weight, self.bias)  # (.., in) -> (.., out / tp)
        return gather_from_tensor_model_parallel_region(y, self.tp_group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), stride={self.stride}"


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A's input columns split: (.., in / tp) local -> (.., out) replicated.

    The partial products are summed by ``g`` (one all-reduce); the bias is replicated and added
    once, after the reduce. ``input_is_parallel=False`` first scatters a replicated input.
    """

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
        self.weight = _shard_parameter(full_weight, 1, 1, ctx)  # (out, in / tp)
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
        y = reduce_from_tensor_model_parallel_region(F.linear(x, self.weight), self.tp_group)  # g
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary rows split: rank r holds ids [r V/tp, (r+1) V/tp).

    Ids owned by another rank look up zeros here; ``g`` sums the ranks so every rank gets the full
    (B, T, C) embedding. Initialised like ``nn.Embedding`` (N(0, 1)) when no ``full_weight`` is given.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ParallelContext, *,
                 padding_idx: int | None = None, full_weight: torch.Tensor | None = None):
        super().__init__()
        _check_divides("VocabParallelEmbedding num_embeddings", num_embeddings, ctx.tp)
        if full_weight is None:
            full_weight = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx).weight
        self.num_embeddings, self.embedding_dim, self.tp_group = num_embeddings, embedding_dim, ctx.tp_group
        per = num_embeddings // ctx.tp
        self.vocab_start, self.vocab_end = ctx.tp_rank * per, (ctx.tp_rank + 1) * per
        # padding_idx only zeroes that row's gradient; it matters on the rank that owns the row.
        owns_pad = padding_idx is not None and self.vocab_start <= padding_idx % num_embeddings < self.vocab_end
        self.local_padding_idx = padding_idx % num_embeddings - self.vocab_start if owns_pad else None
        self.weight = _shard_parameter(full_weight, 0, 1, ctx)  # (V / tp, C)

    @classmethod
    def from_full(cls, emb: nn.Embedding, ctx: ParallelContext) -> "VocabParallelEmbedding":
        """This rank's rows of an existing ``nn.Embedding`` (max_norm / sparse are not supported)."""
        if emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
            raise ValueError("VocabParallelEmbedding supports no max_norm, sparse or scale_grad_by_freq")
        return cls(emb.num_embeddings, emb.embedding_dim, ctx, padding_idx=emb.padding_idx, full_weight=emb.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return F.embedding(ids, self.weight, self.local_padding_idx)
        foreign = (ids < self.vocab_start) | (ids >= self.vocab_end)  # (B, T) ids of other ranks
        local_ids = torch.where(foreign, 0, ids - self.vocab_start)
        out = F.embedding(local_ids, self.weight, self.local_padding_idx)  # (B, T, C)
        out = out.masked_fill(foreign.unsqueeze(-1), 0.0)  # also stops their gradient reaching row 0
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)


class VocabParallelLMHead(nn.Module):
    """Bias-free output projection with vocab rows split: (B, T, C) -> local logits (B, T, V / tp).

    Feed the local logits to `vocab_parallel_cross_entropy`; the full (B, T, V) never exists.
    """

    def __init__(self, vocab_size: int, hidden: int, ctx: ParallelContext, *,
                 full_weight: torch.Tensor | None = None, init_std: float = 0.02):
        super().__init__()
        _check_divides("VocabParallelLMHead vocab_size", vocab_size, ctx.tp)
        if full_weight is None:
            full_weight = nn.init.normal_(torch.empty(vocab_size, hidden), std=init_std)
        self.vocab_size, self.hidden, self.tp_group = vocab_size, hidden, ctx.tp_group
        self.weight = _shard_parameter(full_weight, 0, 1, ctx)  # (V / tp, C)

    @classmethod
    def from_full(cls, head: nn.Module, ctx: ParallelContext) -> "VocabParallelLMHead":
        """Shard a module whose only parameter is a (V, C) ``weight`` and whose forward is
        ``F.linear(x, weight)`` (model_zoo's GPTLMHead)."""
        params = dict(head.named_parameters())
        if list(params) != ["weight"] or params["weight"].dim() != 2:
            shapes = [(k, tuple(v.shape)) for k, v in params.items()]
            raise ValueError(f"{type(head).__name__} is not an LM head: it needs one (V, C) weight, got {shapes}")
        vocab_size, hidden = params["weight"].shape
        return cls(vocab_size, hidden, ctx, full_weight=params["weight"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tensor_model_parallel_region(x, self.tp_group), self.weight)


# ---------------------------------------------------------------- loss

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token -log softmax(logits)[label] with the vocab split over ``group``.

    Stable: logits are shifted by the global max (all-reduce MAX); the target logit (non-zero only
    on the owning rank) and the sum of exponentials travel in one all-reduce SUM.
    """

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start):
        # logits (N, V / tp) fp32, labels (N,) int64
        shifted = logits - all_reduce(logits.max(dim=-1).values, group, op="max").unsqueeze(-1)
        mine = (labels >= vocab_start) & (labels < vocab_start + logits.shape[-1])  # (N,)
        local = torch.where(mine, labels - vocab_start, 0)
        target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine  # (N,), 0 off the owner
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
    """Mean cross-entropy of (.., V / tp) local logits, equal to F.cross_entropy over the full
    (.., V) logits with ``ignore_index``; rank r's shard holds vocab ids [r V/tp, (r+1) V/tp).
    Computed and returned in fp32. ``group=None`` is plain single-device cross-entropy.
    """
    v_local = local_logits.shape[-1]
    flat, labels = local_logits.reshape(-1, v_local).float(), labels.reshape(-1)
    if flat.shape[0] != labels.shape[0]:
        raise ValueError(f"logits {tuple(local_logits.shape)} and labels {tuple(labels.shape)} disagree")
    per_token = _VocabParallelCrossEntropy.apply(flat, labels, group, group_rank(group) * v_local)
    valid = labels != ignore_index
    return (per_token * valid).sum() / valid.sum()  # all ignored -> nan, as F.cross_entropy


# ---------------------------------------------------------------- plans

def check_tensor_parallel(tp: int, *, n_head: int | None = None, hidden: int | None = None,
                          inner: int | None = None, vocab: int | None = None) -> None:
    """Raise ValueError (one line, for the CLI's exit 2) unless ``tp`` divides every size given."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"--tp {tp!r} is not a positive integer")
    sizes = {k: v for k, v in (("n_head", n_head), ("hidden", hidden), ("inner", inner), ("vocab", vocab))
             if v is not None}
    for name, value in sizes.items():
        if value % tp:
            common = math.gcd(*sizes.values())
            ok = [d for d in range(1, common + 1) if common % d == 0]
            pad = f", or pad vocab to {-(-value // tp) * tp}" if name == "vocab" else ""
            raise ValueError(f"--tp {tp} does not divide {name}={value}: choose --tp in {ok}{pad}")


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
        ok = isinstance(module, nn.Embedding) or (len(params) == 1 and params[0][0] == "weight"
                                                  and len(params[0][1]) == 2)
        need = "an nn.Embedding or an LM head whose only parameter is a (V, C) weight"
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
        same = (is_tensor_parallel(first) == is_tensor_parallel(shard) and first.shape == shard.shape
                and getattr(first, "partition_dim", None) == getattr(shard, "partition_dim", None)
                and getattr(first, "partition_stride", None) == getattr(shard, "partition_stride", None))
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
            parent, _, attr = path.rpartition(".")
            setattr(layers[i].get_submodule(parent) if parent else layers[i], attr, new)
    out = LayerList(list(zip(layer_list.names, layers)), layer_list.tie_groups)
    for group in out.tie_groups:  # e.g. a plan that shards the embedding but not the tied LM head
        if len({id(out[layer].get_parameter(p)) for layer, p in group}) != 1:
            raise ValueError(f"TP plan: tie group {list(group)} is split inconsistently; shard every member alike")
    return out


__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelLMHead",
    "vocab_parallel_cross_entropy", "apply_tensor_parallel", "check_tensor_parallel",
    "gather_full", "shard_full", "shard_ranges", "mark_tensor_parallel", "STYLES",
]
