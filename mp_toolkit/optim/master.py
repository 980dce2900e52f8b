"""FP32 master weights for a stage whose module computes in fp16 or bf16.

The module keeps low-precision weights (half the bytes per activation and per weight); the
optimizer sees fp32 copies (`master`) with fp32 gradients and states. In fp32 the master *is*
the module's parameter: no copy, no extra memory, and bitwise the plain optimizer step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch

from mp_toolkit.names import PRECISIONS as PRECISION_NAMES

PRECISIONS: Mapping[str, torch.dtype] = MappingProxyType(
    dict(zip(PRECISION_NAMES, (torch.float32, torch.float16, torch.bfloat16), strict=True)))
"""The precision names (``--precision``, ``mpt plan --precision``, DeepSpeed's fp16 / bf16 blocks) and their dtypes:
the one table of them."""


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matrix products run on a fast path here: CUDA, or a CPU with AMX / AVX512-BF16.

    Elsewhere (e.g. CPUs without those instructions) bf16 is emulated and several times slower
    than fp32, so `resolve_precision("auto")` keeps fp32 there.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_precision(name: str, device: torch.device) -> str:
    """``auto`` -> bf16 where it is fast (`fast_bf16`), else fp32; other names pass through."""
    if name == "auto":
        return "bf16" if fast_bf16(device) else "fp32"
    return name


def precision_dtype(name: str) -> torch.dtype:
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}: choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


class MasterWeights:
    """Pairs each model parameter with its fp32 master and moves gradients / weights between them."""

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.model = list(params)
        self.separate = any(p.dtype != torch.float32 for p in self.model)
        if self.separate:
            self.master = [torch.nn.Parameter(p.detach().float().clone()) for p in self.model]
        else:
            self.master = self.model
        self._by_model = {id(p): m for p, m in zip(self.model, self.master)}

    def of(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        """The master of a model parameter."""
        return self._by_model[id(param)]

    def grads_to_master(self, inv_scale: float) -> None:
        """master.grad = fp32(model.grad) * inv_scale (1/loss scale); a missing grad becomes 0."""
        if not self.separate:
            grads = [p.grad for p in self.model if p.grad is not None]
            if inv_scale != 1.0 and grads:
                torch._foreach_mul_(grads, inv_scale)
            return
        for p, m in zip(self.model, self.master):
            g = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            m.grad = g.mul_(inv_scale) if inv_scale != 1.0 else g
            p.grad = None

    def copy_back(self) -> None:
        """model weights <- master weights (rounded to the model's dtype)."""
        if self.separate:
            with torch.no_grad():
                torch._foreach_copy_(self.model, self.master)

    def zero_grad(self) -> None:
        for p in self.model:
            p.grad = None
        if self.separate:
            for m in self.master:
                m.grad = None
