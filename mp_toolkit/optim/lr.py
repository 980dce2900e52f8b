"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay to ``min_lr``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mp_toolkit.config import LR_DECAYS as DECAYS


@dataclass(frozen=True)
class WarmupDecay:
    """lr(step) for step = 1..total_steps.

    Fields:
        lr: peak learning rate, reached at the end of warm-up.
        total_steps: steps of the whole run (the decay ends there).
        warmup_steps: linear warm-up from lr/warmup_steps to lr over these steps (0: none).
        decay: "none" (constant after warm-up), "linear" or "cosine" down to min_lr.
        min_lr: learning rate at the last step when decaying.
    """

    lr: float
    total_steps: int
    warmup_steps: int = 0
    decay: str = "none"
    min_lr: float = 0.0

    def __post_init__(self):
        if self.decay not in DECAYS:
            raise ValueError(f"unknown lr decay {self.decay!r}: choose one of {', '.join(DECAYS)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warm-up steps {self.warmup_steps} must be >= 0")
        if not (0 <= self.min_lr <= self.lr):
            raise ValueError(f"min lr {self.min_lr} must lie in [0, lr={self.lr}]")

    def __call__(self, step: int) -> float:
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.decay == "none":
            return self.lr
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.decay == "linear":
            return self.min_lr + (self.lr - self.min_lr) * (1.0 - progress)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
