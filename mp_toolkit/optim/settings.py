"""The optimizer section of a run's config (`Optim`): which optimizer, its hyper-parameters, the
learning-rate schedule and gradient clipping. `mp_toolkit.run.config.TrainConfig` holds it as ``optim``;
`mp_toolkit.optim.factory.build_optimizer` builds from it.

Imports no torch: ``mpt --help`` reads the defaults and the field docstrings (`mp_toolkit.cli_args`)."""

from __future__ import annotations

from dataclasses import dataclass

from mp_toolkit.optim.lr import DeepSpeedSchedule

__all__ = ["Optim"]


@dataclass(frozen=True)
class Optim:
    """The optimizer, its hyper-parameters, the learning-rate schedule and clipping. The ones beyond lr
    and weight decay are DeepSpeed's ``optimizer.params``; None leaves each optimizer's own default."""

    optimizer: str = "adamw"
    """adamw, adam, adagrad, rmsprop, sgd, lamb or lars."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Weight decay (decoupled for AdamW, LAMB and LARS; L2 for torch's others)."""
    betas: tuple[float, float] | None = None
    """Adam, AdamW and LAMB moment decay rates (DeepSpeed's optimizer.params.betas); None: (0.9, 0.999)."""
    eps: float | None = None
    """Denominator epsilon of Adam, AdamW, LAMB, LARS, Adagrad, RMSprop; None: each optimizer's own
    default (1e-8, LAMB 1e-6, Adagrad 1e-10)."""
    min_trust: float | None = None
    """LAMB: lower clamp of the trust ratio (DeepSpeed's min_coeff); None: no clamp."""
    max_trust: float | None = None
    """LAMB: upper clamp of the trust ratio (DeepSpeed's max_coeff); None: no clamp."""
    bias_correction: bool = True
    """LAMB: bias-correct the moment estimates (Adam and AdamW always do)."""
    momentum: float | None = None
    """Momentum of SGD and LARS (None: 0.9) and RMSprop (None: 0)."""
    trust_coefficient: float | None = None
    """LARS: the trust coefficient eta of the layer-wise rate; None: 0.001."""
    lamb_rule: str = "mp_toolkit"
    """LAMB's per-tensor rule: mp_toolkit (biases and norm weights neither decayed nor adapted, corrected
    moments) or deepspeed (DeepSpeed's FusedLamb, what a DeepSpeed config's "type": "Lamb" means: every
    tensor's trust ratio clamped, 1-D ones included, the bias correction in the step size)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    lr_decay: str = "none"
    """After warm-up: none (constant), linear or cosine decay to min_lr at the last step."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_schedule: DeepSpeedSchedule | None = None
    """An exact DeepSpeed schedule (WarmupLR, WarmupDecayLR, WarmupCosineLR from a DeepSpeed config)
    that replaces lr / warmup_steps / lr_decay / min_lr; it advances only on applied steps (not on
    steps skipped for fp16 overflow), as DeepSpeed's engine does. None: WarmupDecay of those fields."""
    clip_grad: float | None = 1.0
    """Max global gradient norm over all stages; None disables clipping."""
