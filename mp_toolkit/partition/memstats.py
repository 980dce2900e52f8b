"""Process memory figures for the measured side of ``mpt plan`` (Linux ``/proc``; 0 elsewhere), and
`DeviceMemory`: how a training rank keeps freed memory and reads its peak, on CPU or CUDA alike.

A CPU tensor's bytes are only visible to us as resident set size. To make RSS track live tensors,
`map_large_blocks` sets glibc's mmap threshold (as ``MALLOC_MMAP_THRESHOLD_`` would), so every
large block is mapped on its own and returned to the system when freed; `reset_peak`
(``/proc/self/clear_refs``) restarts the high-water mark once set-up garbage has been released.
"""
from __future__ import annotations

import ctypes
import gc
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def file_bytes() -> int:
    """Resident pages that map files: the shared libraries' code, paged in as each kernel first runs
    (a GELU's first call adds ~2 MB of libtorch, gpt-tiny's first step ~7 MB), and never the tensors."""
    return _status_kb("RssFile")


def anon_bytes() -> int:
    """The resident set less its file pages: the heap, mapped blocks, stacks and shared memory --
    what tensors and the libraries' buffers occupy."""
    return rss_bytes() - file_bytes()


def peak_anon_bytes() -> int:
    """The highest `anon_bytes` since the process started or since `reset_peak`, as the kernel lets it
    be read: the RSS high-water mark less the file pages resident now. File pages only grow while a
    process runs (unless the system reclaims them under pressure), so this is never above the true
    peak, and equal to it when no library code was first paged in after the peak."""
    return peak_rss_bytes() - file_bytes()


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
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD back to glibc's default (keep_freed_memory raises it)
        return bool(libc.mallopt(-3, threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


KEEP_MMAP_THRESHOLD = 32 << 20
"""glibc's largest mmap threshold on 64-bit systems: blocks up to this size come from the heap."""
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_memory() -> bool:
    """Let glibc keep the heap pages a training step frees, for the next step to reuse.

    By default glibc maps a large block on its own once its size passes a threshold that adapts
    upward, and hands the top of the heap back to the system when more than twice that is free:
    a step's activations and logits (megabytes each, freed after every micro-batch's backward)
    keep coming back as fresh pages, and the kernel zero-fills every one of them on first touch.
    Keeping them made DeepSpeed's 2-rank GPT pipeline 9% and a single process 8% faster on the
    benchmark workload (BENCHMARKS.md, 2026-12-03, "heap kept" rows).
    Here blocks up to 32 MiB come from the heap and the heap is never trimmed on free: the
    process's resident size stays at its peak, as a GPU caching allocator's does, and the peak
    itself is unchanged. Nothing is changed when the environment already sets glibc's malloc
    tunables (``MALLOC_MMAP_THRESHOLD_`` etc., e.g. for memory measurement) or when
    ``MPT_KEEP_FREED_MEMORY=0``; False then, or where glibc is not the allocator."""
    if os.environ.get("MPT_KEEP_FREED_MEMORY", "1") == "0" or any(v in os.environ for v in MALLOC_ENV):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
        return bool(libc.mallopt(-3, KEEP_MMAP_THRESHOLD)) and bool(libc.mallopt(-1, 2**31 - 1))
    except (OSError, AttributeError):
        return False


@dataclass(frozen=True)
class DeviceMemory:
    """Where a rank's tensors live, how freed memory is kept for the next step, and its peak.

    One switch for both devices, ``MPT_KEEP_FREED_MEMORY`` (default on):

    * CPU: `keep_freed` is `keep_freed_memory` (glibc keeps freed heap pages); the figures are the
      process's resident set less its file pages (`anon_bytes`, `peak_anon_bytes`, `reset_peak`): the
      library code a step pages in as its kernels first run is not memory the run's tensors hold, and
      is what the planner cannot see (gpt-tiny's whole steady state measured 4.4x its tensors with it).
    * CUDA: torch's caching allocator already keeps freed blocks for reuse, so `keep_freed` changes
      nothing while the switch is on; with ``MPT_KEEP_FREED_MEMORY=0`` `release` hands the cached
      blocks back (``torch.cuda.empty_cache``). The figures are the tensors the allocator holds on
      this device (``torch.cuda.memory_allocated``, ``max_memory_allocated``,
      ``reset_peak_memory_stats``): the device's memory, not the host process's.
    """

    device: torch.device

    @classmethod
    def of(cls, device: torch.device | str) -> "DeviceMemory":
        return cls(torch.device(device))

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def keep_freed(self) -> bool:
        """Keep the memory a step frees for the next step; whether freed memory is now kept."""
        if self.is_cuda:
            return os.environ.get("MPT_KEEP_FREED_MEMORY", "1") != "0"  # the caching allocator's own behaviour
        return keep_freed_memory()

    def release(self) -> None:
        """Collect garbage and give freed memory back (CUDA: only when freed memory is not kept)."""
        release_free_memory()
        if self.is_cuda and not self.keep_freed():
            torch.cuda.empty_cache()

    def in_use_bytes(self) -> int:
        """Bytes held now: the resident set less its file pages on CPU, allocated tensor bytes on CUDA."""
        return torch.cuda.memory_allocated(self.device) if self.is_cuda else anon_bytes()

    def peak_bytes(self) -> int:
        """The highest `in_use_bytes` since the process started or since `reset_peak`."""
        return torch.cuda.max_memory_allocated(self.device) if self.is_cuda else peak_anon_bytes()

    def reset_peak(self) -> bool:
        """Restart the high-water mark at the present figure; False where the system does not allow it."""
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return True
        return reset_peak()


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
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = torch.optim.AdamW([w], foreach=True)
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    x = F.scaled_dot_product_attention(q, q, q, is_causal=True).reshape(4, 8)
    F.cross_entropy(F.layer_norm(F.gelu(x @ w), (8,)), torch.zeros(4, dtype=torch.long)).backward()
    opt.step()
    release_free_memory()
