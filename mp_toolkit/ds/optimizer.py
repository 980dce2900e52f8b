"""DeepSpeed's ``optimizer`` and ``scheduler`` blocks, read into the optimizer mp_toolkit builds and
the learning-rate schedule it follows (`mp_toolkit.ds.config.read_ds_config` calls both; the
meanings and defaults are DeepSpeed's, see its module docstring)."""
from __future__ import annotations

from dataclasses import dataclass

from mp_toolkit.ds.defaults import DeepSpeedDefaults
from mp_toolkit.ds.json_doc import Block, show
from mp_toolkit.optim.lr import DeepSpeedSchedule, WarmupCosineLR, WarmupDecayLR, WarmupLR

OPTIMIZER_TYPES = ("Adam", "AdamW", "Lamb", "Lars")
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


@dataclass(frozen=True)
class OptimizerSettings:
    """DeepSpeed's ``optimizer`` block, resolved to the optimizer mp_toolkit builds for it."""

    type: str
    """``optimizer.type`` as the file spells it."""
    name: str
    """mp_toolkit's optimizer (TrainConfig.optim.optimizer): adam, adamw, lamb or lars."""
    lr: float
    """``params.lr`` (DeepSpeed's fused optimizers default to 1e-3)."""
    weight_decay: float
    """``params.weight_decay`` (default 0)."""
    eps: float
    """``params.eps`` (default 1e-8; note mp_toolkit's LAMB alone defaults to 1e-6)."""
    betas: tuple[float, float] | None = None
    """``params.betas`` for Adam, AdamW and Lamb (default (0.9, 0.999)); None for Lars."""
    min_trust: float | None = None
    """Lamb's ``min_coeff``: lower clamp of the trust ratio (default 0.01)."""
    max_trust: float | None = None
    """Lamb's ``max_coeff``: upper clamp of the trust ratio (default 10)."""
    bias_correction: bool = True
    """Lamb's ``bias_correction`` (Adam and AdamW always correct)."""
    momentum: float | None = None
    """Lars's ``momentum`` (default 0.9)."""
    trust_coefficient: float | None = None
    """Lars's ``trust_coefficient``, eta (default 0.001)."""


def _betas(params: Block, default: tuple[float, float] = (0.9, 0.999)) -> tuple[float, float]:
    v = params.get("betas", list(default))
    if not (isinstance(v, list) and len(v) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in v)):
        raise params.fail("betas", f"{show(v)} must be two numbers in [0, 1), such as [0.9, 0.999]")
    return float(v[0]), float(v[1])


def read_optimizer(root: Block, ignored: list[str], ds: DeepSpeedDefaults) -> OptimizerSettings | None:
    """The ``optimizer`` block (None when absent); absent ``params`` take DeepSpeed's defaults, Lamb's
    those of the installed FusedLamb (``ds``)."""
    block = root.block("optimizer")
    if block is None:
        return None
    supported = ", ".join(OPTIMIZER_TYPES)
    kind = block.string("type")
    name = kind.lower() if kind and kind.lower() in (t.lower() for t in OPTIMIZER_TYPES) else None
    if name is None:
        what = "is missing" if kind is None else f"{show(kind)} is not supported by mp_toolkit"
        raise block.fail("type", f"{what}: use one of {supported} (case-insensitive)")
    params = block.block("params") or Block(root.where, block.key("params"), {})
    block.finish(ignored, known=("legacy_fusion",))
    common = dict(lr=params.number("lr", 1e-3, positive=True), weight_decay=params.number("weight_decay", 0.0),
                  eps=params.number("eps", 1e-8))
    if "max_grad_norm" in params.data:
        raise params.fail("max_grad_norm", "is not supported (as in DeepSpeed): use gradient_clipping")
    params.only("amsgrad", False, "no mp_toolkit optimizer has the AMSGrad variant")
    if name in ("adam", "adamw"):
        params.only("bias_correction", True, "torch's Adam and AdamW always correct the moments")
        if params.boolean("adam_w_mode", True):
            name = "adamw"  # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false
        betas = _betas(params)
        params.finish(ignored, known=("torch_adam", "set_grad_none", "fp32_optimizer_states", "foreach"),
                      strict="lr, betas, eps, weight_decay, adam_w_mode, bias_correction")
        return OptimizerSettings(type=kind, name=name, betas=betas, **common)
    if name == "lamb":  # FusedLamb(params, **optimizer.params): its keyword defaults for absent keys
        params.only("eps_inside_sqrt", False, "mp_toolkit's LAMB adds eps outside the square root")
        fused = ds.lamb_default
        common = dict(lr=params.number("lr", fused("lr"), positive=True),
                      weight_decay=params.number("weight_decay", fused("weight_decay")),
                      eps=params.number("eps", fused("eps")))
        lo, hi = params.number("min_coeff", fused("min_coeff")), params.number("max_coeff", fused("max_coeff"))
        if lo > hi:
            raise params.fail("min_coeff", f"{lo} exceeds {params.key('max_coeff')} {hi}: the trust clamp is empty")
        bias, betas = params.boolean("bias_correction", fused("bias_correction")), _betas(params, fused("betas"))
        params.finish(ignored, strict="lr, betas, eps, weight_decay, bias_correction, max_coeff, min_coeff")
        return OptimizerSettings(type=kind, name=name, betas=betas, min_trust=lo, max_trust=hi,
                                 bias_correction=bias, **common)
    momentum = params.number("momentum", 0.9)
    if momentum >= 1:
        raise params.fail("momentum", f"{momentum} must be below 1")
    trust = params.number("trust_coefficient", 0.001, positive=True)
    params.finish(ignored, strict="lr, momentum, weight_decay, trust_coefficient, eps")
    return OptimizerSettings(type=kind, name=name, momentum=momentum, trust_coefficient=trust, **common)


def read_scheduler(root: Block, optimizer: OptimizerSettings | None, ignored: list[str]) -> DeepSpeedSchedule | None:
    """The ``scheduler`` block as the learning-rate schedule it describes (None when absent); WarmupLR
    and WarmupCosineLR take the optimizer's lr where their own is not set."""
    block = root.block("scheduler")
    if block is None:
        return None
    kind = block.string("type")
    if kind not in SCHEDULER_TYPES:
        what = "is missing" if kind is None else f"{show(kind)} is not supported by mp_toolkit"
        raise block.fail("type", f"{what}: use one of {', '.join(SCHEDULER_TYPES)} (case-sensitive, as in DeepSpeed)")
    p = block.block("params") or Block(root.where, block.key("params"), {})
    block.finish(ignored)

    warmup_type = p.string("warmup_type", "log")
    if warmup_type not in ("log", "linear"):
        raise p.fail("warmup_type", f"{show(warmup_type)} must be \"log\" or \"linear\"")
    warmup = dict(warmup_num_steps=p.integer("warmup_num_steps", 1000), warmup_type=warmup_type)
    lows = dict(warmup_min_lr=p.number("warmup_min_lr", 0.0)) if kind != "WarmupCosineLR" else {}
    if kind == "WarmupCosineLR":
        total = _required(p, "total_num_steps", kind)
        if optimizer is None:
            raise block.fail("type", f"{kind} scales the optimizer's lr, but the config has no optimizer block: "
                                     "add one with params.lr")
        schedule = WarmupCosineLR(lr=optimizer.lr, total_num_steps=total, warmup_min_ratio=p.number(
            "warmup_min_ratio", 0.0), cos_min_ratio=p.number("cos_min_ratio", 0.0001), **warmup)
        strict = "total_num_steps, warmup_min_ratio, warmup_num_steps, cos_min_ratio, warmup_type"
    elif kind == "WarmupDecayLR":
        schedule = WarmupDecayLR(total_num_steps=_required(p, "total_num_steps", kind),
                                 warmup_max_lr=p.number("warmup_max_lr", 0.001), **lows, **warmup)
        strict = "warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, total_num_steps"
    else:
        high = p.number("warmup_max_lr", None)
        if high is None and optimizer is None:
            raise p.fail("warmup_max_lr", "is not set and there is no optimizer block whose lr WarmupLR would "
                                          "default to: set it, or optimizer.params.lr")
        schedule = WarmupLR(warmup_max_lr=optimizer.lr if high is None else high, **lows, **warmup)
        strict = "warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type"
    p.finish(ignored, strict=strict)
    return schedule


def _required(p: Block, k: str, kind: str) -> int:
    if k not in p.data:
        raise p.fail(k, f"is required by {kind}: the scheduler iteration at which the decay ends")
    return p.integer(k, None)
