"""ZeRO-1's layout and traffic: each data-parallel replica owns 1/dp of every gradient bucket.

ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", P_os) as Megatron-LM's distributed optimizer lays it out: a stage's parameters
are packed into buckets (`make_buckets`, the same ~25 MiB as plain data parallelism), each bucket's
flat fp32 space of N elements is padded to a multiple of dp and cut into dp equal, contiguous
ranges; dp rank r owns range r of every bucket. A parameter inside rank r's range, or the part of
one that straddles two ranges, is a `Piece` of rank r. Only the owner keeps the fp32 master and the
optimizer state of a piece, and only the owner steps it.

One step's traffic, per bucket::

    backward done -> reduce-scatter of the bucket's gradients (sum; each rank receives its range)
    step          -> the owner steps its range
                  -> all-gather of the updated ranges: every replica's parameters again whole

A reduce-scatter and an all-gather move what one all-reduce moves (an all-reduce *is* the pair),
so ZeRO-1 costs plain data parallelism's bandwidth.

The collectives by backend. NCCL (and any backend but gloo): ``reduce_scatter_single`` and
``all_gather_single`` (torch 2.13's names; ``reduce_scatter_tensor`` / ``all_gather_into_tensor``
before). gloo implements both for fp32, fp16 and bf16 CPU tensors in torch 2.13, but measured on
2 ranks its reduce-scatter of a 128 MiB input holds another 130 MiB beyond its 64 MiB output,
and its all-gather of 64 MiB into 128 MiB another 128 MiB -- a full copy of the bucket each,
which would spend the memory ZeRO-1 exists to save -- while its in-place all-reduce holds
nothing extra. So under gloo the reduce-scatter is an in-place all-reduce of the bucket of which
each rank keeps its range (a ring all-reduce is a reduce-scatter then an all-gather: twice the
reduce-scatter's bytes on the wire), and the all-gather is one in-place broadcast of each rank's
range into the gathered buffer (the all-gather's bytes).

Overlap is plain data parallelism's (`mp_toolkit.parallel.data_parallel`): a stage's buckets are
posted as asynchronous reduce-scatters once its last backward has run, and waited for at the step.

A tensor tied across pipeline stages (GPT's embedding and LM head) is a bucket of its own, so its
ranges are the same on every stage that holds a copy and the copies' gradient pieces can be summed
piece by piece over the stages (`mp_toolkit.engine.ties`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_toolkit.parallel.data_parallel import BUCKET_BYTES, BucketedGradSync, make_buckets

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Piece:
    """The part of ``param`` (flattened) that one rank owns: elements ``[start, start + length)``
    of the parameter, at ``offset`` in that rank's range of the bucket."""

    param: torch.nn.Parameter
    start: int
    length: int
    offset: int


class ShardedBucket:
    """One bucket's parameters, its padded flat size and every rank's range of it."""

    def __init__(self, params: Sequence[torch.nn.Parameter], dp: int):
        self.params = list(params)
        self.numel = sum(p.numel() for p in self.params)
        self.shard = max(1, -(-self.numel // dp))  # elements each rank owns (the last one pads)
        self.dp = dp

    def pieces(self, rank: int) -> list[Piece]:
        """The pieces of dp rank ``rank``, in parameter order (empty overlaps left out)."""
        lo, hi = rank * self.shard, (rank + 1) * self.shard
        out, at = [], 0
        for p in self.params:
            a, b = max(lo, at), min(hi, at + p.numel())
            if a < b:
                out.append(Piece(p, a - at, b - a, a - lo))
            at += p.numel()
        return out

    def flat_grads(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(dp * shard,) the parameters' gradients (0 where missing) end to end, zero-padded."""
        flat = torch.zeros(self.dp * self.shard, dtype=dtype, device=self.params[0].device)
        at = 0
        for p in self.params:
            if p.grad is not None:
                flat[at:at + p.numel()].copy_(p.grad.reshape(-1))
            at += p.numel()
        return flat


def sharded_buckets(param_sets: Mapping[Hashable, Sequence[torch.nn.Parameter]], dp: int,
                    bucket_bytes: int = BUCKET_BYTES, alone: Sequence[torch.nn.Parameter] = ()
                    ) -> dict[Hashable, list[ShardedBucket]]:
    """Each set's parameters in `make_buckets`'s buckets, every tensor of ``alone`` in a bucket of
    its own (ties across stages, see the module docstring)."""
    single = {id(p) for p in alone}
    out = {}
    for key, params in param_sets.items():
        rest = [p for p in params if id(p) not in single]
        own = [[p] for p in params if id(p) in single]
        out[key] = [ShardedBucket(b, dp) for b in own + (make_buckets(rest, bucket_bytes) if rest else [])]
    return out


def _gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


class ShardedGrads(BucketedGradSync):
    """Reduce-scatters the gradients of named parameter sets over ``group`` (the dp group, size > 1).

    After `finish_grad_sync`, ``grad_shard[bucket]`` holds this rank's range of the bucket's mean
    gradient, fp32; the model's ``.grad`` of every bucketed parameter is freed once it is packed.
    The mean is rounded to the gradients' dtype (fp16 / bf16) and widened again, as plain data
    parallelism writes its mean into the model's gradients, so both take the same step.
    """

    def __init__(self, buckets: Mapping[Hashable, Sequence[ShardedBucket]], group):
        super().__init__(buckets, group)
        self.rank = dist.get_rank(group)
        self.in_place = _gloo(group)  # all-reduce and keep the range, gather by broadcasts (module docstring)
        self.grad_shard: dict[ShardedBucket, torch.Tensor] = {}

    def _post(self, bucket: ShardedBucket) -> tuple:
        """Reduce-scatter the bucket's gradients (under gloo: all-reduce it in place)."""
        flat = bucket.flat_grads()  # summed in fp32, as plain data parallelism does
        for p in bucket.params:
            p.grad = None
        if self.in_place:
            return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True), flat, None, bucket
        out = torch.empty(bucket.shard, dtype=torch.float32, device=flat.device)
        return _reduce_scatter(out, flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True), flat, out, bucket

    def _finish(self, work, flat, out, bucket: ShardedBucket) -> None:
        """Keep the bucket's mean gradient range."""
        work.wait()
        if out is None:  # the whole bucket was all-reduced: keep this rank's range
            out = flat[self.rank * bucket.shard:(self.rank + 1) * bucket.shard].clone()
        out.div_(self.size)
        dtype = bucket.params[0].dtype
        if dtype != torch.float32:
            out.copy_(out.to(dtype))
        self.grad_shard[bucket] = out

    def release(self) -> None:
        """Drop the gradient ranges (after the step)."""
        self.grad_shard.clear()


def all_gather_buckets(ranges: Mapping[ShardedBucket, Callable[[], torch.Tensor]], group,
                       in_place: bool | None = None) -> None:
    """Every bucket's parameters <- the ranks' updated fp32 ranges (``ranges[bucket]()`` makes this
    rank's, (shard,)), rounded to each parameter's dtype. ``in_place``: broadcasts of each range
    into the gathered buffer instead of an all-gather (None: under gloo, see the module docstring).

    One bucket ahead is in flight while the previous one is copied out, so at most two buckets'
    gathered buffers exist at a time (posting every bucket first would hold a full fp32 copy of the
    stage's parameters: the memory ZeRO-1 saves on optimizer state would go to gather buffers)."""

    in_place = _gloo(group) if in_place is None else in_place

    def post(bucket):
        mine = ranges[bucket]()
        whole = torch.empty(bucket.dp * bucket.shard, dtype=mine.dtype, device=mine.device)
        if not in_place:
            return [_all_gather(whole, mine, group=group, async_op=True)], whole, bucket
        me, n = dist.get_rank(group), bucket.shard
        whole[me * n:(me + 1) * n].copy_(mine)
        return [dist.broadcast(whole[r * n:(r + 1) * n], src=dist.get_global_rank(group, r), group=group,
                               async_op=True) for r in range(bucket.dp)], whole, bucket

    buckets = list(ranges)
    ahead = post(buckets[0]) if buckets else None
    with torch.no_grad():
        for i in range(len(buckets)):
            works, whole, bucket = ahead
            ahead = post(buckets[i + 1]) if i + 1 < len(buckets) else None
            for work in works:
                work.wait()
            at = 0
            for p in bucket.params:
                p.copy_(whole[at:at + p.numel()].view_as(p))
                at += p.numel()


__all__ = ["Piece", "ShardedBucket", "ShardedGrads", "all_gather_buckets", "sharded_buckets"]
