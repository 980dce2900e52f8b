"""What turns a plan's FLOPs, bytes and messages into seconds, and what one rank may hold (`Rates`):
from a device and cluster profile (`cluster.ClusterProfile`, ``--cluster``) or, without one, from
``mpt plan``'s flags (``--tflops``, ``--p2p-*``, ``--mem-gbps``, ``--memory-gb``) and a GEMM timed here.

A rank's memory on its device is the planner's tensor bytes (`memory.StageMemory`, fitted to and
checked against what this CPU's processes hold) put through the device's allocator model, plus
what the process holds beside them (the profile's ``runtime_gb``):

* ``cpu`` (glibc's heap): the tensor bytes as they are; the formulas are the ones the measured
  tests check (`tests/test_stage_memory.py`, BENCHMARKS.md).
* ``cuda`` (PyTorch's caching allocator): the tensor bytes times ``1 + CUDA_ALLOCATOR_OVERHEAD``,
  what the allocator reserves beyond what tensors occupy (blocks rounded to 2 MiB segments, freed
  blocks kept cached but split). **Unverified**: a stated assumption until a GPU run compares
  ``torch.cuda.max_memory_reserved`` with the plan (`tools/gpu_check.py`); the CUDA kernels'
  own workspaces (cuBLAS, flash attention) are not in the formulas either.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from mp_toolkit.optim.master import PRECISIONS

from .cluster import ClusterProfile, Link, Placement
from .request import PlanRequest
from .solvers import PartitionError

__all__ = ["CUDA_ALLOCATOR_OVERHEAD", "Rates", "gemm_tflops", "rates_of"]

CUDA_ALLOCATOR_OVERHEAD = 0.10
"""Reserved over allocated bytes of the caching allocator at a training step's peak: an assumption
(unverified on a GPU, see the module docstring)."""


def gemm_tflops(dtype: str, n: int = 512, k: int = 512, repeats: int = 5) -> float:
    """Measured TFLOP/s of an (n x k) @ (k x 4k) matrix product in ``dtype`` on this CPU."""
    dt = PRECISIONS[dtype]
    a, b = torch.randn(n, k, dtype=dt), torch.randn(k, 4 * k, dtype=dt)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2.0 * n * k * 4 * k / statistics.median(times) / 1e12


@dataclass(frozen=True)
class Rates:
    """A plan's rates and capacity."""

    tflops: float | None
    """A rank's matrix-product rate; None: the layers are timed (``--method time``, ``--measure``)."""
    peak_tflops: float | None
    """The device's peak for the precision, MFU's denominator; None: no profile (MFU not predicted)."""
    mem_gbps: float
    tp: Link
    """The tensor-parallel group's all-reduces."""
    dp: Link
    """The data-parallel gradient all-reduce (or ZeRO's reduce-scatter + all-gather)."""
    tie: Link
    """The tied embedding / LM head gradient between the first and last stage's ranks."""
    placement: Placement | None
    """Which link each pipeline hop crosses; None: every hop over ``tp``'s (the flags' one link)."""
    capacity: int | None
    """Bytes one rank may hold: ``--memory-gb``, else the profile's device (None: no cap)."""
    runtime: int
    """Bytes each process holds beside the model's tensors."""
    allocator: str
    profile: str
    """The line saying which profile the plan used."""
    layer_overhead_s: float = 0.0
    """A layer's fixed forward + backward time beside its FLOPs (the profile's ``layer_overhead_us``)."""
    comm_bytes: int = 0
    """What a communicating rank holds beyond its tensors (the profile's ``comm_gb``; 0 at one rank)."""
    heap_bytes: int = 0
    """What every training rank holds beyond its tensors (the profile's ``heap_gb``)."""
    contention: float = 1.0
    """A CPU node's ranks over its cores when they outnumber them (else 1): each rank is planned at a
    whole core while it computes, and the plan stretches its compute by the cores' mean demand
    (`planner.contended`)."""
    step_overhead_s: float = 0.0
    """What a step of several ranks adds beside its schedule and optimizer (the profile's
    ``step_overhead_us``; 0 at one rank)."""

    def hop(self, rank: int, nxt: int) -> Link:
        """The link a message between pipeline ranks ``rank`` and ``nxt`` crosses (two neighbouring stages'
        ranks, by the schedule's placement)."""
        return self.tp if self.placement is None else self.placement.hop_link(rank, nxt)

    @property
    def tensor_capacity(self) -> int | None:
        """The tensor bytes that fill `capacity` through the allocator model (the cut's cap)."""
        if self.capacity is None:
            return None
        factor = 1 + CUDA_ALLOCATOR_OVERHEAD if self.allocator == "cuda" else 1
        return max(0, int((self.capacity - self.runtime) / factor))

    def device_bytes(self, tensor_bytes: int) -> int:
        """What a rank holding ``tensor_bytes`` of tensors occupies on its device (module docstring)."""
        factor = 1 + CUDA_ALLOCATOR_OVERHEAD if self.allocator == "cuda" else 1
        return int(tensor_bytes * factor) + self.runtime


def rates_of(req: PlanRequest, timed: bool) -> Rates:
    """``req``'s rates: from ``req.cluster``, else from its flags (``timed``: layers are timed, no
    FLOP rate needed)."""
    cap = int(req.memory_gb * 1e9) if req.memory_gb is not None else None
    c: ClusterProfile | None = req.cluster
    if c is None:
        link = Link(req.p2p_gbps, req.p2p_latency_us, req.p2p_gbps, req.p2p_latency_us)
        tflops = None if timed else (req.tflops or gemm_tflops(req.precision))
        where = "layers timed here" if timed else (f"FLOPs at {tflops:.3g} TFLOP/s"
                                                   + (" (a GEMM timed here)" if req.tflops is None else ""))
        line = (f"profile: none ({where}; links {req.p2p_gbps:g} GB/s, {req.p2p_latency_us:g} us: "
                "--p2p-gbps, --p2p-latency-us; --cluster FILE describes a cluster)")
        return Rates(tflops, None, req.mem_gbps, link, link, link, None, cap, 0, "cpu", line)
    place = c.placement(req.tp, req.dp * req.cp, req.pp)  # cp ranks sit between tp and dp, as dp replicas do
    d = c.device
    if req.precision not in dict(d.tflops):
        raise PartitionError(f"--precision {req.precision}: the profile {c.name} has no {req.precision} rate "
                             f"(it has {', '.join(p for p, _ in d.tflops)}); add device.tflops.{req.precision}")
    per_node = place.ranks_per_node
    if d.kind == "cpu":  # the node's cores share one peak
        peak = d.peak(req.precision) * d.cores / max(1, per_node)
    else:
        peak = d.peak(req.precision)
    # ranks beyond a CPU node's cores: each computes at a whole core, the plan stretches its compute
    # by how many of them compute at once (`contention`); a rank's speed over one core's (its
    # threads): a layer's fixed cost shrinks with it as its FLOP time does
    contention = per_node / d.cores if d.kind == "cpu" and per_node > d.cores else 1.0
    speed = c.rank_tflops(req.precision, min(per_node, d.cores or per_node), req.threads) / d.rate(req.precision)
    tflops = None if timed else d.rate(req.precision) * speed
    span = req.tp * req.cp * req.dp * (req.pp - 1)  # the first stage's rank 0 to the last stage's
    tie = c.inter_node if span >= c.devices_per_node else c.intra_node
    return Rates(tflops, peak, d.mem_gbps, place.tp_link, place.dp_link, tie, place,
                 cap if cap is not None else c.rank_memory_bytes(per_node), int(d.runtime_gb * 1e9), d.kind,
                 c.describe(), layer_overhead_s=d.layer_overhead_us * 1e-6 / speed, contention=contention,
                 comm_bytes=int(d.comm_gb * 1e9) if req.pp * req.tp * req.cp * req.dp > 1 else 0,
                 heap_bytes=int(d.heap_gb * 1e9),
                 step_overhead_s=d.step_overhead_us * 1e-6 if req.pp * req.tp * req.cp * req.dp > 1 else 0.0)
