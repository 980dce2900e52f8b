"""Embedding gradients accumulated by rows: no dense (V, C) temporary per micro-batch.

``nn.Embedding``'s backward (aten ``embedding_dense_backward``) returns a gradient the size of the
whole table, nonzero only in the rows of the micro-batch's tokens, and ``AccumulateGrad`` adds it
to ``.grad``. Over m micro-batches a step makes m - 1 such temporaries beside the accumulated
gradient: GPT-2's (50257, 1024) fp32 table is 196 MiB each, at the first stage's peak (issue 34
item 8: with gpt2-medium at pp 4 that rank held 1.45x its weight and gradient bytes).

`accumulate_by_rows(stage)` makes each plain ``nn.Embedding`` of a stage hand its weight gradient
on by rows instead (a forward hook puts `_RowGradient` after the lookup). Per step:

* the first micro-batch's gradient (``.grad`` is None) is the dense one, as before: it goes to
  ``AccumulateGrad``, which keeps it as ``.grad`` (hooks on the weight see it);
* every later one is the same kernel, ``embedding_dense_backward``, run on the table of the rows
  its tokens touch, then added to those rows of ``.grad`` in place. The ids are renumbered in
  sorted order, so each row sums its contributions in the same order as on the whole table (on
  CPU in the order of the ids; CUDA's kernel sorts the ids first, and the renumbering keeps that
  order). Finding the rows (``torch.unique``) waits for the device on CUDA, once per micro-batch.

Each element of ``.grad`` thus receives ``grad + contribution``, the one addition of
``AccumulateGrad``'s ``grad += new``; untouched rows receive nothing instead of ``+ 0.0`` (which
would turn a -0.0 into +0.0). Training stays bitwise that of the dense backward (DESIGN.md
invariant 1; `tests/test_embedding_rows.py`, `tests/test_oracle.py`). Held in exchange: the ids
of each micro-batch (already kept by the lookup) and, while a backward runs, one row per distinct
token.

Left dense: a weight the stage uses twice (a tie inside one stage: autograd sums both uses before
``AccumulateGrad``, an order rows added in place would not keep), a subclass of ``nn.Embedding``
(its forward may do more than the lookup), ``max_norm``, ``scale_grad_by_freq`` and ``sparse``
tables, and the vocabulary-parallel embedding of ``tp > 1``; while hooks on the weight's gradient
are registered (`has_hooks`: e.g. the non-finite gradient `mp_toolkit.run.skips` injects), every
micro-batch's gradient is the dense one, so the hooks see what they always saw.
"""

from __future__ import annotations

import torch
from torch import nn


def _dense(grad: torch.Tensor, ids: torch.Tensor, rows: int, padding_idx: int) -> torch.Tensor:
    """What ``nn.Embedding``'s backward computes: the (rows, C) gradient of a table of ``rows`` rows."""
    return torch.ops.aten.embedding_dense_backward(grad, ids, rows, padding_idx, False)


def add_rows(grad_weight: torch.Tensor, grad: torch.Tensor, ids: torch.Tensor, padding_idx: int) -> None:
    """``grad_weight += the dense gradient of (grad, ids)``, computed and added over the rows ``ids``
    touch only. ``grad``: (..., C), ``ids``: (...); ``padding_idx`` -1 for none."""
    flat = ids.reshape(-1)
    rows, inverse = torch.unique(flat, return_inverse=True)  # sorted: compact row i is table row rows[i]
    k = rows.numel()
    # padding tokens go to an extra row k, which the kernel skips as the padding row and which is dropped
    if padding_idx >= 0:
        inverse = inverse.masked_fill(flat == padding_idx, k)
    grad_weight.index_add_(0, rows, _dense(grad, inverse, k + 1, k)[:k])  # (k, C): one add per element


class _RowGradient(torch.autograd.Function):
    """Identity on a lookup's output ``out`` (computed by the module, detached), whose backward
    passes ``weight``'s gradient on as this module's docstring says; ids and weight get no gradient
    from autograd."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, ids: torch.Tensor, weight: nn.Parameter, padding_idx: int) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        if weight.grad is None or has_hooks(weight):  # the step's first: AccumulateGrad keeps it as .grad
            return None, None, _dense(grad, ids, weight.shape[0], ctx.padding_idx), None
        add_rows(weight.grad, grad, ids, ctx.padding_idx)
        return None, None, None, None


def has_hooks(weight: nn.Parameter) -> bool:
    """Whether hooks on ``weight``'s gradient are registered (``register_hook``,
    ``register_post_accumulate_grad_hook``): they take a dense gradient, and autograd would call
    them with None for a micro-batch whose rows were added in place."""
    return bool(getattr(weight, "_backward_hooks", None) or getattr(weight, "_post_accumulate_grad_hooks", None))


def _after_lookup(module: nn.Embedding, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    """Forward hook: the lookup's output, with `_RowGradient`'s backward in place of the dense one."""
    if not (args and torch.is_grad_enabled() and module.weight.requires_grad):
        return None
    padding_idx = -1 if module.padding_idx is None else module.padding_idx
    return _RowGradient.apply(out.detach(), args[0], module.weight, padding_idx)


def accumulates_by_rows(module: nn.Module, uses: int) -> bool:
    """Whether `accumulate_by_rows` handles ``module``, whose weight the stage holds ``uses`` times."""
    return (type(module) is nn.Embedding and uses == 1 and module.max_norm is None
            and not module.scale_grad_by_freq and not module.sparse)


def accumulate_by_rows(stage: nn.Module) -> list[str]:
    """Hook every embedding of ``stage`` that `accumulates_by_rows`; returns their names."""
    uses: dict[int, int] = {}
    for _, p in stage.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    hooked = []
    for name, module in stage.named_modules():
        if isinstance(module, nn.Embedding) and accumulates_by_rows(module, uses.get(id(module.weight), 0)):
            module.register_forward_hook(_after_lookup)
            hooked.append(name)
    return hooked


__all__ = ["accumulate_by_rows", "accumulates_by_rows", "add_rows", "has_hooks"]
