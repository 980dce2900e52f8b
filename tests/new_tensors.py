"""`NewTensors`: the tensors torch makes while it is active, counted as they are made and freed, for
tests of what a step or a backward allocates beside what already exists (no allocator figures: the
counts are the same on any CPU and heap)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class NewTensors(TorchDispatchMode):
    """Every tensor an operation makes under it (an output sharing no input's storage: not an
    in-place result, not a view), its shape and dtype kept in ``made``, and the most bytes of them alive at once
    (``peak``), each counted until its tensor is freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                self.made.append((tuple(t.shape), t.dtype))
                weakref.finalize(t, self._freed, nbytes)
        return out


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []
