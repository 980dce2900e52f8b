"""Tied weights across pipeline stages (GPT's token embedding <-> LM head).

Each stage that holds a member of a tie group keeps its own copy of the weight. Before the step the
copies' gradients are summed over exactly those stages, so every copy takes the identical update
and the copies stay bitwise equal. Norms count a tied weight once: only the lowest stage of the
group reports it (`counted_in_norm`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mp_toolkit.layers import LayerList, StageModule
from mp_toolkit.parallel.context import ParallelContext, grid_rank


def tie_stages(layer_list: LayerList, boundaries: Sequence[int]) -> list[list[int]]:
    """For every tie group, the sorted pipeline stages that hold one of its members."""
    out = []
    for group in layer_list.tie_groups:
        stages = set()
        for layer_name, _ in group:
            idx = layer_list.names.index(layer_name)
            stages.add(next(s for s in range(len(boundaries) - 1) if boundaries[s] <= idx < boundaries[s + 1]))
        out.append(sorted(stages))
    return out


class TiedGradients:
    """Sums tied-weight gradients over the ranks whose stages share them.

    ``stages`` are the stages this rank holds (several under interleaved schedules);
    ``stage_rank`` maps a stage index to the global rank that holds it, for every tp/dp replica
    through ``ctx``.
    """

    def __init__(self, layer_list: LayerList, boundaries: Sequence[int], ctx: ParallelContext,
                 stages: dict[int, StageModule], stage_to_pp_rank: Sequence[int]):
        self.members: dict[int, torch.nn.Parameter] = {}  # tie group index -> this rank's copy
        for index in sorted(stages):
            for g, param in stages[index].tie_members.items():
                self.members.setdefault(g, param)
        self.groups: dict[int, object] = {}  # tie group index -> process group (this rank's)
        self.not_counted: set[int] = set()  # id() of tied params another rank counts in norms
        for g, tied_stages in enumerate(tie_stages(layer_list, boundaries)):
            pp_ranks = sorted({stage_to_pp_rank[s] for s in tied_stages})
            if len(pp_ranks) < 2:
                continue
            # new_group is collective over the world: every rank creates every replica's group.
            for tp_rank in range(ctx.tp):
                for dp_rank in range(ctx.dp):
                    for cp_rank in range(ctx.cp):
                        ranks = [grid_rank(r, tp_rank, dp_rank, ctx.tp, ctx.dp, cp_rank, ctx.cp) for r in pp_ranks]
                        pg = dist.new_group(ranks)
                        if ctx.rank in ranks:
                            self.groups[g] = pg
            if g in self.members and ctx.pp_rank != pp_ranks[0]:
                self.not_counted.add(id(self.members[g]))

    def all_reduce(self, master_of=lambda p: p) -> None:
        """Sum each shared weight's gradient over its ranks (a missing gradient counts as 0).

        ``master_of`` maps a model parameter to the tensor whose ``.grad`` the optimizer reads
        (its fp32 master under mixed precision).
        """
        for g, pg in self.groups.items():
            param = master_of(self.members[g])
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=pg)

    def counted_in_norm(self, param: torch.nn.Parameter) -> bool:
        return id(param) not in self.not_counted
