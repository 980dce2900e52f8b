"""Dynamic loss scaling for fp16 (DeepSpeed's ``fp16.*`` semantics), and the run's precision and
loss-scale settings (`Numerics`). Imports no torch (the overflow test is `mp_toolkit.optim.clip.has_inf_or_nan`):
``mpt --help`` reads `Numerics`' defaults and docstrings.

The state machine of DeepSpeed's ``DynamicLossScaler.update_scale`` (taken from Megatron's
``fp16/loss_scaler.py``), with DeepSpeed's config names::

    overflow:   if hysteresis == 1 or cur_hysteresis == 1: scale = max(scale / 2, min_loss_scale)
                else:                                       cur_hysteresis -= 1   (scale kept)
                last_overflow_iter = cur_iter
    clean step: if consecutive_hysteresis: cur_hysteresis = hysteresis
                if (cur_iter - last_overflow_iter) % loss_scale_window == 0:
                    scale *= 2; cur_hysteresis = hysteresis
    cur_iter += 1

``last_overflow_iter`` starts at -1, so the scale first doubles on the ``loss_scale_window``-th clean
step from the start, and again every ``loss_scale_window`` clean steps after the last overflow (an
overflow absorbed by hysteresis counts as an overflow here too). This is the original formula;
later DeepSpeed versions compute ``stable_interval = cur_iter - last_overflow_iter - 1`` and so grow
one step later (after ``loss_scale_window + 1`` clean steps). Unlike DeepSpeed, reaching
``min_loss_scale`` does not raise: the scale simply stays there. Unlike DeepSpeed's non-ZeRO
pipeline path, hysteresis is honoured (issue 4).

``static_scale`` > 0 (DeepSpeed's ``fp16.loss_scale``) is a fixed scale that never changes; None
or 0 means dynamic, as in DeepSpeed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


def _check_number(name: str, value, need: str, ok) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"DynamicLossScaler: {name} must be a finite number {need}, got {value!r}")


def _check_int(name: str, value, lowest: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise ValueError(f"DynamicLossScaler: {name} must be an integer >= {lowest}, got {value!r}")


@dataclass(frozen=True)
class Numerics:
    """The precision a run computes in and its fp16 loss scale: the precision and loss-scale section of
    a run's config (`mp_toolkit.run.config.TrainConfig` holds it as ``numerics``). The loss-scale fields
    (`LOSS_SCALE_FIELDS`) are DeepSpeed's ``fp16`` block, with its names and defaults."""

    precision: str = "fp32"
    """fp32, fp16 (fp32 masters, dynamic loss scaling), bf16 (fp32 masters, no scaling), or auto:
    bf16 where this device multiplies bf16 fast (CUDA, AMX / AVX512-BF16 CPUs), else fp32."""
    loss_scale: float = 0.0
    """fp16: a static loss scale when > 0 (DeepSpeed's fp16.loss_scale); 0 means dynamic."""
    initial_scale_power: int = 16
    """fp16 dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """fp16: clean steps before the scale doubles."""
    hysteresis: int = 2
    """fp16: overflows tolerated before the scale halves."""
    min_loss_scale: float = 1.0
    """fp16: the scale never drops below this."""
    consecutive_hysteresis: bool = False
    """fp16: refill the hysteresis on every clean step, not only when the scale grows."""

    def as_dict(self) -> dict:
        """The loss-scale settings by name (`LOSS_SCALE_FIELDS`): DeepSpeed's ``fp16`` keys."""
        return {name: getattr(self, name) for name in LOSS_SCALE_FIELDS}

    def scaler(self) -> "DynamicLossScaler":
        """The scaler these settings describe (static when loss_scale > 0)."""
        return DynamicLossScaler(
            initial_scale_power=self.initial_scale_power, loss_scale_window=self.loss_scale_window,
            hysteresis=self.hysteresis, min_loss_scale=self.min_loss_scale,
            consecutive_hysteresis=self.consecutive_hysteresis,
            static_scale=self.loss_scale if self.loss_scale > 0 else None)


LOSS_SCALE_FIELDS = tuple(f.name for f in dataclasses.fields(Numerics) if f.name != "precision")
"""`Numerics`' six loss-scale fields, in order: DeepSpeed's ``fp16`` keys (``--loss-scale``, ...)."""


class DynamicLossScaler:
    """The loss scale of fp16 training (see the module docstring for the exact state machine).

    Args:
        initial_scale_power: the scale starts at ``2 ** initial_scale_power``.
        loss_scale_window: clean steps before the scale doubles.
        hysteresis: overflows tolerated (scale kept) before the scale halves; refilled on growth.
        min_loss_scale: the scale never drops below this.
        consecutive_hysteresis: refill hysteresis on every clean step, not only on growth.
        static_scale: > 0 fixes the scale at this value forever (DeepSpeed's ``loss_scale``).
    """

    def __init__(self, initial_scale_power: int = 16, loss_scale_window: int = 1000, hysteresis: int = 2,
                 min_loss_scale: float = 1.0, consecutive_hysteresis: bool = False,
                 static_scale: float | None = None):
        _check_int("initial_scale_power", initial_scale_power, -126)
        _check_int("loss_scale_window", loss_scale_window, 1)
        _check_int("hysteresis", hysteresis, 1)
        _check_number("min_loss_scale", min_loss_scale, "> 0", lambda v: v > 0)
        if static_scale is not None:
            _check_number("static_scale", static_scale, ">= 0 (0 or None: dynamic)", lambda v: v >= 0)
        self.loss_scale_window, self.hysteresis = loss_scale_window, hysteresis
        self.min_loss_scale, self.consecutive_hysteresis = float(min_loss_scale), bool(consecutive_hysteresis)
        self.static = bool(static_scale)
        self.cur_scale = float(static_scale) if self.static else 2.0 ** initial_scale_power
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = hysteresis

    @property
    def scale(self) -> float:
        """The current loss scale: multiply the loss by it before backward."""
        return self.cur_scale

    @property
    def dynamic(self) -> bool:
        return not self.static

    def update(self, overflow: bool) -> None:
        """Advance one step; ``overflow`` is the agreed inf/nan flag of that step."""
        if self.static:
            self.cur_iter += 1
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis <= 1:
                self.cur_scale = max(self.cur_scale / 2.0, self.min_loss_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if (self.cur_iter - self.last_overflow_iter) % self.loss_scale_window == 0:
                self.cur_hysteresis = self.hysteresis
                self.cur_scale *= 2.0
        self.cur_iter += 1

    def state_dict(self) -> dict:
        """The counters and the scale (plain numbers; the configuration is the constructor's)."""
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter, "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s counters and scale (a static scaler keeps its fixed scale)."""
        missing = {"cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"} - set(state)
        if missing:
            raise ValueError(f"DynamicLossScaler.load_state_dict: missing keys {sorted(missing)}")
        if not self.static:
            self.cur_scale = float(state["cur_scale"])
        self.cur_iter, self.last_overflow_iter = int(state["cur_iter"]), int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])

    def __repr__(self) -> str:
        kind = ("static" if self.static
                else f"dynamic, window {self.loss_scale_window}, hysteresis {self.cur_hysteresis}")
        return f"DynamicLossScaler(scale={self.cur_scale:g}, {kind})"
