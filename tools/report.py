"""What every tool prints first and last: the machine header (`header`: the CPU and its flags, torch,
DeepSpeed, the date and the load) and one JSON line (`json_line`) carrying that header, so that a
figure copied into BENCHMARKS.md or RELIABILITY.md keeps its machine and date.

    head = header("bench_optim")            # prints "bench_optim 2026-12-07 10:31 UTC: AMD EPYC ... "
    ...                                     # the tool's table
    json_line("bench_optim", head, rows=rows)   # prints {"tool": "bench_optim", "machine": {...}, "rows": ...}

Not imported by the library.
"""
from __future__ import annotations

import json
import os
import platform
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
"""The CPU flags that decide which kernels run (bf16 is emulated without avx512_bf16 / amx_bf16)."""


def _cpuinfo() -> tuple[str, list[str]]:
    """(the CPU's model name, which of `FLAGS` it has) from /proc/cpuinfo; Python's guess elsewhere."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine(), []
    field = lambda name: next((line.split(":", 1)[1].strip() for line in lines if line.startswith(name)), "")  # noqa: E731
    have = set(field("flags").split())
    return field("model name") or platform.machine(), [f for f in FLAGS if f in have]


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def machine() -> dict:
    """The machine a figure was taken on, and when: CPU model and flags, the kernels torch picks on
    it, the GPU if one is visible, library versions, the load average at the start."""
    cpu, flags = _cpuinfo()
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "flags": flags,
            "nproc": os.cpu_count(), "torch_cpu_kernels": torch.backends.cpu.get_cpu_capability(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__, "deepspeed": _version("deepspeed"), "python": platform.python_version(),
            "platform": platform.platform(), "load_avg": os.getloadavg()[0]}


def header(tool: str) -> dict:
    """Print the machine line every tool starts with; return it as a dict for `json_line`."""
    m = machine()
    gpu = f", GPU {m['gpu']}" if m["gpu"] else ", no GPU"
    print(f"{tool} {m['date']}: {m['cpu']} ({m['nproc']} CPUs; {' '.join(m['flags']) or 'no AVX2'}; torch kernels "
          f"{m['torch_cpu_kernels']}){gpu}; torch {m['torch']}, DeepSpeed {m['deepspeed'] or '-'}, "
          f"Python {m['python']}; load average {m['load_avg']:.2f}", flush=True)
    return m


def json_line(tool: str, head: dict, path: Path | None = None, **fields) -> str:
    """Print the one JSON line a tool ends with (``tool``, its `header`, its fields) and write it to
    ``path`` too when given; return it."""
    line = json.dumps({"tool": tool, "date": head["date"], "machine": head, **fields}, default=str)
    print(line, flush=True)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(line + "\n")
    return line
