"""Learning-rate schedules: ``WarmupDecay`` (linear warm-up, then constant, linear or cosine decay to
``min_lr``) and DeepSpeed's ``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR``.

Each is a frozen dataclass whose ``__call__(step)`` gives the rate of 1-based optimizer step ``step``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mp_toolkit.names import LR_DECAYS as DECAYS  # `WarmupDecay`'s decays after warm-up (``--lr-decay``)


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


# DeepSpeed's schedules (deepspeed/runtime/lr_schedules.py: WarmupLR, WarmupDecayLR, WarmupCosineLR), as
# lr(step) for the same 1-based optimizer step that WarmupDecay takes.

WARMUP_TYPES = ("log", "linear")


def deepspeed_iteration(step: int) -> int:
    """DeepSpeed's ``last_batch_iteration`` while its engine runs optimizer step ``step`` (1-based).

    The engine builds the scheduler before the first step (the constructor sets the lr of iteration
    -1) and calls ``scheduler.step()`` after every *applied* optimizer step (not after one skipped
    for fp16 overflow), so step 1 runs at iteration -1, step 2 at iteration 0, step k at k - 2.
    To follow DeepSpeed across skipped steps, pass 1 + the number of applied steps so far.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step {step!r} must be an integer >= 1 (optimizer steps count from 1)")
    return step - 2


def _check_schedule(name: str, warmup_type: str, warmup_num_steps: int, **non_negative: float) -> None:
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"{name}: warmup_type {warmup_type!r} must be one of {', '.join(WARMUP_TYPES)}")
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps < 1:
        raise ValueError(f"{name}: warmup_num_steps {warmup_num_steps!r} must be a positive integer")
    for key, value in non_negative.items():
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{name}: {key} {value!r} must be a non-negative finite number")


def _warmup_fraction(iteration: int, warmup: int, warmup_type: str) -> float:
    """0 at iteration 0 rising towards 1 at ``warmup``: log(i + 1) / log(warmup) or i / warmup.
    Written in DeepSpeed's operation order (1 / log(w) first) so the values agree bit for bit."""
    if warmup_type == "log":
        return (1.0 / math.log(warmup)) * math.log(iteration + 1)
    return iteration / warmup


@dataclass(frozen=True, kw_only=True)
class WarmupLR:
    """DeepSpeed's WarmupLR: warm up from warmup_min_lr to warmup_max_lr, then stay at warmup_max_lr.

    ``lr(step)`` is the rate of 1-based optimizer step ``step`` under DeepSpeed's engine
    (`deepspeed_iteration`): at iteration i < 0 (step 1) it is warmup_min_lr, then
    ``warmup_min_lr + (warmup_max_lr - warmup_min_lr) * f(i)`` with f from `_warmup_fraction` while
    i < max(2, warmup_num_steps) (DeepSpeed raises a warm-up of 1 to 2), and warmup_max_lr afterwards.
    """

    warmup_max_lr: float
    """Rate at the end of warm-up (DeepSpeed's default is the optimizer's lr)."""
    warmup_min_lr: float = 0.0
    """Rate at the start of warm-up."""
    warmup_num_steps: int = 1000
    """Scheduler iterations of warm-up (at least 2 take effect)."""
    warmup_type: str = "log"
    """"log" (DeepSpeed's default) or "linear" growth during warm-up."""

    def __post_init__(self):
        _check_schedule(type(self).__name__, self.warmup_type, self.warmup_num_steps,
                        warmup_min_lr=self.warmup_min_lr, warmup_max_lr=self.warmup_max_lr)

    @property
    def peak_lr(self) -> float:
        return self.warmup_max_lr

    def _gamma(self, iteration: int) -> float:
        warmup = max(2, self.warmup_num_steps)
        if iteration < warmup:
            return _warmup_fraction(iteration, warmup, self.warmup_type)
        return 1.0

    def at_iteration(self, iteration: int) -> float:
        """The rate DeepSpeed's scheduler sets when its ``last_batch_iteration`` is ``iteration``."""
        if iteration < 0:
            return self.warmup_min_lr
        return self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * self._gamma(iteration)

    def __call__(self, step: int) -> float:
        return self.at_iteration(deepspeed_iteration(step))


@dataclass(frozen=True, kw_only=True)
class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR's warm-up, then linear decay down to warmup_min_lr (by default
    0) at ``total_num_steps``.

    After warm-up (iteration i >= w = max(2, warmup_num_steps)) the factor on
    (warmup_max_lr - warmup_min_lr) is ``max(0, (total_num_steps - i) / max(1, total_num_steps - w))``,
    so the rate reaches warmup_min_lr at i = total_num_steps (step total_num_steps + 2) and stays there.
    """

    warmup_max_lr: float = 0.001
    """Rate at the end of warm-up (DeepSpeed's WarmupDecayLR default is 0.001, not the optimizer's lr)."""
    total_num_steps: int
    """Scheduler iteration at which the decay ends."""

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.total_num_steps, bool) or not isinstance(self.total_num_steps, int) \
                or self.total_num_steps < 1:
            raise ValueError(f"WarmupDecayLR: total_num_steps {self.total_num_steps!r} must be a positive integer")

    def _gamma(self, iteration: int) -> float:
        warmup = max(2, self.warmup_num_steps)
        if iteration < warmup:
            return _warmup_fraction(iteration, warmup, self.warmup_type)
        return max(0.0, float(self.total_num_steps - iteration) / float(max(1.0, self.total_num_steps - warmup)))


@dataclass(frozen=True, kw_only=True)
class WarmupCosineLR:
    """DeepSpeed's WarmupCosineLR: ``lr * ratio(i)``, the ratio rising from warmup_min_ratio to 1 during
    warm-up, then following a half cosine from 1 down to cos_min_ratio at ``total_num_steps``.

    At iteration i < 0 (step 1, see `deepspeed_iteration`) DeepSpeed sets the rate to 0, not to
    ``lr * warmup_min_ratio``. During warm-up (i < w = max(2, warmup_num_steps)) the ratio is
    ``warmup_min_ratio + f(i) * (1 - warmup_min_ratio)``; after it, with progress
    ``p = min(1, (i - w + 1) / max(1, total_num_steps - w))``, it is
    ``max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi p)) / 2)``.
    """

    lr: float
    """The optimizer's learning rate, which the ratio scales (DeepSpeed reads it from the optimizer)."""
    total_num_steps: int
    """Scheduler iteration at which the cosine reaches cos_min_ratio."""
    warmup_min_ratio: float = 0.0
    """Ratio at the start of warm-up."""
    warmup_num_steps: int = 1000
    """Scheduler iterations of warm-up (at least 2 take effect)."""
    cos_min_ratio: float = 0.0001
    """Ratio at the end of the cosine."""
    warmup_type: str = "log"
    """"log" (DeepSpeed's default) or "linear" growth during warm-up."""

    def __post_init__(self):
        _check_schedule("WarmupCosineLR", self.warmup_type, self.warmup_num_steps, lr=self.lr,
                        warmup_min_ratio=self.warmup_min_ratio, cos_min_ratio=self.cos_min_ratio)
        if isinstance(self.total_num_steps, bool) or not isinstance(self.total_num_steps, int) \
                or self.total_num_steps < 1:
            raise ValueError(f"WarmupCosineLR: total_num_steps {self.total_num_steps!r} must be a positive integer")

    @property
    def peak_lr(self) -> float:
        return self.lr

    def ratio(self, iteration: int) -> float:
        """The factor on ``lr`` at DeepSpeed iteration ``iteration``."""
        if iteration < 0:
            return 0.0
        warmup = max(2, self.warmup_num_steps)
        if iteration < warmup:
            return self.warmup_min_ratio + _warmup_fraction(iteration, warmup, self.warmup_type) * (
                1.0 - self.warmup_min_ratio)
        progress = min(1.0, (iteration - warmup + 1) / max(1, self.total_num_steps - warmup))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ((1 + math.cos(math.pi * progress)) / 2))

    def at_iteration(self, iteration: int) -> float:
        """The rate DeepSpeed's scheduler sets when its ``last_batch_iteration`` is ``iteration``."""
        return self.lr * self.ratio(iteration)

    def __call__(self, step: int) -> float:
        return self.at_iteration(deepspeed_iteration(step))


DeepSpeedSchedule = WarmupLR | WarmupDecayLR | WarmupCosineLR
"""One of DeepSpeed's schedules (WarmupDecayLR is a WarmupLR)."""
