"""A measured profile's two run-pattern figures, fitted to short training runs of the model
(``mpt plan --profile-here OUT --calibrate``).

What `profile_here` times in isolation misses what a training step of several ranks pays as it
goes (the first certification runs, BENCHMARKS.md): the collectives that close every step (the
loss, the non-finite check, the gradient norm over all ranks), which each rank reaches when its
schedule ends, and the all-reduces inside tensor-parallel layers, which follow compute on every
rank and wait for the slowest and for waking the others' threads. Measured in isolation a small
all-reduce costs ~0.2 ms on a 2-core VM; in a tensor-parallel step ~2 ms. So:

1. ``step_overhead_us``: ``mpt train`` of the model at pp 2 (1F1B) with 2, 4 and 6 micro-batches,
   each step's median time less the plan's for the same cut (planned without the term): the mean
   of the three differences, at least 0.
2. ``collective_latency_us`` (both links: one host): the same at tp 2 with 2 micro-batches where the
   model's heads and widths divide, the latency that makes the plan equal the run, from the plan's
   change per microsecond of latency (the plan is linear in it); never below the isolated figure.
3. ``heap_gb``: a one-rank run of the model (2 micro-batches, `MEMORY_STEPS` steps, glibc mapping
   every block above 64 KiB on its own, `MEMORY_ENV`, so that its resident memory follows the live
   tensors): its peak above the baseline less the plan's tensor bytes for it, at least 0 -- the
   allocator's fragmentation and the kernels' own buffers, which a small model's plan misses by
   1-2 MB (BENCHMARKS.md, the certification's memory).

Each run trains synthetic data in fp32 with AdamW for `STEPS` steps (the first `WARMUP` not timed),
on the plan's cut, one thread per rank, its corpus prepared in a temporary folder. The runs are
five of the layouts a certification measures (`tools/certify_plan.py` says so beside its
figures). A model or device the runs cannot train on leaves the profile as measured in isolation
and the note says so.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from .cluster import ClusterProfile
from .planner import make_plan
from .request import PlanRequest

__all__ = ["MEMORY_ENV", "MEMORY_STEPS", "calibrate", "run_peak_bytes", "run_step_ms"]

STEPS, WARMUP = 12, 2
PIPELINE_MICROBATCHES = (2, 4, 6)
"""The pp 2 runs' micro-batch counts: the mean gap of three (one run's step time varies by ~10-20%
between processes on a 2-core VM)."""
RUN_TIMEOUT_S = 300.0
"""A bound on each calibration run."""
MEMORY_STEPS = 3
"""Steps of a memory run; its peak is over the steps after the first (``mpt train``'s ``peak_memory_bytes``)."""
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc maps every block above 64 KiB on its own and unmaps it when freed: a memory run's resident memory
follows its live tensors (it slows the kernels, so never in a timed run)."""


def _request(profile: ClusterProfile, model: str, micro_batch: int, seq_len: int, pp: int, tp: int,
             microbatches: int) -> PlanRequest:
    return PlanRequest(model, pp=pp, tp=tp, dp=1, micro_batch=micro_batch, microbatches=microbatches,
                       seq_len=seq_len, method="flops", schedule="1f1b", cluster=profile, precision="fp32",
                       optimizer="adamw", load=False)


def _train_rows(req: PlanRequest, boundaries: list[int], folder: Path, timeout_s: float, steps: int = STEPS,
                env: dict[str, str] | None = None) -> list[dict]:
    """The metrics rows of ``mpt train`` running ``req``'s layout on ``boundaries`` for ``steps`` steps
    (``env`` on top of this process's); raises RuntimeError with the run's last line when it fails."""
    metrics = folder / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "mp_toolkit.cli", "train", "--model", req.model, "--pp", str(req.pp),
           "--tp", str(req.tp), "--micro-batch", str(req.micro_batch), "--microbatches", str(req.microbatches),
           "--seq-len", str(req.seq_len), "--schedule", "1f1b", "--partition", ",".join(map(str, boundaries)),
           "--data", "synthetic", "--precision", "fp32", "--optimizer", "adamw", "--threads", "1",
           "--steps", str(steps), "--metrics", str(metrics), "--no-progress", "--cache-dir", str(folder / "cache")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **env} if env else None)
    if done.returncode != 0 or not metrics.exists():
        last = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[-1]
        raise RuntimeError(last)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def run_step_ms(req: PlanRequest, boundaries: list[int], folder: Path, timeout_s: float = RUN_TIMEOUT_S) -> float:
    """The median step time (ms) of ``mpt train`` running ``req``'s layout on ``boundaries`` (after
    `WARMUP` steps); raises RuntimeError with the run's last line when it fails."""
    rows = _train_rows(req, boundaries, folder, timeout_s)
    return 1e3 * statistics.median(r["step_time_s"] for r in rows[WARMUP:])


def run_peak_bytes(req: PlanRequest, boundaries: list[int], folder: Path,
                   timeout_s: float = RUN_TIMEOUT_S) -> list[int]:
    """Each rank's peak memory above its baseline (bytes) over the steps after the first of a memory
    run (`MEMORY_STEPS` steps under `MEMORY_ENV`) of ``req``'s layout on ``boundaries``."""
    rows = _train_rows(req, boundaries, folder, timeout_s, steps=MEMORY_STEPS, env=MEMORY_ENV)
    return [int(b) for b in rows[-1]["peak_memory_bytes"]]


def _heap_gb(base: ClusterProfile, model: str, micro_batch: int, seq_len: int, folder: Path) -> float:
    """What a one-rank run of ``model`` holds at its peak beyond the plan's tensor bytes (GB, at least 0)."""
    plan = make_plan(_request(base, model, micro_batch, seq_len, 1, 1, 2))
    planned = sum(st.memory_bytes for st in plan.stages)
    return max(0.0, (run_peak_bytes(plan.request, list(plan.boundaries), folder)[0] - planned) / 1e9)


def _with_latency(profile: ClusterProfile, latency_us: float) -> ClusterProfile:
    links = {k: replace(getattr(profile, k), collective_latency_us=latency_us) for k in ("intra_node", "inter_node")}
    return replace(profile, **links)


def calibrate(profile: ClusterProfile, model: str, micro_batch: int, seq_len: int) -> tuple[ClusterProfile, str]:
    """(``profile`` with ``step_overhead_us``, the collective latency and ``heap_gb`` fitted to runs of
    ``model`` (`run_step_ms`, `run_peak_bytes`), what was fitted in words, for the profile's note)."""
    device = replace(profile.device, step_overhead_us=0.0, heap_gb=0.0)
    base = replace(profile, device=device)
    with tempfile.TemporaryDirectory(prefix="mpt-calibrate-") as tmp:
        folder = Path(tmp)
        try:
            gaps = []
            for m in PIPELINE_MICROBATCHES:
                plan = make_plan(_request(base, model, micro_batch, seq_len, 2, 1, m))
                gaps.append(run_step_ms(plan.request, list(plan.boundaries), folder) - plan.step_time_ms)
            step_us = max(0.0, 1e3 * statistics.mean(gaps))
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            return profile, f"not calibrated (pp 2 runs of {model}: {e})"
        fitted = replace(base, device=replace(device, step_overhead_us=float(f"{step_us:.4g}")))
        said = [f"step_overhead_us: pp 2 runs of {model} (1F1B, 2, 4 and 6 micro-batches) less their plans"]
        isolated = profile.intra_node.collective_latency_us
        try:
            req = _request(fitted, model, micro_batch, seq_len, 1, 2, 2)
            plan = make_plan(req)
            measured = run_step_ms(plan.request, list(plan.boundaries), folder)
            more = make_plan(replace(req, cluster=_with_latency(fitted, isolated + 1000.0))).step_time_ms
            per_us = (more - plan.step_time_ms) / 1000.0  # the plan's ms per microsecond of latency
            latency = isolated + (measured - plan.step_time_ms) / per_us if per_us > 0 else isolated
            fitted = _with_latency(fitted, float(f"{max(isolated, latency):.4g}"))
            said.append(f"collective_latency_us: a tp 2 run of {model} (2 micro-batches) fitted by its plan "
                        f"(isolated {isolated:.4g})")
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            said.append(f"collective latency as isolated (tp 2 run of {model}: {e})")
        try:
            heap = _heap_gb(base, model, micro_batch, seq_len, folder)
            fitted = replace(fitted, device=replace(fitted.device, heap_gb=float(f"{heap:.4g}")))
            said.append(f"heap_gb: a one-rank memory run of {model} (2 micro-batches) less its plan's tensors")
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            said.append(f"heap_gb not described (memory run of {model}: {e})")
    return fitted, "; ".join(said)
