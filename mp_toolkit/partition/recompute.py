"""Activation recomputation in the cost model, and the cut chosen jointly with it.

What recomputing a block changes, per micro-batch (`mp_toolkit.recompute` runs it):

* ``full``: the block keeps only its input (the previous layer's message, `LayerCost.output_bytes`)
  instead of its activations; its backward first runs its forward again, and while it does, the
  block's activations exist once more (counted as workspace: one block at a time);
* ``selective``: the block keeps everything but its attention core's tensors
  (`attention_core_bytes`: the log-sum-exp of a fused kernel, the a*s*s probabilities of an eager
  one); its backward runs the core's score matmuls again (`attention_core_flops`).

Under ZB-H1 the input pass I and the weight pass W are two backward calls, and each rebuilds the
saved tensors it needs: a recomputed block costs its recomputation twice on every stage but the
first (which does not split; `mp_toolkit.engine.split_backward`).

`min_max_recompute` chooses, for every stage of a cut, the mode and the number of its first block
layers to recompute, jointly with the cut: a stage's choice depends only on (stage, first layer,
last layer), and for a fixed segment the fastest choice that fits the cap is the best one (stage
time only grows with recomputation), so the DP of `memory.py` over (stages, layers) stays exact with
that best choice as the segment's cost. The objective is the slowest stage's forward + backward
(with recomputation), which bounds a pipeline's step time; ties go to the most balanced cut (leximax)
and then to the smallest boundaries.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from mp_toolkit.arch.architectures import ARCHITECTURES
from mp_toolkit.recompute import RecomputeError, StageRecompute, is_block, recomputed_layers, stage_choices
from mp_toolkit.schedule import split_share

from .cost import ACT_BYTES, LayerCost, ModelShape
from .memory import MemoryCapError, StageMemory
from .solvers import PartitionError, check_num_stages, exact_weights

__all__ = ["RecomputeCosts", "apply_to_plan", "attention_core_bytes", "attention_core_flops", "choose_recompute",
           "min_max_recompute", "recompute_costs", "stage_options"]


def attention_core_bytes(shape: ModelShape, micro_batch: int, seq_len: int, dtype_bytes: int, tp: int = 1) -> int:
    """Kept bytes selective recomputation drops from one block (of `arch.costs.attention_kept`'s, on CPU).

    Its q, k, v (and a mask) stay, as the recomputation's inputs, and so does the output the
    projection reads. Without attention dropout the fused kernel's only other tensor is its fp32
    log-sum-exp per head and token; with dropout the math kernel's three fp32 (heads, s, s) tensors
    go, and its fp32 copies of q, k, v where the activations are 2-byte (in fp32 they are q, k, v)."""
    b, s, a, hl = micro_batch, seq_len, shape.heads // tp, shape.hidden // tp
    if shape.attn_dropout > 0:
        return 3 * b * a * s * s * 4 + b * s * hl * 3 * (4 - dtype_bytes)
    return b * s * a * 4


def attention_core_flops(shape: ModelShape, micro_batch: int, seq_len: int, tp: int = 1) -> float:
    """Forward FLOPs of one block's attention core (Q K^T and P V; the causal ones count the lower
    triangle, as `arch.costs` does)."""
    b, s = micro_batch, seq_len
    width = shape.heads * shape.hd
    return (2.0 if ARCHITECTURES[shape.family].causal else 4.0) * b * s * s * width / tp


@dataclass(frozen=True)
class RecomputeCosts:
    """Per layer of the layer list: what each mode removes from its kept bytes and adds to its backward."""

    block: list[bool]
    full_saved: list[int]
    """Kept bytes a full recomputation removes: its activations less its input."""
    full_workspace: list[int]
    """Bytes its backward rebuilds for a moment (its activations)."""
    full_s: list[float]
    """Seconds its backward gains: its forward."""
    selective_saved: list[int]
    selective_s: list[float]
    """Seconds its backward gains: the attention core's forward."""


def recompute_costs(shape: ModelShape, costs: Sequence[LayerCost], times: Sequence[tuple[float, float]],
                    micro_batch: int, seq_len: int, dtype_bytes: int, tp: int = 1) -> RecomputeCosts:
    """`RecomputeCosts` of every layer from the cost model and the layers' (forward, backward) seconds."""
    block = [is_block(c.name) for c in costs]
    core_b = attention_core_bytes(shape, micro_batch, seq_len, dtype_bytes, tp)
    core_f = attention_core_flops(shape, micro_batch, seq_len, tp)
    full_saved, sel_saved, sel_s = [], [], []
    for i, c in enumerate(costs):
        kept_input = costs[i - 1].output_bytes if i > 0 else 0
        full_saved.append(max(0, c.activation_bytes - kept_input) if block[i] else 0)
        sel_saved.append(min(core_b, c.activation_bytes) if block[i] else 0)
        share = core_f / c.flops_fwd if block[i] and c.flops_fwd > 0 else 0.0
        sel_s.append(times[i][0] * min(1.0, share))
    return RecomputeCosts(block, full_saved, [c.activation_bytes if b else 0 for c, b in zip(costs, block)],
                          [t[0] if b else 0.0 for t, b in zip(times, block)], sel_saved, sel_s)


def stage_options(modes: Sequence[str]) -> Callable[[int, int], list[StageRecompute]]:
    """Every choice of a stage with ``blocks`` block layers: none, and each mode in ``modes`` for
    its first 1 .. blocks blocks."""
    def options(stage: int, blocks: int) -> list[StageRecompute]:
        return [StageRecompute()] + [StageRecompute(m, r) for m in modes if m != "none" for r in range(1, blocks + 1)]
    return options


class _Segments:
    """Bytes and time of stage ``j`` over layers [a, b) with a recomputation choice."""

    def __init__(self, times: Sequence[float], memory: StageMemory, rc: RecomputeCosts, split: Sequence[float]):
        n = len(times)
        self.memory, self.rc, self.split = memory, rc, split
        # One common integer scale for layer times and recomputation seconds: sums compare exactly.
        w = exact_weights(list(times) + list(rc.full_s) + list(rc.selective_s))
        self.time, self.full_t, self.sel_t = w[:n], w[n:2 * n], w[2 * n:]
        self._pt = _prefix(self.time)
        self._ps = _prefix(memory.step_transient or [0] * n)
        self.blocks = [i for i in range(n) if rc.block[i]]
        self.accumulated = list(memory.accumulated) or [0] * n

    def blocks_in(self, a: int, b: int) -> list[int]:
        return [i for i in self.blocks if a <= i < b]

    def evaluate(self, j: int, a: int, b: int, choice: StageRecompute) -> tuple[int, int]:
        """(bytes, integer time) of stage ``j`` holding [a, b) with ``choice``."""
        chosen = self.blocks_in(a, b)[:choice.layers] if choice.mode != "none" else []
        full = choice.mode == "full"
        saved = sum((self.rc.full_saved if full else self.rc.selective_saved)[i] for i in chosen)
        extra = sum((self.full_t if full else self.sel_t)[i] for i in chosen)
        times_run = 1 + (self.split[j] if j < len(self.split) else 0)  # a split backward's I and W each rebuild
        m = self.memory
        ws = m.transient(a, b)
        peak = m.kept(j, a, b) + ws
        step = self._ps[b] - self._ps[a]
        # a fully recomputed block's backward rebuilds its activations beside its accumulation temporary
        rebuilt = [self.rc.full_workspace[i] + self.accumulated[i] for i in chosen] if full else []
        new_peak = m.kept(j, a, b, saved) + max([ws] + rebuilt)
        nbytes = m(j, a, b) - max(peak, step) + max(new_peak, step)
        return nbytes, self._pt[b] - self._pt[a] + round(times_run * extra)

    def least_bytes(self, j: int, a: int, b: int, options) -> int:
        """The bytes of the leanest allowed choice of stage ``j`` over [a, b)."""
        return min(self.evaluate(j, a, b, c)[0] for c in options(j, len(self.blocks_in(a, b))))

    def best(self, j: int, a: int, b: int, cap: int, options) -> tuple[int, StageRecompute] | None:
        """The fastest choice that fits ``cap`` (ties: the earlier option); None when none fits."""
        found = None
        for choice in options(j, len(self.blocks_in(a, b))):
            nbytes, t = self.evaluate(j, a, b, choice)
            if nbytes <= cap and (found is None or t < found[0]):
                found = (t, choice)
        return found


def _smallest_cap(seg: _Segments, n: int, p: int, options) -> tuple[int, list[int]]:
    """The least cap some cut fits with some allowed choice per stage: min over cuts of the largest
    stage's least bytes over its choices (a stage fits a cap when its leanest choice does)."""
    inf = float("inf")
    best, back = [0] + [inf] * n, [[0] * (n + 1) for _ in range(p + 1)]
    for j in range(p):
        new = [inf] * (n + 1)
        for i in range(j + 1, n - (p - j - 1) + 1):
            for k in range(j, i):
                v = max(best[k], seg.least_bytes(j, k, i, options))
                if v < new[i]:
                    new[i], back[j + 1][i] = v, k
        best = new
    bounds, i = [n], n
    for j in range(p, 0, -1):
        i = back[j][i]
        bounds.append(i)
    return int(best[n]), bounds[::-1]


def _prefix(xs: Sequence[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + int(x))
    return out


def min_max_recompute(times: Sequence[float], memory: StageMemory, rc: RecomputeCosts, num_stages: int, cap: int,
                      options: Callable[[int, int], list[StageRecompute]], split: Sequence[float] = ()
                      ) -> tuple[list[int], list[StageRecompute]]:
    """The cut and per-stage recomputation whose slowest stage (forward + backward + recomputation)
    is fastest with every stage <= ``cap`` bytes; ``options(stage, blocks)`` lists the choices a
    stage may take; ``split[j]``: the share of stage ``j``'s backwards run as I then W, each of which
    rebuilds what it needs (`mp_toolkit.schedule.split_share`; none when absent). Raises
    `MemoryCapError` when no cut and choice fit."""
    n = len(times)
    check_num_stages(n, num_stages)
    seg = _Segments(times, memory, rc, split)
    cache: dict[tuple[int, int, int], tuple[int, StageRecompute] | None] = {}

    def cost(j: int, a: int, b: int):
        if (j, a, b) not in cache:
            cache[(j, a, b)] = seg.best(j, a, b, cap, options)
        return cache[(j, a, b)]

    # best[i]: (sorted-descending stage times, boundaries, choices) of the leximax-best prefix cut
    best: list[tuple | None] = [None] * (n + 1)
    best[0] = ((), (0,), ())
    for j in range(num_stages):
        new: list[tuple | None] = [None] * (n + 1)
        for i in range(j + 1, n - (num_stages - j - 1) + 1):
            for k in range(j, i):
                prev, c = best[k], cost(j, k, i)
                if prev is None or c is None:
                    continue
                cand = (tuple(sorted(prev[0] + (c[0],), reverse=True)), prev[1] + (i,), prev[2] + (c[1],))
                if new[i] is None or cand[:2] < new[i][:2]:
                    new[i] = cand
        best = new
    if best[n] is None:
        needed, bounds = _smallest_cap(seg, n, num_stages, options)
        stage = max(range(num_stages), key=lambda j: seg.least_bytes(j, bounds[j], bounds[j + 1], options))
        raise MemoryCapError(f"no cut into {num_stages} stages and no recomputation allowed fits {cap} bytes per "
                             f"stage; the smallest cap that fits is {needed} bytes", needed, bounds, stage)
    return list(best[n][1]), list(best[n][2])


def _cap(req) -> int:
    return int(req.memory_gb * 1e9 / req.chunks)  # interleaved: each chunk gets its rank's share, as `planner.cut`


def choose_recompute(req, shape: ModelShape, costs: Sequence[LayerCost], times: Sequence[tuple[float, float]],
                     memory: StageMemory, num_stages: int, default_cut: Callable[[], list[int]]
                     ) -> tuple[list[int], list[StageRecompute]]:
    """(boundaries, per-stage choices) of a `planner.PlanRequest`: ``recompute`` auto chooses both under
    the memory cap; a fixed mode keeps the request's cut method (``memory`` accounting for it)."""
    mode = req.recompute
    if mode == "none":
        return default_cut(), []
    if mode == "selective" and not ARCHITECTURES[shape.family].selective:
        raise PartitionError(f"--recompute selective: {shape.family} blocks have no selective recomputation; "
                             f"use --recompute full")
    rc = recompute_costs(shape, costs, times, req.micro_batch, req.seq_len // req.cp, ACT_BYTES[req.precision], req.tp)
    per_layer = [f + b for f, b in times]
    split = [split_share(req.schedule, j, req.microbatches, req.pp) for j in range(num_stages)]
    if mode == "auto":
        if req.method != "memory" or req.memory_gb is None:
            raise PartitionError("--recompute auto chooses with the cut under a memory cap: use --method memory "
                                 "--memory-gb GB")
        modes = tuple(m for m in req.recompute_modes if m != "selective" or ARCHITECTURES[shape.family].selective)
        return min_max_recompute(per_layer, memory, rc, num_stages, _cap(req), stage_options(modes), split)
    try:
        fixed = stage_choices(mode, req.recompute_layers, num_stages)
    except RecomputeError as e:
        raise PartitionError(str(e)) from None
    if req.method == "memory" and req.memory_gb is not None:
        bounds, _ = min_max_recompute(per_layer, memory, rc, num_stages, _cap(req), lambda j, _: [fixed[j]], split)
        return bounds, fixed
    return default_cut(), fixed


def apply_to_plan(req, shape: ModelShape, costs: Sequence[LayerCost], times: Sequence[tuple[float, float]],
                  memory: StageMemory, bounds: Sequence[int], choices: Sequence[StageRecompute],
                  split: Sequence[tuple[float, float]] | None):
    """(memory, times, split) with ``choices`` applied layer by layer: kept bytes less what each
    recomputed layer drops, its workspace the activations it rebuilds, its backward (and ZB-H1's I
    and W each) longer by its recomputation."""
    chosen = recomputed_layers([c.name for c in costs], bounds, choices) if choices else {}
    if not chosen:
        return memory, list(times), split
    rc = recompute_costs(shape, costs, times, req.micro_batch, req.seq_len // req.cp, ACT_BYTES[req.precision], req.tp)
    act, ws = list(memory.activation), list(memory.workspace) or [0] * len(costs)
    times, split = list(times), (list(split) if split is not None else None)
    stage_of = {i: j for j, (a, b) in enumerate(zip(bounds, bounds[1:])) for i in range(a, b)}
    for i, mode in chosen.items():
        full = mode == "full"
        act[i] -= rc.full_saved[i] if full else rc.selective_saved[i]
        if full:
            ws[i] = max(ws[i], rc.full_workspace[i])
        extra = rc.full_s[i] if full else rc.selective_s[i]
        runs = 1 + split_share(req.schedule, stage_of[i], req.microbatches, req.pp)
        times[i] = (times[i][0], times[i][1] + runs * extra)
        if split is not None:
            split[i] = (split[i][0] + extra, split[i][1] + extra)
    return replace(memory, activation=act, workspace=ws), times, split
