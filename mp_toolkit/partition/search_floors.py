"""The floors that prune `mpt plan --search` (`partition.search`, its docstring's items 2 and 3): per layout,
the least bytes some rank must hold and a lower bound on its step time, computed from the layer costs and
the cut `make_plan` would take, both kept per (tp, micro-batch, cp) so that the layouts sharing them pay
once. ``req`` is the search's request (`search.SearchRequest`), ``lay`` a layout (`search.Layout`)."""
from __future__ import annotations

from dataclasses import replace

from mp_toolkit.names import V_SCHEDULES
from mp_toolkit.parallel.vocab_parallel import padded_vocab_size
from mp_toolkit.schedule import SPLIT_SCHEDULES, placement

from .cost import ACT_BYTES, bytes_per_param, layer_costs
from .planner import GB, PlanRequest, step_overhead_ms, tp_seconds
from .recompute import recompute_costs
from .solvers import min_max
from .vcut import balanced

__all__ = ["Floors", "splits_sequence"]


def splits_sequence(req, tp: int) -> bool:
    """Whether the layouts of this tp are sequence parallel (`partition.search`'s docstring): tp > 1 and it
    splits the sequence."""
    return req.sequence_parallel and tp > 1 and req.seq_len % tp == 0


class Floors:
    """The static-memory and step-time floors of layouts, with costs and cuts shared between them."""

    def __init__(self, req, shape):
        self.req, self.shape = req, shape
        self._costs, self._cuts = {}, {}

    def costs(self, tp: int, mb: int, cp: int = 1):
        """The layer costs `make_plan` takes: the vocabulary padded for tp, sequence parallel as the
        layouts of that tp are (`_per_replica`), a rank's seq / cp tokens."""
        key = (tp, mb, cp)
        if key not in self._costs:
            shape = replace(self.shape, vocab_size=padded_vocab_size(self.shape.vocab_size, tp))
            sp = splits_sequence(self.req, tp)
            self._costs[key] = layer_costs(shape, mb, self.req.seq_len, self.req.precision, tp, sp, cp)
        return self._costs[key]

    def cut(self, tp: int, mb: int, stages: int, cp: int = 1, v: bool = False) -> list[int]:
        """`make_plan`'s flops cut (``v``: a V schedule's, which balances ranks of two stages)."""
        key = (tp, mb, stages, cp, v)
        if key not in self._cuts:
            flops = [c.flops_fwd + c.flops_bwd for c in self.costs(tp, mb, cp)]
            self._cuts[key] = balanced(flops, stages, v)
        return self._cuts[key]

    def kept_full(self, tp: int, mb: int, cp: int = 1) -> list[int]:
        """Per layer, the activation bytes it keeps per micro-batch with every block recomputed in full
        (its input; `recompute.recompute_costs`)."""
        costs = self.costs(tp, mb, cp)
        rc = recompute_costs(self.shape, costs, [(0.0, 0.0)] * len(costs), mb, self.req.seq_len // cp,
                             ACT_BYTES[self.req.precision], tp)
        return [c.activation_bytes - saved for c, saved in zip(costs, rc.full_saved)]

    def static_floor(self, lay, plan_req: PlanRequest, rates) -> int:
        """The least bytes some rank holds on its device (module docstring, 2)."""
        costs = self.costs(lay.tp, lay.micro_batch, lay.cp)
        bpp = bytes_per_param(self.req.precision, self.req.optimizer, zero_dp=lay.dp * lay.cp if lay.zero else 1,
                              momentum=self.req.momentum)
        static = [c.params * bpp for c in costs]
        if lay.recompute == "auto":  # any cut; every stage holds at least one micro-batch's layer inputs
            per_rank = (sum(static) + sum(self.kept_full(lay.tp, lay.micro_batch, lay.cp))) / lay.pp
        else:
            bounds = self.cut(lay.tp, lay.micro_batch, lay.pp * lay.chunks, lay.cp, lay.schedule in V_SCHEDULES)
            to_rank = placement(lay.schedule, lay.pp, lay.chunks)
            per_rank = max(sum(sum(static[bounds[s]:bounds[s + 1]]) for s in range(len(bounds) - 1) if to_rank[s] == r)
                           for r in range(lay.pp))
        return rates.device_bytes(int(per_rank))

    def time_floor(self, lay, plan_req: PlanRequest, rates) -> float:
        """A lower bound on the step time in ms (module docstring, 3), with the step's overhead after
        the schedule (`planner.step_overhead_ms`) exactly as `make_plan` adds it."""
        costs, tflops = self.costs(lay.tp, lay.micro_batch, lay.cp), rates.tflops
        stages = lay.pp * lay.chunks
        bounds = self.cut(lay.tp, lay.micro_batch, stages, lay.cp, lay.schedule in V_SCHEDULES)
        shape = replace(self.shape, vocab_size=padded_vocab_size(self.shape.vocab_size, lay.tp))
        # the tensor- and context-parallel collectives' waits, which `make_plan` adds to each layer's time
        comm = tp_seconds(plan_req, shape, costs, rates) if lay.tp > 1 or lay.cp > 1 else [(0.0, 0.0)] * len(costs)
        cf = [1e3 * sum(t[0] for t in comm[a:b]) for a, b in zip(bounds, bounds[1:])]
        cb = [1e3 * sum(t[1] for t in comm[a:b]) for a, b in zip(bounds, bounds[1:])]
        fb = [sum(c.flops_fwd + c.flops_bwd for c in costs[a:b]) / (tflops * 1e9) + x + y
              for (a, b), x, y in zip(zip(bounds, bounds[1:]), cf, cb)]
        touched = bytes_per_param(self.req.precision, self.req.optimizer, momentum=self.req.momentum) + 8
        params = [sum(c.params for c in costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        to_rank = placement(lay.schedule, lay.pp, lay.chunks)
        overhead = step_overhead_ms(plan_req, rates, shape, [(p, 1e3 * p * touched / (rates.mem_gbps * GB))
                                                              for p in params], to_rank)
        f = [sum(c.flops_fwd for c in costs[a:b]) / (tflops * 1e9) + x
             for (a, b), x in zip(zip(bounds, bounds[1:]), cf)]
        b = [x - y for x, y in zip(fb, f)]
        split = lay.schedule in SPLIT_SCHEDULES
        # One micro-batch goes forward through every stage and back: a split backward's I (half of B
        # unmeasured) on every stage but the first, whose whole backward is W. Without a split, the last
        # backward a rank runs is followed by the backwards of every stage before its first; with a split
        # its W's may come last, so the per-rank bound keeps only what precedes its first action.
        chain = sum(f) + (sum(b[1:]) / 2 + b[0] if split else sum(b))
        if lay.recompute == "auto":  # cut by memory: no rank beats the balanced cut's slowest stage
            if lay.chunks == 1:  # balanced over each layer's FLOP time with its collectives' waits
                per_layer = [(c.flops_fwd + c.flops_bwd) / (tflops * 1e9) + 1e3 * (t[0] + t[1])
                             for c, t in zip(costs, comm)]
                cut = min_max(per_layer, stages)
                work = max(sum(per_layer[a:z]) for a, z in zip(cut, cut[1:]))
            else:
                work = sum(fb) / lay.pp
            return max(work * lay.microbatches, sum(f) + (0.0 if split else sum(b))) + sum(overhead) / lay.pp
        tail = [0.0] * stages if split else b
        return max(chain, *(sum(f[:r]) + lay.microbatches * sum(fb[s] for s in range(stages) if to_rank[s] == r)
                            + sum(tail[:r]) for r in range(lay.pp))) + max(overhead)
