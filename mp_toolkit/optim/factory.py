"""Optimizers by name. Every one runs through the same master-weight, overflow and clipping path
(`mp_toolkit.engine.step`); LAMB and LARS are ours, the others torch's.

What to build is the run's optimizer section (`mp_toolkit.optim.settings.Optim`, ``TrainConfig.optim``): its
hyper-parameters beyond lr and weight decay (betas, eps, LAMB's trust clamp and bias correction, momentum,
LARS's trust coefficient) are DeepSpeed's ``optimizer.params``; None leaves each optimizer's own default,
so a run that sets none of them is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mp_toolkit.names import LAMB_RULES, OPTIMIZERS  # OPTIMIZERS: what `build_optimizer` makes (``--optimizer``)
from mp_toolkit.optim.groups import lamb_param_groups
from mp_toolkit.optim.lamb import LAMB
from mp_toolkit.optim.lars import LARS
from mp_toolkit.optim.settings import Optim

# Which optimizers read each option (the others would silently ignore it: refused instead).
_TAKES = {
    "betas": ("adamw", "adam", "lamb"),
    "eps": ("adamw", "adam", "lamb", "lars", "adagrad", "rmsprop"),
    "min_trust": ("lamb",),
    "max_trust": ("lamb",),
    "momentum": ("sgd", "lars", "rmsprop"),
    "trust_coefficient": ("lars",),
}


def check_optimizer_options(opts: Optim) -> None:
    """ValueError (one line naming the flag) for an option ``opts.optimizer`` does not read or a value out of range."""
    name = opts.optimizer
    for key, users in _TAKES.items():
        if getattr(opts, key) is not None and name not in users:
            raise ValueError(f"--{key.replace('_', '-')} is not an option of --optimizer {name}: "
                             f"it applies to {', '.join(users)}")
    if opts.lamb_rule not in LAMB_RULES:
        raise ValueError(f"--lamb-rule {opts.lamb_rule} is not a rule: use one of {', '.join(LAMB_RULES)}")
    if opts.lamb_rule != "mp_toolkit" and name != "lamb":
        raise ValueError(f"--lamb-rule {opts.lamb_rule} applies to --optimizer lamb only")
    if not opts.bias_correction and name != "lamb":
        raise ValueError(f"--no-bias-correction applies to --optimizer lamb only ({name} always corrects or has no "
                         "moments)")
    if opts.betas is not None and not (len(opts.betas) == 2 and all(0 <= b < 1 for b in opts.betas)):
        raise ValueError(f"--betas {' '.join(map(str, opts.betas))} must be two numbers in [0, 1), such as 0.9 0.999")
    for key in ("eps", "trust_coefficient"):
        value = getattr(opts, key)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"--{key.replace('_', '-')} {value} must be a positive finite number")
    for key in ("min_trust", "max_trust"):
        value = getattr(opts, key)
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"--{key.replace('_', '-')} {value} must be a non-negative finite number")
    if opts.min_trust is not None and opts.max_trust is not None and opts.min_trust > opts.max_trust:
        raise ValueError(f"--min-trust {opts.min_trust} exceeds --max-trust {opts.max_trust}: the trust clamp is empty")
    if opts.momentum is not None and not 0 <= opts.momentum < 1:
        raise ValueError(f"--momentum {opts.momentum} must be in [0, 1)")


def _given(**kwargs) -> dict:
    return {k: v for k, v in kwargs.items() if v is not None}


def _adam_kernel(params: Sequence[torch.Tensor]) -> dict:
    """torch's fused Adam / AdamW kernel where it applies (floating tensors on CPU or CUDA), else
    the multi-tensor one. Fused makes one sweep over each tensor's param, grad and moments where
    foreach runs one operation per term of the update (one CPU thread, a 5.3M-parameter stage:
    3 ms against 14 ms); it rounds differently (~1 ulp), so a reference that must match bitwise
    builds its optimizer here too."""
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return {"fused": True} if fused else {"foreach": True}


def build_optimizer(o: Optim, named_params: Sequence[tuple[str, torch.nn.Parameter]],
                    tp_group=None) -> torch.optim.Optimizer:
    """The optimizer ``o.optimizer`` with ``o``'s lr, weight decay and options over ``named_params`` (names
    as in the unsplit LayerList); the schedule and clipping fields are the step's (`mp_toolkit.engine.step`).

    LAMB and LARS exclude biases and norm weights from decay and layer adaptation
    (`lamb_param_groups`; LAMB's ``o.lamb_rule="deepspeed"`` adapts them too, FusedLamb's rule); torch's
    optimizers get one group, as a user would write them, and
    their multi-tensor kernels (Adam and AdamW the fused one, `_adam_kernel`).
    ``tp_group`` (the tensor-parallel group, `ParallelContext.tp_group`) lets LAMB and LARS sum the
    squared norms of tensor-parallel shards into whole-tensor trust ratios; torch's optimizers are
    element-wise and need no group. ``o`` is checked by `check_optimizer_options`.
    """
    check_optimizer_options(o)
    name, lr, weight_decay = o.optimizer, o.lr, o.weight_decay
    params = [p for _, p in named_params]
    if name == "lamb":  # rule deepspeed: FusedLamb adapts every tensor and corrects the step size
        fused = o.lamb_rule == "deepspeed"
        groups = [{**g, "correct_step_size": fused} for g in lamb_param_groups(named_params, weight_decay,
                                                                               adapt_all=fused)]
        return LAMB(groups, lr=lr, tp_group=tp_group, bias_correction=o.bias_correction,
                    **_given(betas=o.betas, eps=o.eps, min_trust=o.min_trust, max_trust=o.max_trust))
    if name == "lars":
        return LARS(lamb_param_groups(named_params, weight_decay), lr=lr, tp_group=tp_group,
                    **_given(momentum=o.momentum, eps=o.eps, trust_coefficient=o.trust_coefficient))
    if name in ("adamw", "adam"):
        kind = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return kind(params, lr=lr, weight_decay=weight_decay, **_adam_kernel(params),
                    **_given(betas=o.betas, eps=o.eps))
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay, foreach=True, **_given(eps=o.eps))
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, weight_decay=weight_decay, foreach=True,
                                   **_given(eps=o.eps, momentum=o.momentum))
    if name == "sgd":
        momentum = 0.9 if o.momentum is None else o.momentum
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=True)
    raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
