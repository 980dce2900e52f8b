"""LAMB and LARS under ZeRO-1 on a data-parallel replica that owns no element of any tensor (issue 34).

ZeRO-1 cuts each gradient bucket into dp equal ranges (`mp_toolkit.parallel.zero.ShardedBucket`); a
bucket of n elements leaves the last of dp ranks nothing when (dp - 1) x ceil(n / dp) >= n, so at
dp 3 a stage of a 2 x 2 weight and a 2-element bias is held by ranks 0 and 1 alone, each tensor
split between them. Their trust ratios need the whole tensors' norms: one all-reduce of the partial
squares over the dp group (`mp_toolkit.optim.groups.sum_partial_squares`) that every replica must
enter. Rank 2 holds only empty stand-ins of the two tensors, with no gradient: its step must still
join that all-reduce (it used to return first, leaving ranks 0 and 1 waiting until gloo's timeout).
The pieces the ranks step, reassembled, must equal one process stepping the whole tensors.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mp_toolkit.optim.factory import build_optimizer
from mp_toolkit.optim.groups import PartialSums, ZeroPiece
from mp_toolkit.optim.settings import Optim
from mp_toolkit.parallel.zero import ShardedBucket
from tests.dist_harness import run_world
from tests.floor import check

DP, STEPS = 3, 3
SHAPES = {"w": (2, 2), "b": (2,)}  # a bucket each: 4 and 2 elements, ranges of 2 and 1 at dp 3
SETTINGS = {"lamb": Optim("lamb", lr=1e-2, weight_decay=0.01), "lars": Optim("lars", lr=0.5, weight_decay=0.01)}


def tensors(dtype=torch.float32) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """(the initial tensors, each step's gradients), the same on every rank."""
    g = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for n, s in SHAPES.items()}
             for _ in range(STEPS)]
    return init, grads


def layout() -> dict[str, list[tuple[int, int, int]]]:
    """Each tensor's pieces as ZeRO-1 lays them out: [(rank, start, length)]."""
    out = {}
    for name, shape in SHAPES.items():
        bucket = ShardedBucket([torch.nn.Parameter(torch.empty(shape))], DP)
        out[name] = [(r, piece.start, piece.length) for r in range(DP) for piece in bucket.pieces(r)]
    return out


def zero_rank(rank: int, world: int, name: str) -> dict[str, torch.Tensor]:
    """Step ``name`` over this rank's pieces (empty stand-ins where it owns none); return them."""
    init, grads = tensors()
    spread = layout()
    partials = PartialSums(dist.group.WORLD, len(SHAPES))  # both tensors are split between ranks
    named, where = [], {}
    for slot, (n, shape) in enumerate(SHAPES.items()):
        start, length = next(((s, k) for r, s, k in spread[n] if r == rank), (0, 0))
        piece = init[n].reshape(-1)[start:start + length].clone().requires_grad_(True)
        piece.zero_piece = ZeroPiece(shape, slot, start == 0 and length > 0, partials)
        named.append((n, piece))
        where[n] = (start, length)
    optimizer = build_optimizer(SETTINGS[name], named)
    for step in grads:
        for n, piece in named:
            start, length = where[n]
            piece.grad = step[n].reshape(-1)[start:start + length].clone() if length else None
        optimizer.step()
    return {n: piece.detach().clone() for n, piece in named}


def whole(name: str, dtype) -> dict[str, torch.Tensor]:
    """One process stepping the whole tensors (no ZeRO) in ``dtype``."""
    init, grads = tensors(dtype)
    params = {n: t.clone().requires_grad_(True) for n, t in init.items()}
    optimizer = build_optimizer(SETTINGS[name], list(params.items()))
    for step in grads:
        for n, p in params.items():
            p.grad = step[n].clone()
        optimizer.step()
    return {n: p.detach() for n, p in params.items()}


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_a_replica_that_owns_nothing_still_joins_the_norm_sums(name):
    spread = layout()
    assert all(r != DP - 1 for pieces in spread.values() for r, _, _ in pieces)  # rank 2 owns nothing
    assert all(len(pieces) == 2 for pieces in spread.values())  # each tensor split: its norm needs the sum
    results = run_world(zero_rank, DP, name, timeout_s=60)
    assert all(t.numel() == 0 for t in results[DP - 1].values())
    init, _ = tensors(torch.float64)
    ref64, ref32 = whole(name, torch.float64), whole(name, torch.float32)
    for n, pieces in spread.items():
        got = torch.empty(init[n].numel())
        for r, start, length in pieces:
            got[start:start + length] = results[r][n]
        # the updates, not the tensors: a trust ratio from a partial norm moves them by a fraction
        check(got.view(init[n].shape).double() - init[n], ref64[n] - init[n], ref32[n].double() - init[n],
              f"{name} ZeRO-1 {n}")
