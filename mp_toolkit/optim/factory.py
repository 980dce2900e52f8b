"""Optimizers by name. Every one runs through the same master-weight, overflow and clipping path
(`mp_toolkit.engine.step`); LAMB and LARS are ours, the others torch's."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mp_toolkit.config import OPTIMIZERS
from mp_toolkit.optim.groups import lamb_param_groups
from mp_toolkit.optim.lamb import LAMB
from mp_toolkit.optim.lars import LARS


def build_optimizer(name: str, named_params: Sequence[tuple[str, torch.nn.Parameter]], lr: float,
                    weight_decay: float = 0.0, tp_group=None) -> torch.optim.Optimizer:
    """One optimizer over ``named_params`` (names as in the unsplit LayerList).

    LAMB and LARS exclude biases and norm weights from decay and layer adaptation
    (`lamb_param_groups`); torch's optimizers get one group, as a user would write them.
    ``tp_group`` (the tensor-parallel group, `ParallelContext.tp_group`) lets LAMB and LARS sum the
    squared norms of tensor-parallel shards into whole-tensor trust ratios; torch's optimizers are
    element-wise and need no group.
    """
    params = [p for _, p in named_params]
    if name == "lamb":
        return LAMB(lamb_param_groups(named_params, weight_decay), lr=lr, tp_group=tp_group)
    if name == "lars":
        return LARS(lamb_param_groups(named_params, weight_decay), lr=lr, tp_group=tp_group)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, foreach=True)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay, foreach=True)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, weight_decay=weight_decay, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay, foreach=True)
    raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
