"""Rank functions for the transport and rank-grid tests."""

import torch

from mp_toolkit.parallel.context import build_context
from mp_toolkit.parallel.p2p import P2P, TensorSpec


def swap_messages(rank, world, transport=P2P):
    """Both ranks send to and receive from each other in one batch (would deadlock unbatched on NCCL);
    ``transport``: `P2P`, or `HostStagedP2P` (the same calls staged through host memory)."""
    p2p = transport(torch.device("cpu"))
    peer = 1 - rank
    mine = (torch.full((2, 3), float(rank)), torch.arange(4) + 10 * rank, torch.tensor([True, rank == 1]))
    specs = [TensorSpec.of(t) for t in mine]
    p2p.send_specs(peer, mine) if rank == 0 else None
    got_specs = p2p.recv_specs(peer) if rank == 1 else specs
    (received,) = p2p.exchange([(peer, mine)], [(peer, specs)])
    p2p.wait_sends()
    return got_specs, received, p2p.bytes_sent


def grid(rank, world, pp, tp, dp):
    ctx = build_context(pp, tp, dp)
    return (ctx.pp_rank, ctx.tp_rank, ctx.dp_rank, ctx.prev_rank, ctx.next_rank, ctx.pp_ranks,
            ctx.is_first_stage, ctx.is_last_stage)
