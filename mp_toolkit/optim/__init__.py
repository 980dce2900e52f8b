"""Optimizer-side pieces of the step: global-norm clipping, LAMB, LARS, param groups, loss scaling."""

from mp_toolkit.optim.clip import clip_by_global_norm, global_grad_norm
from mp_toolkit.optim.groups import lamb_param_groups
from mp_toolkit.optim.lamb import LAMB
from mp_toolkit.optim.lars import LARS
from mp_toolkit.optim.loss_scaler import DynamicLossScaler, has_inf_or_nan

__all__ = ["clip_by_global_norm", "global_grad_norm", "LAMB", "LARS", "lamb_param_groups",
           "DynamicLossScaler", "has_inf_or_nan"]
