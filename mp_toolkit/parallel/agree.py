"""`agree`: a barrier that also agrees on failure, for the steps every rank takes together (building
the data, writing a checkpoint) where one rank's error must stop all of them with one line."""
from __future__ import annotations

import torch
import torch.distributed as dist

from mp_toolkit.errors import PeerFailed
from mp_toolkit.parallel.context import ParallelContext


def agree(error: Exception | None, ctx: ParallelContext) -> None:
    """A barrier that also agrees on failure: when any rank passes an error, every rank raises. The
    lowest failing rank raises its own error (so one line is printed), the others `PeerFailed`.
    One process (or no process group): ``error`` itself, if any."""
    flag = torch.tensor([ctx.rank if error is not None else ctx.world_size], dtype=torch.int64, device=ctx.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    first = int(flag.item())
    if first == ctx.world_size:
        return
    if first == ctx.rank:
        raise error
    raise PeerFailed(f"rank {first} failed")
