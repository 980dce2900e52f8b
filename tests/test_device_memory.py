"""`memstats.DeviceMemory`: one switch and one set of figures for keeping freed memory on CPU and CUDA.

The CPU figures are the process's resident set less its file pages (the libraries' code a step
pages in as its kernels first run is not the run's memory); the CUDA ones the caching allocator's tensor bytes
(run where a GPU is present; `tools/gpu_check.py` runs them on one). Freed-memory keeping on CPU
is checked in tests/test_contention.py through the same adapter.
"""
import mmap
import sys

import pytest
import torch

from mp_toolkit.partition.memstats import DeviceMemory, file_bytes, peak_rss_bytes, rss_bytes

MIB = 1 << 20


def _grows_and_resets(memory: DeviceMemory) -> tuple[int, int, int]:
    """(peak rise while 64 MiB live, in-use drop after freeing them, peak rise after a reset)."""
    memory.release()
    memory.reset_peak()
    start = memory.peak_bytes()
    x = torch.ones(16 * MIB, device=memory.device)  # 64 MiB, written
    rise = memory.peak_bytes() - start
    held = memory.in_use_bytes()
    del x
    memory.release()
    dropped = held - memory.in_use_bytes()
    memory.reset_peak()
    return rise, dropped, memory.peak_bytes() - memory.in_use_bytes()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc figures")
def test_cpu_figures_are_the_resident_set_less_its_file_pages(tmp_path):
    memory = DeviceMemory.of("cpu")
    assert not memory.is_cuda
    assert file_bytes() > 0  # libtorch's code, at least
    assert abs(memory.in_use_bytes() - (rss_bytes() - file_bytes())) < 8 * MIB
    assert memory.peak_bytes() >= memory.in_use_bytes()
    assert abs(memory.peak_bytes() - (peak_rss_bytes() - file_bytes())) < 8 * MIB
    # pages of a file read through a mapping are resident, as a library's code is once run: not counted
    path = tmp_path / "pages"
    path.write_bytes(b"\1" * (32 * MIB))
    before, rss_before = memory.in_use_bytes(), rss_bytes()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as pages:
        touched = sum(pages[i] for i in range(0, len(pages), 4096))
        assert touched == 32 * MIB // 4096 and rss_bytes() - rss_before >= 28 * MIB
        assert abs(memory.in_use_bytes() - before) < 4 * MIB
    rise, _, after_reset = _grows_and_resets(memory)
    assert rise >= 60 * MIB, rise  # the 64 MiB tensor shows in the peak
    assert after_reset < 8 * MIB, after_reset  # a reset restarts the peak at the present figure


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_figures_are_the_caching_allocators():
    memory = DeviceMemory.of("cuda")
    assert memory.is_cuda and memory.keep_freed()
    rise, dropped, after_reset = _grows_and_resets(memory)
    assert rise == 64 * MIB and dropped == 64 * MIB and after_reset == 0, (rise, dropped, after_reset)
    assert torch.cuda.memory_reserved() >= 64 * MIB  # the freed block stays cached for reuse
