"""Optimizer state by parameter *name*, so it survives a change of (pp, tp, dp) layout.

``torch.optim.Optimizer.state_dict()`` keys state by the position of a parameter in its param
groups; positions differ between layouts (a rank holds other parameters, in other groups). Here
state is keyed by the unsplit model's parameter names instead, which works for any optimizer
whose per-parameter state is tensors plus JSON-able scalars: torch's Adam, AdamW, SGD, Adagrad,
RMSprop, and our LAMB (``exp_avg``, ``exp_avg_sq``, a ``step`` tensor) and LARS
(``momentum_buffer``).

Param-group hyper-parameters (lr, betas, weight decay ...) are not per-parameter:
`param_groups_by_name` gives them as JSON for the manifest, but loading never requires the new
optimizer to group its parameters the same way.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

import torch

from mp_toolkit.checkpoint.files import CheckpointError

Names = Mapping[torch.Tensor, str] | Iterable[tuple[str, torch.Tensor]]
"""``{param: name}``, or ``[(name, param), ...]`` as `PipelineEngine.named_parameters()` gives."""


def _by_id(names: Names) -> dict[int, str]:
    pairs = ([(n, p) for p, n in names.items()] if isinstance(names, Mapping) else list(names))
    out: dict[int, str] = {}
    taken: set[str] = set()
    for name, p in pairs:
        if name in taken:
            raise CheckpointError(f"two parameters are both named {name!r}")
        taken.add(name)
        out[id(p)] = name
    return out


def _name(p: torch.Tensor, by_id: dict[int, str]) -> str:
    if id(p) not in by_id:
        raise CheckpointError(f"an optimizer parameter of shape {tuple(p.shape)} has no name: "
                              "name every parameter the optimizer holds")
    return by_id[id(p)]


def _jsonable(value, where: str):
    """Plain JSON values; tuples become lists, 0-d tensors in hyper-parameters become numbers."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, where) for v in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _jsonable(v, where) for k, v in value.items()}
    raise CheckpointError(f"{where} is a {type(value).__name__}, which a checkpoint cannot store as JSON")


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, names: Names
                            ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, object]]]:
    """(tensors, scalars), each ``{param name: {state key: value}}``, of every parameter with state.

    Tensors are the optimizer's own (detached, not copied): write them before the next step.
    Parameters that have no state yet (never stepped) are absent.
    """
    by_id = _by_id(names)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, dict[str, object]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = _name(p, by_id)
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(key, str):
                    raise CheckpointError(f"optimizer state key {key!r} of {name} is not a string")
                if isinstance(value, torch.Tensor):
                    tensors.setdefault(name, {})[key] = value.detach()
                else:
                    scalars.setdefault(name, {})[key] = _jsonable(value, f"optimizer state {name}.{key}")
    return tensors, scalars


def _place(value: torch.Tensor, p: torch.Tensor, group: Mapping, key: str) -> torch.Tensor:
    """A saved state tensor where the optimizer expects it (always a fresh copy).

    torch's own rule (``Optimizer._process_value_according_to_param_policy``) for torch's
    optimizers, recognised by their ``capturable`` / ``fused`` group flags: ``step`` stays a CPU
    tensor of its saved dtype, except that capturable or fused groups keep it as float32 on the
    parameter's device; other tensors take the parameter's device and, for floating-point
    parameters, its dtype. Optimizers without those flags (LAMB, LARS) keep every state tensor,
    ``step`` included, on the parameter's device, as they create it.
    """
    if key == "step":
        if "capturable" in group or "fused" in group:
            if group.get("capturable") or group.get("fused"):
                return value.to(device=p.device, dtype=torch.float32, copy=True)
            return value.to(device="cpu", copy=True)
        return value.to(device=p.device, copy=True)
    if p.is_floating_point():
        return value.to(device=p.device, dtype=p.dtype, copy=True)
    return value.to(device=p.device, copy=True)


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, names: Names,
                                 tensors: Mapping[str, Mapping[str, torch.Tensor]],
                                 scalars: Mapping[str, Mapping[str, object]] | None = None,
                                 strict: bool = True) -> None:
    """Restore state saved by `optimizer_state_by_name` into an optimizer over the same *named*
    parameters, in any grouping and order.

    Only the names this optimizer holds are read; others in ``tensors`` (held by other ranks) are
    ignored. With ``strict`` every parameter of the optimizer must have saved state. Nothing is
    changed unless every parameter could be loaded.
    """
    by_id, scalars = _by_id(names), scalars or {}
    new_state: list[tuple[torch.Tensor, dict]] = []
    missing: list[str] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = _name(p, by_id)
            saved_t, saved_s = tensors.get(name, {}), scalars.get(name, {})
            if not saved_t and not saved_s:
                missing.append(name)
                continue
            if saved_t.keys() & saved_s.keys():
                raise CheckpointError(f"optimizer state of {name} has {sorted(saved_t.keys() & saved_s.keys())} "
                                      "both as tensors and as scalars")
            state = {k: _place(v, p, group, k) for k, v in saved_t.items()}
            state.update(copy.deepcopy(dict(saved_s)))
            new_state.append((p, state))
    if strict and missing:
        raise CheckpointError(f"no saved optimizer state for {len(missing)} parameter(s): "
                              f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''} "
                              "(saved before their first step? pass strict=False to start them fresh)")
    for p, state in new_state:
        optimizer.state[p] = state


def param_groups_by_name(optimizer: torch.optim.Optimizer, names: Names) -> list[dict]:
    """JSON-able param groups: each group's hyper-parameters and the names of its parameters."""
    by_id = _by_id(names)
    out = []
    for i, group in enumerate(optimizer.param_groups):
        hparams = {k: _jsonable(v, f"param group {i} {k!r}") for k, v in group.items() if k != "params"}
        out.append({"params": [_name(p, by_id) for p in group["params"]], **hparams})
    return out
