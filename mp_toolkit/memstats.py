"""Process memory figures for the measured side of ``mpt plan`` (Linux ``/proc``; 0 elsewhere).

A CPU tensor's bytes are only visible to us as resident set size. To make RSS track live tensors,
`map_large_blocks` sets glibc's mmap threshold (as ``MALLOC_MMAP_THRESHOLD_`` would), so every
large block is mapped on its own and returned to the system when freed; `reset_peak` (``/proc/self/clear_refs``) restarts the
high-water mark once set-up garbage has been released.
"""
from __future__ import annotations

import ctypes
import gc
import os


def _status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_bytes() -> int:
    """Resident set size now."""
    return _status_kb("VmRSS")


def peak_rss_bytes() -> int:
    """Highest resident set size since the process started or since `reset_peak`."""
    return _status_kb("VmHWM")


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the system (glibc ``malloc_trim``)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def map_large_blocks(threshold: int = 65536) -> bool:
    """Make glibc mmap every block above ``threshold`` (and unmap it on free), as
    ``MALLOC_MMAP_THRESHOLD_`` does, so RSS follows the live tensors. False if unavailable."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def reset_peak() -> bool:
    """Restart the high-water mark at the current RSS; False where the kernel does not allow it."""
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def warm_runtime() -> None:
    """Pay torch's one-time costs (lazy imports on first optimizer, kernel set-up) before a
    baseline is taken, so what is measured after it is tensors rather than library code."""
    import torch
    import torch.nn.functional as F

    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = torch.optim.AdamW([w], foreach=True)
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    x = F.scaled_dot_product_attention(q, q, q, is_causal=True).reshape(4, 8)
    F.cross_entropy(F.layer_norm(F.gelu(x @ w), (8,)), torch.zeros(4, dtype=torch.long)).backward()
    opt.step()
    release_free_memory()
