"""Rank functions for the tensor-parallel LAMB / LARS test (spawned by tests/dist_harness.py).

Each rank holds one half (split along dim 0) of two sharded tensors, marked like Megatron's
``tensor_model_parallel``, and a full copy of a replicated tensor; it steps the optimizer with the
matching halves of the gradients and reports its updated tensors, its trust ratios and how many
all-reduces each step issued.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_toolkit.optim.lamb import LAMB
from mp_toolkit.optim.lars import LARS

OPTIMIZERS = {"lamb": LAMB, "lars": LARS}


def sharded_cases(rank: int, world: int, cases: list) -> list:
    """`sharded_step` for each (name, kwargs, init, grads, sharded) case, in one spawn."""
    return [sharded_step(rank, world, *case) for case in cases]


def sharded_step(rank: int, world: int, name: str, kwargs: dict, init: list, grads: list, sharded: list):
    """Step ``name`` over this rank's shards; return (tensors, trust ratios, all-reduces per step)."""
    params = []
    for t, shard in zip(init, sharded):
        p = torch.nn.Parameter(t.chunk(world, dim=0)[rank].clone() if shard else t.clone())
        p.tensor_model_parallel = shard
        params.append(p)
    opt = OPTIMIZERS[name](params, tp_group=dist.group.WORLD, **kwargs)
    calls, real = [], dist.all_reduce

    def counting_all_reduce(*args, **kw):
        calls[-1] += 1
        return real(*args, **kw)

    dist.all_reduce = counting_all_reduce  # this process only; restored below
    try:
        for step_grads in grads:
            for p, g, shard in zip(params, step_grads, sharded):
                p.grad = g.chunk(world, dim=0)[rank].clone() if shard else g.clone()
            calls.append(0)
            opt.step()
    finally:
        dist.all_reduce = real
    ratios = opt.last_trust_ratios()
    return [p.detach().clone() for p in params], [ratios[p] for p in params], calls
