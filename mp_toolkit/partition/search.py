"""``mpt plan --search``: the whole layout of a run for a described cluster (issue 36).

Given N devices (`cluster.ClusterProfile`: nodes of G), a model, a global batch B and a sequence
length, the search enumerates every layout (`Layout`): pp x tp x cp x dp = N with tp dividing G (a tp
group stays in a node) and the model's heads and MLP, cp (context parallelism, ``context_parallel``)
where the family has it (GPT-2 and Llama, without attention dropout) and 2 cp divides the sequence
(tp x cp within a node), dp dividing B; micro-batch size x micro-batch
count = B / dp; every schedule (interleaved with 2 chunks per rank); recomputation none, selective
(where the family has it), full, or auto (per stage, chosen with the cut under the rank's memory, as
``--recompute auto``); ZeRO 0 and, with dp > 1, 1; with tp > 1, sequence parallelism wherever the
sequence splits over tp (``sequence_parallel``: the planner counts the same collective bytes and
latency steps with it -- a ring reduce-scatter and all-gather are an all-reduce's two halves -- and
fewer kept bytes and smaller messages, so the layout without it is never faster and never fits where
it does not: it is not planned). Each layout's prediction is `planner.make_plan`'s
for that request: the search adds no model of its own, so what it ranks is what ``mpt plan`` prints
for the pick.

How it prunes, exactly (nothing feasible that could be in the top k is dropped):

1. **Structure** (`enumerate_layouts`): a layout the run would refuse (tp not dividing the heads,
   more stages than layers, B not divisible by dp, interleaved micro-batches not a multiple of pp)
   is counted under its first reason and never planned.
2. **Static memory** (`search_floors.Floors.static_floor`): a rank's weights, gradients and optimizer state on the flops
   cut (`cost.bytes_per_param`), with the process's runtime, through the allocator model; a layout
   whose floor exceeds the capacity cannot fit whatever its schedule or recomputation, since these
   only add activations to that floor. (Recomputation ``auto`` re-cuts by memory: its floor is the
   leanest stage's, the total over pp.)
3. **Time bound** (`search_floors.Floors.time_floor`): a lower bound on the step time of any schedule of
   the layout: some rank must run all its stages' forwards and backwards of m micro-batches (FLOPs at the profile's
   rate, recomputation not counted), not before micro-batch 0 has passed the stages before its first.
   Layouts are planned in the order of their bound, and the search stops when the next bound is above
   the k-th best step time found: those left are slower than all k.

GPT-2-XL on 64 H100s with a global batch of 512 searches in a few seconds on one core
(BENCHMARKS.md, tests/test_search.py).
"""
from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from mp_toolkit.arch.architectures import ARCHITECTURES
from mp_toolkit.names import V_SCHEDULES, stages_per_rank

from .cluster import ClusterProfile
from .cost import CostModelError, layer_costs, model_shape
from .planner import GB, Plan, PlanRequest, make_plan
from .rates import rates_of
from .request import MAX_MICROBATCHES, too_large_global_batch
from .search_floors import Floors, splits_sequence
from .solvers import PartitionError

__all__ = ["Layout", "SearchRequest", "SearchResult", "enumerate_layouts", "search"]

SEARCH_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbdrain", "zbh1", "zbv", "dualpipev")
SEARCH_RECOMPUTE = ("none", "selective", "full", "auto")


@dataclass(frozen=True)
class SearchRequest:
    """What ``mpt plan --search`` is asked."""

    model: str
    devices: int
    global_batch: int
    """Sequences per optimizer step over all replicas."""
    seq_len: int
    cluster: ClusterProfile
    precision: str = "fp32"
    optimizer: str = "adamw"
    momentum: float | None = None
    weight_decay: float = 0.01
    hf: bool = False
    memory_gb: float | None = None
    """A cap per rank instead of the device's capacity (None: the device's)."""
    top: int = 5
    schedules: tuple[str, ...] = SEARCH_SCHEDULES
    recompute: tuple[str, ...] = SEARCH_RECOMPUTE
    zero: tuple[int, ...] = (0, 1)
    max_micro_batch: int | None = None
    """The largest micro-batch size tried; None: any divisor of B / dp."""
    sequence_parallel: bool = True
    """Lay tp > 1 out with sequence parallelism wherever seq_len splits over tp (module docstring)."""
    context_parallel: bool = True
    """Search cp > 1 too (module docstring)."""


@dataclass(frozen=True)
class Layout:
    """One point of the search space: the flags ``mpt train`` takes for it (`SearchResult.to_json`)."""

    pp: int
    tp: int
    dp: int
    micro_batch: int
    microbatches: int
    schedule: str
    chunks: int
    recompute: str
    zero: int
    sequence_parallel: bool = False
    cp: int = 1

    def request(self, req: SearchRequest) -> PlanRequest:
        """``mpt plan``'s request for this layout: the flops cut, or with recompute auto the memory cut."""
        auto = self.recompute == "auto"
        return PlanRequest(
            model=req.model, pp=self.pp, tp=self.tp, dp=self.dp, micro_batch=self.micro_batch,
            microbatches=self.microbatches, seq_len=req.seq_len, method="memory" if auto else "flops",
            memory_gb=req.memory_gb, precision=req.precision, optimizer=req.optimizer, momentum=req.momentum,
            weight_decay=req.weight_decay, schedule=self.schedule, chunks=self.chunks, load=False, hf=req.hf,
            recompute=self.recompute, zero=self.zero, cluster=req.cluster, sequence_parallel=self.sequence_parallel,
            cp=self.cp)

    def describe(self) -> str:
        sched = self.schedule + (f" x{self.chunks}" if self.chunks > 1 else "")
        return (f"pp {self.pp} tp {self.tp}{' +sp' if self.sequence_parallel else ''}"
                + (f" cp {self.cp}" if self.cp > 1 else "") + f" dp {self.dp}, "
                f"{self.microbatches} x {self.micro_batch}, {sched}, "
                f"recompute {self.recompute}" + (", ZeRO-1" if self.zero else ""))


@dataclass
class SearchResult:
    request: SearchRequest
    best: list[tuple[Layout, Plan]]
    """The top k feasible layouts, fastest first."""
    rejected: Counter
    """Layouts ruled out, per first reason."""
    considered: int
    planned: int
    """Layouts planned in full (`make_plan`)."""
    bounded: int
    """Layouts never planned: their step-time bound was above the k-th best."""
    seconds: float
    same_as_none: int = 0
    """Recompute auto layouts whose plan is recompute none's (the flops cut fits without recomputing)."""
    least_memory_gb: float | None = None
    """With nothing feasible: the smallest per-rank capacity at which some layout fits (a layout's need
    through the allocator model and runtime: the cap it would have to be planned under)."""
    notes: list[str] = field(default_factory=list)


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (trial division up to its square root)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def enumerate_layouts(req: SearchRequest, shape, layers: int):
    """Every layout of ``req``: yields ``(layout, None)`` for the structurally valid ones and
    ``(None, reason)`` for each one refused (counted per first reason)."""
    arch = ARCHITECTURES[shape.family]
    g = req.cluster.devices_per_node
    for tp in _divisors(req.devices):
        if tp > g:
            yield None, f"tp over the {g} devices of a node"
            continue
        if any(v % tp for v in (shape.heads, shape.kvh, shape.ffn)):
            yield None, "tp does not divide the heads or the MLP"
            continue
        for cp in _context_degrees(req, shape, tp):
            for pp in _divisors(req.devices // (tp * cp)):
                dp = req.devices // (tp * cp * pp)
                if pp > layers:
                    yield None, "more stages than layers"
                    continue
                if req.global_batch % dp:
                    yield None, "global batch not divisible by dp"
                    continue
                yield from _per_replica(req, arch, layers, pp, tp, dp, cp)


def _context_degrees(req: SearchRequest, shape, tp: int) -> list[int]:
    """The cp degrees a tp group of ``tp`` may take: 1, and with ``context_parallel`` every divisor of the
    devices left whose tp x cp fits a node and whose 2 cp (x tp under sequence parallelism) divides the
    sequence, for the models the ring is built for (model_zoo's GPT, HF's Llama family), without
    attention dropout."""
    ring = shape.family == "llama" or (shape.family == "gpt2" and not shape.hf_modules)  # HF GPT-2: not built
    if not req.context_parallel or not ring or shape.attn_dropout > 0:
        return [1]
    sp = splits_sequence(req, tp)
    return [cp for cp in _divisors(req.devices // tp) if cp == 1 or (
        tp * cp <= req.cluster.devices_per_node and req.seq_len % (2 * cp * (tp if sp else 1)) == 0)]


def _per_replica(req: SearchRequest, arch, layers: int, pp: int, tp: int, dp: int, cp: int = 1):
    per_replica = req.global_batch // dp
    sp = splits_sequence(req, tp)
    for mb in _divisors(per_replica):
        if req.max_micro_batch is not None and mb > req.max_micro_batch:
            continue
        m = per_replica // mb
        if m > MAX_MICROBATCHES:
            yield None, f"more than {MAX_MICROBATCHES} micro-batches"
            continue
        for schedule in req.schedules if pp > 1 else ("1f1b",):
            chunks = stages_per_rank(schedule)
            why = ("more stages than layers" if pp * chunks > layers
                   else "interleaved: micro-batches not a multiple of pp" if schedule == "interleaved" and m % pp
                   else "dualpipev: fewer micro-batches than 2 x pp" if schedule == "dualpipev" and m < 2 * pp
                   else None)
            if why is not None:
                yield None, why
                continue
            for rec in req.recompute:
                if rec == "selective" and not arch.selective:
                    continue
                for zero in req.zero if dp > 1 else (0,):
                    yield Layout(pp, tp, dp, mb, m, schedule, chunks, rec, zero, sp, cp), None


def search(req: SearchRequest) -> SearchResult:
    """The top ``req.top`` layouts by predicted step time among those that fit (module docstring)."""
    t0 = time.perf_counter()
    _check(req)
    shape = model_shape(req.model, hf_modules=req.hf)
    layers = len(layer_costs(shape, 1, 1))
    floors = Floors(req, shape)
    rejected: Counter = Counter()
    queue, over = [], []  # (bound, order, layout, request); (floor, layout, request) of those over the floor
    for lay, reason in enumerate_layouts(req, shape, layers):
        if lay is None:
            rejected[reason] += 1
            continue
        plan_req = lay.request(req)
        rates = rates_of(plan_req, timed=False)
        floor = floors.static_floor(lay, plan_req, rates)
        if floor > rates.capacity:
            rejected[FLOOR_REASON] += 1
            over.append((floor, len(over), plan_req))
            continue
        queue.append((floors.time_floor(lay, plan_req, rates), len(queue), lay, plan_req))
    if not queue and not over:
        _no_batch_split(req, rejected)
    considered = sum(rejected.values()) + len(queue)
    heapq.heapify(queue)
    best: list[tuple[float, int, Layout, Plan]] = []  # a min-heap of the k fastest, keyed by -time
    planned = same_as_none = 0
    least = None  # with nothing feasible: the least device bytes some layout needs
    while queue:
        bound, order, lay, plan_req = heapq.heappop(queue)
        if len(best) == req.top and bound >= -best[0][0]:
            queue.append((bound, order, lay, plan_req))
            break
        planned += 1
        got, needed = _evaluate(plan_req)
        if lay.recompute == "auto" and isinstance(got, Plan) and not any(c.mode != "none" for c in got.recompute) \
                and list(got.boundaries) == floors.cut(lay.tp, lay.micro_batch, lay.pp * lay.chunks, lay.cp,
                                                       lay.schedule in V_SCHEDULES):
            same_as_none += 1  # recompute none's layout and plan: ranked once, as none
            continue
        if isinstance(got, str):
            rejected[got] += 1
            least = needed if least is None or (needed is not None and needed < least) else least
            continue
        item = (-got.step_time_ms, -order, lay, got)
        if len(best) < req.top:
            heapq.heappush(best, item)
        elif item > best[0]:
            heapq.heapreplace(best, item)
    ranked = [(lay, plan) for _, _, lay, plan in sorted(best, key=lambda x: (-x[0], -x[1]))]
    result = SearchResult(req, ranked, rejected, considered, planned, len(queue), time.perf_counter() - t0,
                          same_as_none)
    if not ranked:
        result.least_memory_gb, extra = _least_memory(least, over)
        result.planned += extra
    return result


FLOOR_REASON = "memory: weights, gradients and optimizer state (and, recomputing, the layer inputs) alone exceed a rank"


UNCAPPED_GB = 1e12
"""A cap no rank reaches: the memory cut under it is the time-balanced cut."""


def _evaluate(plan_req: PlanRequest) -> tuple[Plan | str, int | None]:
    """(the plan, or why it is ruled out; the device bytes it needs where it does not fit, when known).

    Recompute auto minimises the slowest stage over every cut and recomputation that fits, so where the
    time-balanced cut without recomputation fits, that is its answer (recomputation only adds time, and
    both break ties alike): planned as that, it skips the per-stage recomputation's dynamic programme."""
    try:
        if plan_req.recompute == "auto":
            free = make_plan(replace(plan_req, recompute="none", memory_gb=UNCAPPED_GB))
            free = replace(free, request=plan_req, rates=rates_of(plan_req, timed=False))
            if free.fits:
                return free, None
        plan = make_plan(plan_req)
    except (PartitionError, CostModelError) as e:
        needed = getattr(e, "needed_gb", None)
        return _reason(e), None if needed is None else int(needed * GB)
    if plan.fits:
        return plan, None
    return "memory: activations and temporaries exceed a rank", max(plan.rank_bytes)


def _least_memory(least: int | None, over: list) -> tuple[float | None, int]:
    """With nothing feasible, the least per-rank device memory at which some layout fits (GB), and how many
    more layouts that took planning: those ruled out by their static floor are planned in the order of
    their floor while it is below the least need found (their need is at least their floor)."""
    extra = 0
    for floor, _, plan_req in sorted(over):
        if least is not None and floor >= least:
            break
        extra += 1
        _, needed = _evaluate(plan_req)
        if needed is not None and (least is None or needed < least):
            least = needed
    return (None if least is None else least / GB), extra


def _no_batch_split(req: SearchRequest, rejected: Counter) -> None:
    """Every layout refused by its structure, the global batch among the reasons: one line naming the
    nearest global batch some layout's dp divides."""
    if not rejected.get("global batch not divisible by dp"):
        return
    shape = model_shape(req.model, hf_modules=req.hf)
    dps = sorted({lay.dp for lay, _ in enumerate_layouts(replace(req, global_batch=req.devices), shape,
                                                           len(layer_costs(shape, 1, 1))) if lay is not None})
    if dps:
        nearest = min((-(-req.global_batch // d) * d for d in dps))
        raise PartitionError(f"--global-batch {req.global_batch}: no layout of {req.devices} devices has a dp that "
                             f"divides it (dp can be {', '.join(map(str, dps))}); use --global-batch {nearest}")


def _reason(e: Exception) -> str:
    text = str(e).splitlines()[0]
    if "too small" in text:
        return "memory: no cut fits a rank"
    return text.split(":")[0] if ":" in text else text


def _check(req: SearchRequest) -> None:
    """Requests no layout can answer, one line each."""
    for name in ("devices", "global_batch", "seq_len", "top"):
        v = getattr(req, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PartitionError(f"--{name.replace('_', '-')} {v!r} must be a positive integer")
    if too_large_global_batch(req.global_batch):
        raise PartitionError(too_large_global_batch(req.global_batch))
    c = req.cluster
    if req.devices > c.devices and req.devices % c.devices_per_node:
        nearest = req.devices // c.devices_per_node * c.devices_per_node
        raise PartitionError(f"--devices {req.devices} is not a whole number of the profile's nodes of "
                             f"{c.devices_per_node}: use {nearest} or {nearest + c.devices_per_node}")


def with_devices(cluster: ClusterProfile, devices: int) -> ClusterProfile:
    """``cluster`` with as many nodes as ``devices`` needs (a shipped profile describes one node)."""
    g = cluster.devices_per_node
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise PartitionError(f"--devices {devices!r} must be a positive integer")
    if devices > g and devices % g:
        nearest = devices // g * g
        raise PartitionError(f"--devices {devices} is not a whole number of the profile's nodes of {g}: use "
                             f"{nearest} or {nearest + g}")
    return replace(cluster, nodes=max(cluster.nodes, -(-devices // g)))
