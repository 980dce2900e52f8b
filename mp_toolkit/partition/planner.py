"""The planner behind ``mpt plan``: cut a model into stages and predict the pipeline.

`make_plan` composes, in this order:

1. per-layer costs (`cost.layer_costs`; measured on this machine for ``--method time`` or
   ``--measure``, `measure.measure_layers`);
2. per-layer times: measured, or FLOPs / throughput (``--tflops``, else a GEMM measured here);
   tensor parallelism adds its all-reduces to each block;
3. the cut (`cut`): uniform, parameters, flops, time, ``type:REGEX``, or memory (`memory.py`);
4. per-stage static + in-flight memory, with the in-flight count taken from the schedule the
   run would execute, and the running layer's workspace and accumulation temporary;
5. the simulated timeline (`schedule.simulate`) with a latency/bandwidth term per message,
   plus the optimizer step and the data-parallel gradient all-reduce: bubble, step time, tokens/s.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field, replace

from mp_toolkit.names import V_SCHEDULES
from mp_toolkit.parallel.vocab_parallel import padded_vocab_size
from mp_toolkit.schedule import SPLIT_SCHEDULES, get_schedule, placement, simulate
from mp_toolkit.schedule.simulator import prepare

from .build import measure_model
from .cost import (
    ACT_BYTES,
    OPTIMIZER_BYTES,
    LayerCost,
    ModelShape,
    bytes_per_param,
    layer_costs,
    model_shape,
    step_bytes_per_param,
)
from .memory import MemoryCapError, StageMemory, min_max_memory
from .rates import Rates, rates_of
from .recompute import apply_to_plan, choose_recompute
from .request import PLAN_METHODS, PlanRequest, check_request
from .solvers import PartitionError, explicit, uniform
from .vcut import balanced

SPLIT_OVERHEAD = 0.10
"""What a backward run as ``I`` then ``W`` costs beyond the backward it replaces, as a share of it,
charged to each ``W``: ``W`` re-reads operands that other work has since evicted from cache. Measured
on the issue-8 workload in the pipeline (stage 1's CPU time per step, ZB-H1 against 1F1B): 10-19% on
an AVX-512 Xeon, 10% on an AMD EPYC; 6.5% in one process. The timed split of ``--measure`` times a
layer's I and W back to back and does not see it."""
GB = 1e9


@dataclass(frozen=True)
class StagePlan:
    index: int
    first_layer: int
    last_layer: int
    params: int
    time_ms: float
    """Forward + backward of one micro-batch."""
    memory_bytes: int
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0


@dataclass
class Plan:
    request: PlanRequest
    layers: list[LayerCost]
    boundaries: list[int]
    stages: list[StagePlan]
    bubble_fraction: float
    step_time_ms: float
    tokens_per_s: float
    time_source: str
    warnings: list[str] = field(default_factory=list)
    timeline: object = None
    recompute: list = field(default_factory=list)
    """Per stage, its `mp_toolkit.recompute.StageRecompute` (empty: none anywhere)."""
    rates: Rates | None = None
    """The rates and capacity it was planned with (`rates.rates_of`)."""
    rank_bytes: list[int] = field(default_factory=list)
    """Per pipeline rank, what it occupies on its device: its stages' bytes through the device's
    allocator model, plus the process's runtime (`Rates.device_bytes`)."""
    mfu: float | None = None
    """Model FLOPs per second over the devices' peak (None without a profile)."""

    @property
    def fits(self) -> bool:
        """Every rank within the capacity (``--memory-gb``, else the profile's device; no cap: True)."""
        cap = self.rates.capacity if self.rates is not None else None
        return cap is None or max(self.rank_bytes) <= cap

    @property
    def max_stage_time_ms(self) -> float:
        return max(s.time_ms for s in self.stages)

    def to_json(self) -> dict:
        """Exactly the fields ``mpt plan --json`` writes (issue 3, item 5)."""
        r = self.request
        to_rank = (self.timeline.schedule.stage_to_rank if self.timeline is not None
                   else placement(r.schedule, r.pp, r.chunks))
        return {
            "pp": r.pp, "tp": r.tp, "dp": r.dp, "cp": r.cp, "sequence_parallel": r.sequence_parallel,
            "schedule": r.schedule,
            "method": r.method,
            "layers": [{"name": c.name, "params": c.params, "flops_fwd": c.flops_fwd,
                        "activation_bytes": c.activation_bytes} for c in self.layers],
            "stages": [{"index": s.index, "rank": to_rank[s.index], "first_layer": s.first_layer,
                        "last_layer": s.last_layer, "params": s.params, "time_ms": s.time_ms,
                        "memory_bytes": s.memory_bytes} for s in self.stages],
            "max_stage_time_ms": self.max_stage_time_ms, "bubble_fraction": self.bubble_fraction,
            "step_time_ms": self.step_time_ms, "tokens_per_s": self.tokens_per_s,
            "rank_memory_bytes": self.rank_bytes, "mfu": self.mfu,
            "profile": self.rates.profile if self.rates is not None else None,
            **({"recompute": [{"mode": c.mode, "layers": c.layers} for c in self.recompute]} if self.recompute else {}),
        }


@dataclass
class LayerTimes:
    """What `layer_times` finds for every layer."""

    times: list[tuple[float, float]]
    """(forward s, backward s) of one micro-batch."""
    opt_s: list[float]
    """The optimizer step's seconds, shared out by parameters."""
    step_bytes: list[int]
    """The optimizer step's temporaries, shared out by parameters."""
    residue: int
    """Bytes that computing leaves resident per process (measured only; else 0)."""
    costs: list[LayerCost]
    """The cost model's; measured kept and transient bytes replace the formula's when measured."""
    source: str
    """Where the times come from, in words."""
    split: list[tuple[float, float]] | None = None
    """Measured ZB-H1 (I s, W s) that make up each backward; None: not measured."""
    recorded: list[int] = field(default_factory=list)
    """Measured ZB-H1 bytes I records for W per micro-batch (`StageMemory.recorded`); [] when not."""
    tp: list[tuple[float, float]] = field(default_factory=list)
    """Per layer, the (forward, backward) seconds of its tensor-parallel all-reduces inside ``times``
    (`tp_seconds`); [] at tp 1."""


def layer_times(req: PlanRequest, shape: ModelShape, costs: list[LayerCost], rates: Rates) -> LayerTimes:
    """Per layer times, optimizer seconds and bytes: measured here (``--method time`` or
    ``--measure``; the split's I and W too for ``--schedule zbh1`` / ``zbdrain``) or from FLOPs."""
    split, recorded = None, []
    if req.method == "time" or req.measure:
        timings, opt_s, step_bytes, residue, how = measure_model(req, shape)
        times = [(t.forward_s, t.backward_s) for t in timings]
        if req.schedule in SPLIT_SCHEDULES:
            split = [(t.input_s, t.weight_s) for t in timings]
        costs = [replace(c, activation_bytes=t.activation_bytes, workspace_bytes=t.workspace_bytes)
                 for c, t in zip(costs, timings)]
        recorded = [t.recorded_bytes for t in timings]
        source = ("measured on this machine (per micro-batch inside rounds of accumulating micro-batches, "
                  f"median of 3 rounds after 1 warm-up; {how})")
    else:
        tflops, fixed = rates.tflops, rates.layer_overhead_s  # a layer's fixed cost: a third forward, as B = 2F
        times = [(c.flops_fwd / (tflops * 1e12) + fixed / 3, c.flops_bwd / (tflops * 1e12) + 2 * fixed / 3)
                 for c in costs]
        bpp_touched = bytes_per_param(req.precision, req.optimizer, momentum=req.momentum) + 8  # read + write
        opt_s = [c.params * bpp_touched / (rates.mem_gbps * GB) for c in costs]
        step_bpp = step_bytes_per_param(req.precision, req.optimizer, req.weight_decay)
        step_bytes = [c.params * step_bpp for c in costs]
        residue = 0
        source = f"FLOPs at {tflops:.3g} TFLOP/s" + (" (GEMM measured here)" if req.tflops is None and
                                                     req.cluster is None else "")
        source += f" + {fixed * 1e6:.0f} us per layer" if fixed else ""
    tp = tp_seconds(req, shape, costs, rates) if req.tp > 1 or req.cp > 1 else []
    if tp:
        times = [(f + tf, b + tb) for (f, b), (tf, tb) in zip(times, tp)]
    return LayerTimes(times, opt_s, step_bytes, residue, costs, source, split, recorded, tp)


def tp_seconds(req: PlanRequest, shape: ModelShape, costs: list[LayerCost], rates: Rates) -> list[tuple[float, float]]:
    """Per layer, the (forward, backward) seconds of its tensor- and context-parallel communication: a
    block's two all-reduces of its activations forward and two backward (Megatron's; under sequence
    parallelism a reduce-scatter and an all-gather each, a ring all-reduce's two halves: the same
    time); the vocab-parallel embedding's one of its output forward; the LM head's two of a value per
    token forward (the cross-entropy's max and its sums) and one of its input's gradient backward.
    With cp > 1 each rank's tokens are seq / cp, and a block's ring attention adds cp - 1 exchanges of
    its key and value slices forward and cp of them with their fp32 gradients backward (each timed as
    an all-reduce of its bytes between two ranks, over the tp link: cp ranks neighbour tp's); all-to-all
    attention (``cp_attention`` "ulysses") adds four all-to-alls of q, k, v and the output each way
    (each half a ring all-reduce of its bytes over the cp ranks)."""
    tokens = req.micro_batch * req.seq_len // req.cp
    d = ACT_BYTES[req.precision]
    act = rates.tp.allreduce_s(tokens * shape.hidden * d, req.tp)
    per_token = rates.tp.allreduce_s(tokens * 4, req.tp) + rates.tp.allreduce_s(2 * tokens * 4, req.tp)
    kv = 2 * tokens * shape.kvh * shape.hd // req.tp  # the local key and value elements of a block
    if req.cp > 1 and req.cp_attention == "ulysses":
        qkvo = 4 * tokens * shape.heads * shape.hd // req.tp
        ring_f = ring_b = rates.tp.allreduce_s(qkvo * d, req.cp) / 2
    else:
        ring_f = (req.cp - 1) * rates.tp.allreduce_s(kv * d, 2) if req.cp > 1 else 0.0
        ring_b = req.cp * rates.tp.allreduce_s(kv * (d + 4), 2) if req.cp > 1 else 0.0
    out = []
    for c in costs:
        if c.kind.endswith(("Block", "Layer")):
            out.append((2 * act + ring_f, 2 * act + ring_b))
        elif c.kind.endswith(("Embedding", "Embeddings")):
            out.append((act, 0.0))
        elif c.kind.endswith(("Head", "Heads")):
            out.append((per_token, act))
        else:
            out.append((0.0, 0.0))
    return out


def cut(req: PlanRequest, costs: list[LayerCost], times: list[tuple[float, float]],
        memory: StageMemory | None, num_stages: int) -> list[int]:
    """Boundaries by ``req.method`` (or ``req.boundaries`` when given). Under a V schedule the balancing
    methods balance ranks, each the sum of its two stages (`vcut.balanced`); else stages."""
    n = len(costs)
    if req.boundaries is not None:
        return explicit(list(req.boundaries), n, num_stages)
    m = req.method
    v = req.schedule in V_SCHEDULES
    if m == "uniform":
        return uniform(n, num_stages)
    if m == "parameters":
        return balanced([c.params for c in costs], num_stages, v)
    if m == "flops":
        return balanced([c.flops_fwd + c.flops_bwd for c in costs], num_stages, v)
    if m == "time":
        return balanced([f + b for f, b in times], num_stages, v)
    if m.startswith("type:"):
        try:
            regex = re.compile(m[5:], re.IGNORECASE)  # DeepSpeed matches class names case-insensitively
        except re.error as e:
            raise PartitionError(f"--method {m}: bad regular expression: {e}") from None
        weights = [1 if regex.search(c.kind) else 0 for c in costs]
        if not any(weights):
            kinds = sorted({c.kind for c in costs})
            raise PartitionError(f"--method {m} matches no layer class: the classes are {', '.join(kinds)}")
        return balanced(weights, num_stages, v)
    if m == "memory":
        if req.memory_gb is None:
            raise PartitionError("--method memory needs --memory-gb, the per-device cap")
        cap = int(req.memory_gb * GB / req.chunks)  # interleaved: each chunk gets its rank's share
        return min_max_memory([f + b for f, b in times], memory, num_stages, cap)
    raise PartitionError(f"unknown --method {m!r}: choose one of {', '.join(PLAN_METHODS)}")


def _inflight(req: PlanRequest):
    """The unit-cost schedule the run would execute, its per stage peak in-flight micro-batches (a
    split backward keeps a micro-batch's activations until its W), for a split schedule what each
    stage holds at its peaks (`StageMemory.held`; empty otherwise), and for ranks of several stages
    what they hold at once (`StageMemory.rank_held`)."""
    return _unit_schedule(req.schedule, req.pp, req.microbatches, req.chunks)[:4]


@functools.lru_cache(maxsize=128)
def _unit_schedule(name: str, pp: int, microbatches: int, chunks: int):
    """`_inflight`'s answer, kept: a layout search plans many requests that share a schedule."""
    schedule = get_schedule(name, pp, microbatches, chunks=chunks)
    ready = prepare(schedule)
    tl = simulate(schedule, prepared=ready)
    split = name in SPLIT_SCHEDULES
    inflight = tl.peak_inflight_w if split else tl.peak_inflight
    return schedule, tuple(inflight), tuple(tl.peak_held_w) if split else (), tuple(tl.rank_held), ready


def _split_backward_ms(stage: StagePlan, bounds: list[int],
                       split: list[tuple[float, float]] | None) -> dict[str, float]:
    """A split backward's I and W on one stage as the engine runs them (`engine.split_backward`).
    The first stage's inputs are token ids, so it does not split: I is empty and W the whole
    backward B. Elsewhere: the layers' measured I and W (``split``), or without a measurement half
    of B each (a matrix product's backward is one product for the input and one for the weight);
    W then carries the split's own cost, `SPLIT_OVERHEAD` of B."""
    if stage.index == 0:
        return {"I": 0.0, "W": stage.backward_ms}
    overhead = SPLIT_OVERHEAD * stage.backward_ms
    if split is None:
        return {"I": stage.backward_ms / 2, "W": stage.backward_ms / 2 + overhead}
    a, b = bounds[stage.index], bounds[stage.index + 1]
    return {"I": 1e3 * sum(i for i, _ in split[a:b]), "W": 1e3 * sum(w for _, w in split[a:b]) + overhead}


def make_plan(req: PlanRequest) -> Plan:
    """Plan ``req``; raises PartitionError / CostModelError / ValueError with one-line messages."""
    shape = model_shape(req.model, hf_modules=req.hf)
    check_request(req, shape, len(layer_costs(shape, 1, 1)), OPTIMIZER_BYTES)
    # the run pads the vocabulary to a multiple of 128 x tp (`vocab_parallel`): those rows are held too
    shape = replace(shape, vocab_size=padded_vocab_size(shape.vocab_size, req.tp))
    if req.hf and (req.method == "time" or req.measure):
        raise PartitionError("--hf plans from the cost model: measuring layers (--method time, --measure) builds "
                             "model_zoo's modules; drop --hf or the measurement")
    costs = layer_costs(shape, req.micro_batch, req.seq_len, req.precision, req.tp, req.sequence_parallel, req.cp)
    rates = rates_of(req, timed=req.method == "time" or req.measure)
    lt = layer_times(req, shape, costs, rates)
    times, opt_s, step_bytes = lt.times, lt.opt_s, lt.step_bytes
    residue, costs, source = lt.residue, lt.costs, lt.source
    schedule, inflight, held, rank_held = _inflight(req)
    num_stages = schedule.num_stages
    zero_dp = req.dp * req.cp if req.zero else 1  # ZeRO-1 partitions over every rank holding the parameters
    bpp = bytes_per_param(req.precision, req.optimizer, zero_dp=zero_dp, momentum=req.momentum)
    msg_in = max(c.output_bytes for c in costs[:-1]) if len(costs) > 1 else 0
    # one micro-batch per step: its gradients become .grad, nothing is accumulated beside them
    accumulated = [c.accumulated_bytes for c in costs] if req.microbatches > 1 else []
    memory = StageMemory(static=[c.params * bpp for c in costs], activation=[c.activation_bytes for c in costs],
                         inflight=inflight, workspace=[c.workspace_bytes for c in costs], accumulated=accumulated,
                         fixed=2 * msg_in + residue + rates.comm_bytes + rates.heap_bytes, step_transient=step_bytes,
                         recorded=lt.recorded, held=held, rank_held=rank_held)
    # with a profile the cap is the rank's device (or --memory-gb) less the runtime, through its allocator
    cut_req = req if req.cluster is None or rates.capacity is None else replace(
        req, memory_gb=rates.tensor_capacity / GB)
    try:
        bounds, choices = choose_recompute(cut_req, shape, costs, times, memory, num_stages, lambda: cut(
            cut_req, costs, times, memory, num_stages))
    except MemoryCapError as e:
        a, b = e.boundaries[e.stage], e.boundaries[e.stage + 1]
        need = rates.device_bytes(e.needed * req.chunks) / GB
        what = (f"--memory-gb {req.memory_gb:g}" if req.memory_gb is not None
                else f"the device's {rates.capacity / GB:.3g} GB")
        error = PartitionError(f"{what} is too small: even the leanest cut puts "
                               f"{need:.3g} GB on stage {e.stage} ({costs[a].name}..{costs[b - 1].name}); "
                               f"use --memory-gb {_round_up(need)} or more")
        error.needed_gb = need  # the least cap that fits, for programs (tools/bench_memory.py)
        raise error from None
    memory, times, split = apply_to_plan(req, shape, costs, times, memory, bounds, choices, lt.split)
    stages = []
    shares = memory_shares(memory, bounds, schedule.stage_to_rank)
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        fwd, bwd = sum(t[0] for t in times[a:b]), sum(t[1] for t in times[a:b])
        stages.append(StagePlan(s, a, b - 1, sum(c.params for c in costs[a:b]), 1e3 * (fwd + bwd),
                                shares[s], 1e3 * fwd, 1e3 * bwd, 1e3 * sum(opt_s[a:b])))
    stage_costs = {st.index: {"F": st.forward_ms, "B": st.backward_ms, **_split_backward_ms(st, bounds, split)}
                   for st in stages}
    out_bytes = [costs[b - 1].output_bytes for b in bounds[1:]]

    def message_bytes(action) -> float:  # F sends the stage's output, B the gradient of its input
        return out_bytes[action.stage] if action.kind.value == "SEND_F" else out_bytes[action.stage - 1]

    to_rank = schedule.stage_to_rank
    hops = [rates.hop(to_rank[s], to_rank[s + 1]) for s in range(num_stages - 1)]

    def transfer(action) -> tuple[float, float]:  # ms: the link between the two stages
        link = hops[min(action.stage, action.peer_stage)]
        return link.p2p_latency_us * 1e-3, message_bytes(action) / (link.p2p_gbps * GB / 1e3)

    prepared = _unit_schedule(req.schedule, req.pp, req.microbatches, req.chunks)[4]

    # the tensor-parallel all-reduces in each action's time: waits, not compute, when cores are shared
    tp_ms = [(0.0, 0.0)] * num_stages
    if lt.tp and rates.contention > 1:
        tp_ms = [(1e3 * sum(f for f, _ in lt.tp[a:b]), 1e3 * sum(b_ for _, b_ in lt.tp[a:b]))
                 for a, b in zip(bounds, bounds[1:])]

    def simulate_at(stretch: float):
        costs_at = {}
        for s, c in stage_costs.items():
            wait = {"F": tp_ms[s][0], "B": tp_ms[s][1], "I": tp_ms[s][1] if c.get("I") else 0.0,
                    "W": 0.0 if c.get("I") else tp_ms[s][1]}
            costs_at[s] = {k: wait[k] + max(0.0, v - wait[k]) * stretch for k, v in c.items()}
        return simulate(schedule, costs_at, transfer=transfer, prepared=prepared)

    timeline, stretch = contended(simulate_at, rates.contention)
    per_rank_opt = step_overhead_ms(req, rates, shape, [(st.params, st.optimizer_ms * rates.contention)
                                                        for st in stages], schedule.stage_to_rank)
    step_ms = timeline.step_time + max(per_rank_opt) + 1e3 * rates.step_overhead_s * rates.contention
    tokens = req.microbatches * req.micro_batch * req.seq_len * req.dp
    rank_bytes = [0] * req.pp
    for st in stages:
        rank_bytes[schedule.stage_to_rank[st.index]] += st.memory_bytes
    model_flops = sum(c.flops_fwd + c.flops_bwd for c in costs) * req.microbatches * req.tp * req.dp * req.cp
    mfu = (model_flops / (step_ms / 1e3) / (rates.peak_tflops * 1e12 * req.pp * req.tp * req.dp * req.cp)
           if rates.peak_tflops else None)
    plan = Plan(req, costs, bounds, stages, timeline.bubble_fraction, step_ms, tokens / (step_ms / 1e3),
                source, timeline=timeline, recompute=choices, rates=rates,
                rank_bytes=[rates.device_bytes(b) for b in rank_bytes], mfu=mfu)
    plan.warnings.extend(_memory_warnings(plan))
    return plan


def contended(simulate_at, contention: float, rounds: int = 4):
    """(the timeline, its compute stretch) of ranks that share cores (``contention``: ranks over cores,
    `Rates.contention`): ``simulate_at(stretch)`` simulates with every compute action ``stretch`` times
    its time at a whole core. A pipeline's ranks wait in its bubble and receives, and a waiting rank
    leaves its core to the others: the stretch is the cores' mean demand, ``contention`` times the
    share of the step its ranks compute (at least 1), iterated to its fixed point."""
    stretch, timeline = 1.0, simulate_at(1.0)
    for _ in range(rounds):
        if contention <= 1 or timeline.step_time <= 0:
            break
        demand = max(1.0, contention * sum(timeline.busy) / (timeline.num_ranks * timeline.step_time))
        if abs(demand - stretch) < 1e-3 * stretch:
            break
        stretch, timeline = demand, simulate_at(demand)
    return timeline, stretch


def step_overhead_ms(req: PlanRequest, rates: Rates, shape: ModelShape, stages: list[tuple[int, float]],
                     stage_to_rank) -> list[float]:
    """Per pipeline rank, what its step adds after the schedule's last action (ms): the optimizer over
    its stages (``stages``: per stage its parameters and optimizer ms), their data-parallel gradient
    all-reduce, and the tied embedding / LM head gradient summed over the two ranks holding it."""
    replicas = req.dp * req.cp  # the ranks holding the same parameters: gradients averaged over them
    zero_dp = replicas if req.zero else 1
    per_rank = [0.0] * req.pp
    for s, (params, optimizer_ms) in enumerate(stages):  # every rank steps its own stages
        # ZeRO-1: a reduce-scatter and an all-gather move an all-reduce's bytes; the step covers 1/dp
        per_rank[stage_to_rank[s]] += optimizer_ms / zero_dp + 1e3 * rates.dp.allreduce_s(params * 4, replicas)
    ends = {stage_to_rank[0], stage_to_rank[len(stages) - 1]}
    if shape.tied and len(ends) == 2:  # the tied embedding / LM head gradient, summed over its two ranks
        tie_ms = 1e3 * rates.tie.allreduce_s(shape.vocab_size * shape.hidden // req.tp * ACT_BYTES[req.precision], 2)
        for r in ends:
            per_rank[r] += tie_ms
    return per_rank


def memory_shares(memory: StageMemory, bounds: list[int], stage_to_rank) -> list[int]:
    """Per stage, what it adds to its rank's peak, so that a rank's stages sum to
    `StageMemory.of_rank` (one shared workspace and fixed part per process, not one per
    interleaved chunk); with one stage per rank, `StageMemory` of that stage."""
    out, held = [], {}
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        before = held.setdefault(stage_to_rank[s], [])
        out.append(memory.of_rank(before + [(s, a, b)]) - memory.of_rank(before))
        before.append((s, a, b))
    return out


def _memory_warnings(plan: Plan) -> list[str]:
    cap, out = plan.rates.capacity, []
    if cap is None:
        return out
    what = (f"the --memory-gb {plan.request.memory_gb:g} cap" if plan.request.memory_gb is not None
            else f"the device's {cap / GB:.3g} GB")
    to_rank = plan.timeline.schedule.stage_to_rank
    for rank, total in enumerate(plan.rank_bytes):
        if total > cap:
            names = ", ".join(str(s.index) for s in plan.stages if to_rank[s.index] == rank)
            out.append(f"warning: rank {rank} (stage {names}) needs {total / GB:.3g} GB, over {what}")
    return out


def _round_up(gb: float) -> str:
    """A cap a little above ``gb`` with two significant digits, never below it."""
    digits = 2 - int(math.floor(math.log10(gb))) - 1 if gb > 0 else 2
    step = 10.0 ** -digits
    return f"{math.ceil(gb / step - 1e-9) * step:.{max(digits, 0)}f}"
