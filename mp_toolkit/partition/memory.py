"""The exact memory-capped cut: minimise the slowest stage subject to every stage fitting.

A stage's memory depends on *which* stage it is, not only on its layers: under 1F1B stage ``s``
of ``p`` keeps the activations of ``min(m, p - s)`` micro-batches, under GPipe all ``m``
(`StageMemory.inflight`, taken from the simulated schedule). So the feasibility of a segment is
a property of (stage index, first layer, last layer), and the problem is a dynamic programme over
(stages used, layers covered):

1. the optimal bottleneck ``T*`` (min over feasible cuts of the slowest stage) by a scalar DP;
2. among cuts whose stages are all feasible and no slower than ``T*``, the one whose stage times
   sorted in descending order are lexicographically smallest (leximax: the most balanced), ties
   to the lexicographically smallest boundary list -- the same rule as `solvers.min_max`.

Both steps are exact: times are compared as integers with one common scale (`exact_weights`),
and the best prefix cut extends to the best full cut because feasibility of the rest depends
only on (stage, position). ``O(p * n^2)`` segment checks; ``n`` = layers, ``p`` = stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import zip_longest
from numbers import Real
from typing import Sequence

from .solvers import PartitionError, check_num_stages, exact_weights, leximax_cut

__all__ = ["StageMemory", "MemoryCapError", "min_max_memory", "min_memory_cut"]


class MemoryCapError(PartitionError):
    """No cut fits the cap. ``needed`` is the smallest cap that would, reached by ``boundaries``
    whose stage ``stage`` is the one at that cap."""

    def __init__(self, message: str, needed: int, boundaries: list[int], stage: int):
        super().__init__(message)
        self.needed, self.boundaries, self.stage = needed, boundaries, stage


@dataclass(frozen=True)
class StageMemory:
    """Bytes of stage ``j`` holding layers ``[a, b)``: its static bytes, plus the larger of the
    schedule's peak and the optimizer step's temporaries (they never coexist: activations are
    freed before the step), plus a fixed part::

        sum(static[a:b]) + max(inflight[j] * sum(activation[a:b] (+ recorded[a:b] if j > 0))
                               + max(workspace[a:b] + accumulated[a:b]),
                               sum(step_transient[a:b])) + fixed

    where a schedule that splits backwards counts activations and recorded gradients by ``held``
    (`kept`) instead of ``inflight[j]`` times both, and the last term is the running layer's
    (`transient`).
    """

    static: Sequence[int]
    """Per layer: weights, gradients, master copy and optimizer state."""
    activation: Sequence[int]
    """Per layer: bytes kept for backward per micro-batch."""
    inflight: Sequence[int]
    """Per stage: peak micro-batches whose activations the stage holds at once."""
    workspace: Sequence[int] = ()
    """Per layer: transient bytes while it runs (the largest on the stage counts)."""
    accumulated: Sequence[int] = ()
    """Per layer: bytes of the largest gradient its backward hands to ``.grad`` at once. In every
    backward of a step but the first, that gradient is a temporary beside the accumulated one
    (``AccumulateGrad``: ``grad += new``; ZB-H1's W adds the same way), so it counts on top of
    the layer's workspace; the first backward's becomes ``.grad`` (static bytes). For GPT-2 at
    fp32: the LM head's (V, C) matrix, 206 MB for gpt2-medium, and a block's MLP matrix, 16.8 MB;
    an embedding's is one row per distinct token (`mp_toolkit.engine.embedding_rows`). Empty or
    zeros with one micro-batch per step."""
    fixed: int = 0
    """Per stage: bytes independent of the layers (receive buffers, runtime)."""
    step_transient: Sequence[int] = ()
    """Per layer: temporaries of the optimizer step over its parameters."""
    recorded: Sequence[int] = ()
    """Per layer: ZB-H1's gradients recorded by I for W, held per micro-batch in flight beside the
    activations on every stage but the first (its inputs are token ids: it does not split)."""
    held: Sequence[Sequence[tuple[int, int]]] = ()
    """Per stage of a schedule that splits backwards: the (activations, recorded) micro-batch counts
    it holds at its candidate peaks (`mp_toolkit.schedule.simulator.Timeline.peak_held_w`): recorded gradients
    count only for micro-batches between their I and W, and not for the running I or W, whose
    workspace holds them. Empty: every micro-batch in flight holds both (``inflight``)."""
    rank_held: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]] = ()
    """Per rank holding several stages (interleaved chunks): ``(its stages, count vectors)``, the
    micro-batches each stage holds at once at the rank's candidate peaks
    (`mp_toolkit.schedule.simulator.Timeline.rank_held`): `of_rank` takes the largest total over them
    instead of adding up each stage's own peak. Empty: the stages' peaks add up."""

    def __post_init__(self):
        object.__setattr__(self, "_ps", _prefix(self.static))
        object.__setattr__(self, "_pa", _prefix(self.activation))
        object.__setattr__(self, "_pr", _prefix(self.recorded or [0] * len(self.static)))
        object.__setattr__(self, "_pt", _prefix(self.step_transient or [0] * len(self.static)))
        object.__setattr__(self, "_tr", [w + c for w, c in zip_longest(self.workspace, self.accumulated, fillvalue=0)])

    def kept(self, stage: int, a: int, b: int, saved: int = 0) -> int:
        """Bytes of activations and recorded gradients stage ``stage`` holds over layers ``[a, b)``
        at its peak, beside the running layer's workspace; ``saved``: activation bytes per
        micro-batch that recomputation does not keep."""
        act, rec = self._per_microbatch(stage, a, b)
        act -= saved
        if self.held:
            return max(n_act * act + n_rec * rec for n_act, n_rec in self.held[stage])
        return self.inflight[stage] * (act + rec)

    def _per_microbatch(self, stage: int, a: int, b: int) -> tuple[int, int]:
        """Activations, and recorded gradients, of one micro-batch on stage ``stage`` over ``[a, b)``."""
        return self._pa[b] - self._pa[a], (self._pr[b] - self._pr[a] if stage > 0 else 0)

    def _kept_together(self, spans: Sequence[tuple[int, int, int]]) -> int:
        """`kept` of the stages ``spans`` of one rank at once: by the rank's count vectors where
        ``rank_held`` names all of them, else each stage at its own peak."""
        mine = {j for j, _, _ in spans}
        for stages, counts in self.rank_held:
            if mine <= set(stages):
                at = {s: i for i, s in enumerate(stages)}
                per_mb = [(at[j], sum(self._per_microbatch(j, a, b))) for j, a, b in spans]
                return max(sum(c[i] * nbytes for i, nbytes in per_mb) for c in counts)
        return sum(self.kept(j, a, b) for j, a, b in spans)

    def transient(self, a: int, b: int) -> int:
        """Bytes beside the kept ones while the largest of layers ``[a, b)`` runs its backward: its
        workspace and its accumulation temporary."""
        return max(self._tr[a:b], default=0)

    def __call__(self, stage: int, a: int, b: int) -> int:
        schedule_peak = self.kept(stage, a, b) + self.transient(a, b)
        return (self._ps[b] - self._ps[a]) + max(schedule_peak, self._pt[b] - self._pt[a]) + self.fixed

    def of_rank(self, spans: Sequence[tuple[int, int, int]]) -> int:
        """Bytes of one rank holding the stages ``[(stage, a, b), ...]`` (interleaved chunks). They
        share one process: static bytes, kept activations and step temporaries add up, but the
        largest workspace among all its layers and the fixed part count once::

            sum(static) + max(sum(inflight[j] * activation[a:b]) + max(transient), sum(step_transient)) + fixed

        where the kept sum is taken at the rank's peaks (``rank_held``) when the schedule gives them.
        """
        if not spans:
            return 0
        static = sum(self._ps[b] - self._ps[a] for _, a, b in spans)
        kept = self._kept_together(spans)
        ws = max(self.transient(a, b) for _, a, b in spans)
        step = sum(self._pt[b] - self._pt[a] for _, a, b in spans)
        return static + max(kept + ws, step) + self.fixed


def _prefix(xs: Sequence[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + int(x))
    return out


def _scalar_dp(n: int, p: int, seg_cost) -> tuple[float, list[int]] | None:
    """min over cuts of max over stages of ``seg_cost(j, a, b)`` (None = infeasible segment)."""
    inf = float("inf")
    best = [inf] * (n + 1)
    best[0] = 0
    back = [[0] * (n + 1) for _ in range(p + 1)]
    for j in range(p):
        new = [inf] * (n + 1)
        for i in range(j + 1, n - (p - j - 1) + 1):
            for k in range(j, i):
                if best[k] == inf:
                    continue
                c = seg_cost(j, k, i)
                if c is None:
                    continue
                v = max(best[k], c)
                if v < new[i]:
                    new[i], back[j + 1][i] = v, k
        best = new
    if best[n] == inf:
        return None
    bounds, i = [n], n
    for j in range(p, 0, -1):
        i = back[j][i]
        bounds.append(i)
    return best[n], bounds[::-1]


def min_memory_cut(memory: StageMemory, num_layers: int, num_stages: int) -> tuple[int, list[int]]:
    """The smallest achievable largest-stage memory and a cut reaching it."""
    check_num_stages(num_layers, num_stages)
    value, bounds = _scalar_dp(num_layers, num_stages, memory)
    return int(value), bounds


def min_max_memory(times: Sequence[Real], memory: StageMemory, num_stages: int, cap: int) -> list[int]:
    """The most balanced cut minimising the slowest stage with every stage <= ``cap`` bytes.

    Raises `MemoryCapError` (with the smallest feasible cap) when nothing fits.
    """
    n = len(times)
    check_num_stages(n, num_stages)
    if len(memory.inflight) < num_stages:
        raise ValueError(f"inflight gives {len(memory.inflight)} stages, need {num_stages}")
    w = exact_weights(times)
    pw = _prefix(w)
    fits = lambda j, a, b: memory(j, a, b) <= cap
    found = _scalar_dp(n, num_stages, lambda j, a, b: pw[b] - pw[a] if fits(j, a, b) else None)
    if found is None:
        needed, bounds = min_memory_cut(memory, n, num_stages)
        stage = max(range(num_stages), key=lambda j: memory(j, bounds[j], bounds[j + 1]))
        raise MemoryCapError(f"no cut into {num_stages} stages fits {cap} bytes per stage; the smallest "
                             f"cap that fits is {needed} bytes", needed, bounds, stage)
    return leximax_cut(pw, num_stages, found[0], fits)  # the most balanced cut at that bottleneck
