"""A rank holds only its own part (DESIGN.md invariant 9): turn a meta-device layer list real,
parameter by parameter, for this rank's layers only.

The model is built on ``torch.device("meta")`` (shapes, no storage), cut into stages and split by
tensor parallelism while still on meta; then each rank draws the starting value of each of its
own parameters from the model's ``initial_value(name)`` (model_zoo/init.py: a generator per
parameter, seeded by its name, so every layout starts from the unsplit model's weights), keeps
its tensor-parallel shard of it, and drops the full value before drawing the next. At most one
parameter's full tensor exists at a time; every other layer's parameters stay on meta and cost
nothing. A tied parameter held twice on one rank (embedding and LM head on one stage) stays one
Parameter.

    with torch.device("meta"):
        model = GPT(config)
    layers = apply_tensor_parallel(LayerList.from_model(model), ctx, TP_PLAN)   # still meta
    materialize(layers, rank_layers(boundaries, stages_of_this_rank), model.initial_value, ctx)

A model whose values already lie somewhere (an HF directory's safetensors files) passes
``shard_value`` too: it returns this rank's share directly (a tensor-parallel shard read from the
file as slices), so not even one parameter's full tensor is built -- except a vocabulary padded
for tensor parallelism, whose share is cut from the full value padded with zero rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from mp_toolkit.layers import LayerList
from mp_toolkit.optim.groups import is_tensor_parallel
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.layouts import TP_ATTRIBUTES, shard_full


def is_meta(module: nn.Module) -> bool:
    """True when any parameter or buffer of ``module`` lives on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def rank_layers(boundaries: Sequence[int], stages: Iterable[int]) -> list[int]:
    """Indices of the layers that ``stages`` (this rank's stage numbers) hold, in order."""
    return sorted(i for s in stages for i in range(boundaries[s], boundaries[s + 1]))


ShardValue = Callable[[str, nn.Parameter, int, int], torch.Tensor]
"""(name, meta parameter, tp_rank, tp) -> what ``shard_full(initial_value(name), meta, tp_rank, tp)``
gives (the whole value for a replicated parameter), without building the full value."""


def materialize(layer_list: LayerList, keep: Iterable[int], initial_value: Callable[[str], torch.Tensor] | None,
                ctx: ParallelContext, device: torch.device | str = "cpu", shard_value: ShardValue | None = None
                ) -> int:
    """Give every meta parameter of the layers at indices ``keep`` real storage on ``device``,
    holding this rank's share of ``initial_value(name)`` (names as in the unsplit model:
    ``"{layer}.{path}"``), or ``shard_value(name, meta, ctx.tp_rank, ctx.tp)`` when given (then
    ``initial_value`` is not called). Returns the bytes allocated. Other layers are left on meta.
    ``initial_value=None`` and no ``shard_value``: storage only, its contents undefined -- for a
    run that resumes, whose every parameter is then read from the checkpoint (nothing is drawn or
    read twice).

    A meta buffer cannot be drawn (no model here registers one) and is refused by name, as is an
    initial value whose shape does not match the parameter's full (unsharded) shape.
    """
    done: dict[int, nn.Parameter] = {}
    allocated = 0
    for i in sorted(set(keep)):
        layer_name, layer = layer_list.names[i], layer_list.layers[i]
        for path, module in layer.named_modules():
            prefix = f"{layer_name}.{path}" if path else layer_name
            for bname, b in module.named_buffers(recurse=False):
                if b is not None and b.is_meta:
                    raise ValueError(f"{prefix}.{bname}: a meta buffer has no initial value to draw")
            for pname, p in list(module.named_parameters(recurse=False)):
                if not p.is_meta:
                    continue
                if id(p) not in done:
                    name = f"{prefix}.{pname}"
                    padded = getattr(p, "unpadded_size", None) is not None  # a padded vocabulary shard
                    if shard_value is not None and not padded:
                        value = shard_value(name, p, ctx.tp_rank, ctx.tp)
                    else:
                        value = None if initial_value is None else _share(p, initial_value(name), name, ctx)
                    done[id(p)] = _real(p, value, name, device)
                    allocated += done[id(p)].numel() * done[id(p)].element_size()
                setattr(module, pname, done[id(p)])
    return allocated


def _share(meta: nn.Parameter, full: torch.Tensor, name: str, ctx: ParallelContext) -> torch.Tensor:
    """This rank's shard of ``full`` (the whole of it when ``meta`` is replicated; a vocabulary
    padded for tensor parallelism is padded with zero rows first, as `shard_full` does)."""
    value = shard_full(full, meta, ctx.tp_rank, ctx.tp) if is_tensor_parallel(meta) else full
    if tuple(value.shape) != tuple(meta.shape):
        raise ValueError(f"{name}: initial value of shape {tuple(full.shape)} gives a {tuple(value.shape)} "
                         f"share, but the parameter is {tuple(meta.shape)}")
    return value


def _real(meta: nn.Parameter, value: torch.Tensor | None, name: str, device) -> nn.Parameter:
    """``meta``'s real counterpart on ``device``, holding ``value`` (its share) in ``meta``'s dtype
    (None: uninitialised storage)."""
    if value is not None and tuple(value.shape) != tuple(meta.shape):
        raise ValueError(f"{name}: a share of shape {tuple(value.shape)} was given, but the parameter is "
                         f"{tuple(meta.shape)}")
    real = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=device), requires_grad=meta.requires_grad)
    if value is not None:
        with torch.no_grad():
            real.copy_(value)  # the full value (and a strided shard's view of it) is dropped on return
    for attr in TP_ATTRIBUTES:  # the sharding layout optimizers, clipping and checkpoints read
        if hasattr(meta, attr):
            setattr(real, attr, getattr(meta, attr))
    return real


__all__ = ["ShardValue", "is_meta", "materialize", "rank_layers"]
