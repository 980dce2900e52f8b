"""Parameter groups and the per-parameter facts the layer-wise optimizers (LAMB, LARS) share.

* `lamb_param_groups` builds the usual two groups: decayed + layer-adapted weights, and
  biases / norm weights that get neither.
* A parameter that tensor parallelism shards carries ``param.tensor_model_parallel = True``
  (Megatron's attribute). Its norms must be the whole tensor's, so the squared norms of every
  sharded tensor are summed over the tensor-parallel group in ONE all-reduce per step
  (`allreduce_sharded_squares`). Pipeline stages never talk to each other here: each stage's
  optimizer computes the trust ratios of its own tensors (issue 4, item 2).
* Hyper-parameter validation that speaks to the user (STYLE.md 11).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def lamb_param_groups(model_or_named_params, weight_decay: float,
                      no_decay: Sequence[str] = ("bias", "norm"), adapt_all: bool = False) -> list[dict]:
    """Two param groups for LAMB / LARS: ``[{decay, adapt=True}, {weight_decay=0, adapt=False}]``.

    The rule: a parameter is *no-decay* when its name contains any ``no_decay`` substring
    (case-insensitive) **or** it has at most one dimension. The second clause catches LayerNorm
    weights, which our GPT names ``h.0.ln_1.weight`` / ``ln_f.ln_f.weight`` (no "norm" in the
    name), and every bias. No-decay parameters get ``weight_decay=0`` and ``adapt=False``
    (trust ratio 1), as in BERT's LAMB recipe.

    ``adapt_all=True`` keeps the no-decay group's layer adaptation (``adapt=True``), as DeepSpeed's
    FusedLamb adapts every tensor whatever its group's decay.

    Accepts an ``nn.Module`` (its ``named_parameters()``) or an iterable of ``(name, param)``.
    Frozen parameters (``requires_grad=False``) are left out, a parameter listed twice (tied)
    appears once, and empty groups are dropped.
    """
    check_hparam("lamb_param_groups", "weight_decay", weight_decay)
    named = (model_or_named_params.named_parameters() if isinstance(model_or_named_params, torch.nn.Module)
             else model_or_named_params)
    keys = tuple(s.lower() for s in no_decay)
    decay, plain, seen = [], [], set()
    for name, p in named:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        skip = whole_dim(p) <= 1 or any(k in name.lower() for k in keys)
        (plain if skip else decay).append(p)
    groups = [{"params": decay, "weight_decay": float(weight_decay), "adapt": True},
              {"params": plain, "weight_decay": 0.0, "adapt": adapt_all}]
    return [g for g in groups if g["params"]]


@dataclass(frozen=True)
class PartialSums:
    """ZeRO-1: the data-parallel group whose ranks hold pieces of the optimizer's tensors, and how
    many of those tensors are split between two or more ranks (alike on every rank of the group)."""

    group: Any
    slots: int


@dataclass(frozen=True)
class ZeroPiece:
    """Attached as ``t.zero_piece`` to an optimizer tensor that is one rank's 1-D piece of a
    parameter under ZeRO-1 (`mp_toolkit.engine.zero`)."""

    shape: tuple[int, ...]
    """The whole tensor's shape (this rank's tensor-parallel shard)."""
    slot: int
    """Its index among the tensors split between ranks (`PartialSums.slots`); -1 when whole here."""
    first: bool
    """The piece holds the tensor's first element (the one rank that reports its trust ratio)."""
    partials: PartialSums


def whole_dim(p: torch.Tensor) -> int:
    """Dimensions of the tensor ``p`` is (a ZeRO-1 piece: of the parameter it is cut from)."""
    piece = getattr(p, "zero_piece", None)
    return len(piece.shape) if piece is not None else p.dim()


def sum_partial_squares(squares: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """ZeRO-1: the rows of ``squares`` (squared norms, one row per tensor of ``params``) of pieces
    whose tensor is split between ranks become the whole tensor's, in place, with ONE all-reduce of
    every split tensor's partial sums over the data-parallel group (zeros where a rank holds none).
    Tensors that are not pieces, or lie whole on this rank, keep their rows."""
    pieces = [getattr(p, "zero_piece", None) for p in params]
    partials = next((z.partials for z in pieces if z is not None), None)
    if partials is None or partials.slots == 0:
        return squares
    rows = [i for i, z in enumerate(pieces) if z is not None and z.slot >= 0]
    slots = torch.tensor([pieces[i].slot for i in rows], dtype=torch.long, device=squares.device)
    rows_t = torch.tensor(rows, dtype=torch.long, device=squares.device)
    table = torch.zeros(partials.slots, *squares.shape[1:], dtype=squares.dtype, device=squares.device)
    table.index_copy_(0, slots, squares.index_select(0, rows_t))
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=partials.group)
    return squares.index_copy_(0, rows_t, table.index_select(0, slots))


def whole_tensor_squares(squares: torch.Tensor, params: Sequence[torch.Tensor], tp_group) -> torch.Tensor:
    """Per-tensor squared norms of this rank's pieces and shards -> the whole tensors': ZeRO-1
    pieces summed over the data-parallel group, then tensor-parallel shards over ``tp_group``
    (sums of squares: the order of the two does not matter). One all-reduce each, per step."""
    squares = sum_partial_squares(squares, params)
    return allreduce_sharded_squares(squares, [is_tensor_parallel(p) for p in params], tp_group)


def is_tensor_parallel(p: torch.Tensor) -> bool:
    """True for a tensor-parallel shard (Megatron's ``tensor_model_parallel`` attribute)."""
    return bool(getattr(p, "tensor_model_parallel", False))


def allreduce_sharded_squares(squares: torch.Tensor, sharded: Sequence[bool], tp_group) -> torch.Tensor:
    """Sum the rows of ``squares`` (one row of squared norms per tensor) of sharded tensors over
    ``tp_group``, in place, with a single all-reduce; replicated rows stay local.

    Every rank of the group must list the same sharded tensors in the same order (as Megatron's
    tensor parallelism guarantees). A size-1 or absent group is a no-op (STYLE.md 9).
    """
    if tp_group is None or not any(sharded) or dist.get_world_size(tp_group) == 1:
        return squares
    rows = torch.tensor(sharded, dtype=torch.bool).nonzero().flatten().to(squares.device)
    whole = squares.index_select(0, rows)
    dist.all_reduce(whole, op=dist.ReduceOp.SUM, group=tp_group)
    return squares.index_copy_(0, rows, whole)


def check_hparam(owner: str, name: str, value, *, positive: bool = False) -> None:
    """Raise a ValueError naming ``owner``'s hyper-parameter unless it is a finite number >= 0 (> 0)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        need = "> 0" if positive else ">= 0"
        raise ValueError(f"{owner}: {name} must be a finite number {need}, got {value!r}")


def check_betas(owner: str, betas) -> None:
    """Raise a ValueError unless ``betas`` is a pair of numbers in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{owner}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not isinstance(b, numbers.Real) or isinstance(b, bool) or not 0.0 <= b < 1.0:
            raise ValueError(f"{owner}: betas[{i}] must be in [0, 1), got {b!r}")


def optional_hparam(owner: str, name: str, value, *, positive: bool = False) -> None:
    """`check_hparam` for a hyper-parameter that may be None (off)."""
    if value is not None:
        check_hparam(owner, name, value, positive=positive)



def evaluate_closure(closure):
    """The loss of an optimizer's optional closure, evaluated with gradients enabled (or None)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
