"""What `mpt plan` changes in the process while it times layers: the neighbour load
(`partition.contention`) and the heap that keeps freed pages (`memstats.DeviceMemory.keep_freed`)."""
import os
import subprocess
import sys
import time

import pytest

from mp_toolkit.partition.contention import concurrent_load, default_threads, helpers_for


def test_helpers_fill_the_cores_the_run_would_use():
    assert helpers_for(2, 1, cpus=2) == 1  # a 2-rank run, one thread each: one neighbour
    assert helpers_for(4, 1, cpus=2) == 1  # four ranks on two cores: only one computes beside
    assert helpers_for(4, 2, cpus=16) == 3
    assert helpers_for(1, 1, cpus=8) == 0  # one process: nobody beside it
    assert helpers_for(2, 2, cpus=2) == 0  # one rank already takes both cores
    assert default_threads(2, cpus=2) == 1
    assert default_threads(4, cpus=16) == 4
    assert default_threads(8, cpus=2) == 1


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


HANG_S = 120.0
"""Only a bound on a hang, never a measure of speed: a helper that computes gains CPU time at its
first time slice on any load; one that waits (blocked on its input) never does."""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_concurrent_load_computes_while_the_block_runs_and_stops_after():
    # Bounds what the helper does, not how fast: past "ready" it keeps consuming CPU (some, any
    # amount: no threshold that depends on the machine's load), it is alive for the whole block,
    # and when the block ends it has stopped on its cue (its input closed: exit 0, not killed) and
    # been reaped.
    with concurrent_load("gpt-tiny", 2, 16, "fp32", threads=1, count=1) as helpers:
        (helper,) = helpers
        before = _cpu_seconds(helper.pid)
        deadline = time.monotonic() + HANG_S
        while _cpu_seconds(helper.pid) == before and helper.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert helper.poll() is None
        assert _cpu_seconds(helper.pid) > before  # it is computing, not waiting
    assert helper.poll() is not None  # stopped and reaped when the block ends ...
    assert helper.returncode == 0, helper.stderr.read()  # ... on its cue, not killed


def test_a_helper_that_cannot_start_is_an_error_not_an_idle_machine():
    with pytest.raises(RuntimeError, match="a load helper for the layer timings did not start"):
        with concurrent_load("no-such-model", 2, 16, "fp32", threads=1, count=1):
            pass


KEEP = """
import ctypes, gc, sys, torch
from mp_toolkit.partition import memstats
memory = memstats.DeviceMemory.of("cpu")  # the adapter `mpt train` calls
kept = memory.keep_freed() if sys.argv[1] == "keep" else False
x = torch.ones(6 << 20)  # 24 MiB, touched
before = memory.in_use_bytes()
del x
gc.collect()
print(int(kept), (before - memory.in_use_bytes()) >> 20)
"""


def _freed_mib(mode: str, **env) -> tuple[int, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "MPT_KEEP_FREED_MEMORY"}
    out = subprocess.run([sys.executable, "-c", KEEP, mode], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    return int(out[0]), int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_keep_freed_memory_keeps_a_freed_block_resident_for_reuse():
    def check(got, kept, returned):
        assert got[0] == kept and (got[1] >= 22 if returned else got[1] <= 1), got

    check(_freed_mib("default"), 0, True)  # glibc maps a first 24 MiB block alone and unmaps it on free
    check(_freed_mib("keep"), 1, False)  # from the heap, and the heap is not trimmed
    # the user's own malloc tunables, or MPT_KEEP_FREED_MEMORY=0, leave glibc as it is
    check(_freed_mib("keep", MALLOC_MMAP_THRESHOLD_="65536"), 0, True)
    check(_freed_mib("keep", MPT_KEEP_FREED_MEMORY="0"), 0, True)
