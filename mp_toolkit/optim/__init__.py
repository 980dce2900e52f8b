"""Optimizer-side pieces of the step: global-norm clipping (LAMB/LARS and loss scaling grow here)."""

from mp_toolkit.optim.clip import clip_by_global_norm, global_grad_norm

__all__ = ["clip_by_global_norm", "global_grad_norm"]
