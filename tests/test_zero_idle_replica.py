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

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mp_toolkit.engine.pipeline import PipelineEngine
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.factory import build_optimizer
from mp_toolkit.optim.groups import PartialSums, ZeroPiece
from mp_toolkit.optim.settings import Optim
from mp_toolkit.parallel.context import build_context
from mp_toolkit.parallel.zero import ShardedBucket
from mp_toolkit.run.state import ModelNames, write_shards
from tests.dist_harness import run_world
from tests.floor import check

DP, STEPS = 3, 3
SHAPES = {"w": (2, 2), "b": (2,)}  # a bucket each: 4 and 2 elements, ranges of 2 and 1 at dp 3
SETTINGS = {"lamb": Optim("lamb", lr=1e-2, weight_decay=0.01), "lars": Optim("lars", lr=0.5, weight_decay=0.01),
            "adamw": Optim("adamw", lr=1e-2, weight_decay=0.01)}


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


# ---------------------------------------------------------------- through the engine

def _linear_list(dtype=torch.float32) -> LayerList:
    """One Linear(2, 2) layer: a 2 x 2 weight and a 2-element bias, drawn the same on every rank."""
    torch.manual_seed(0)
    return LayerList([("lin", torch.nn.Linear(2, 2).to(dtype))])


def _batches(dtype=torch.float32) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, the dp micro-batches (one per replica) of (inputs, targets)."""
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(4, 2, generator=g, dtype=torch.float64).to(dtype),
              torch.randn(4, 2, generator=g, dtype=torch.float64).to(dtype)) for _ in range(DP)]
            for _ in range(STEPS)]


def _mse(outputs, targets):
    return torch.nn.functional.mse_loss(outputs, targets)


def engine_rank(rank: int, world: int, name: str) -> dict[str, torch.Tensor]:
    """STEPS of ``name`` through `PipelineEngine` at pp 1, dp 3 and ZeRO-1: rank 2 owns no element."""
    ctx = build_context(1, 1, DP)
    engine = _engine(ctx, name)
    for step in _batches():
        engine.train_batch(iter([step[ctx.dp_rank]]))
    held = sum(engine.masters.of(p).numel() for _, p in engine.named_parameters())
    return {"held": held, **{n: p.detach().clone() for n, p in engine.named_parameters()}}


def _engine(ctx, name: str) -> PipelineEngine:
    """A bucket per tensor (``dp_bucket_bytes`` 1), as `layout` cuts them: rank 2 holds no element."""
    return PipelineEngine(_linear_list(), ctx, [0, 1], 1, "1f1b", loss_fn=_mse, zero=1, dp_bucket_bytes=1,
                          optimizer=lambda named: build_optimizer(SETTINGS[name], named))


def _whole_model(name: str, dtype) -> dict[str, torch.Tensor]:
    """One process: the same steps on the global batch (the mean of the replicas' losses) in ``dtype``."""
    layers = _linear_list(dtype)
    optimizer = build_optimizer(SETTINGS[name], list(layers.named_parameters()))
    for step in _batches(dtype):
        optimizer.zero_grad()
        (sum(_mse(layers.layers[0](x), y) for x, y in step) / DP).backward()
        optimizer.step()
    return {n.replace("layers.0.", ""): p.detach() for n, p in layers.named_parameters()}


@pytest.mark.parametrize("name", ["lamb", "adamw"])
def test_the_engine_builds_and_steps_a_replica_that_owns_nothing(name):
    """`PipelineEngine` under ZeRO-1 hands such a replica's optimizer the empty stand-ins (it used to
    fail at construction: "optimizer got an empty parameter list"); every replica ends with the
    parameters of one process stepping the global batch, within the fp32 floor."""
    results = run_world(engine_rank, DP, name, timeout_s=90)
    assert [got.pop("held") for got in results] == [3, 3, 0]  # rank 2 owns no element
    ref64, ref32 = _whole_model(name, torch.float64), _whole_model(name, torch.float32)
    for got in results:
        assert sorted(got) == ["lin.bias", "lin.weight"]
        for n, value in got.items():
            key = n.split(".", 1)[1]
            check(value.double(), ref64[key], ref32[key].double(), f"{name} ZeRO-1 engine {n}")


def saving_rank(rank: int, world: int, root: str) -> list[str]:
    """Two LAMB steps under ZeRO-1 at dp 3, then this rank's part of a checkpoint's shards (every
    replica gathers the whole tensors of the pieces: rank 2, holding none and no optimizer state,
    must enter the same gathers). Returns the files written."""
    ctx = build_context(1, 1, DP)
    engine = _engine(ctx, "lamb")
    for step in _batches()[:2]:
        engine.train_batch(iter([step[ctx.dp_rank]]))
    error = write_shards(Path(root), engine, ctx, ModelNames(("lin",), {}))
    assert error is None, error
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())


def test_a_replica_that_owns_nothing_saves_with_the_others(tmp_path):
    """Saving gathers the masters and the optimizer state from every replica's pieces, one collective
    per tensor and state: the replica with no state of its own takes its template from the others."""
    files = run_world(saving_rank, DP, str(tmp_path), timeout_s=90)[0]
    assert any(f.startswith("layers/lin") for f in files) and any(f.startswith("optim/lin") for f in files), files
