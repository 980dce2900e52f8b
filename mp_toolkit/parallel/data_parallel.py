"""Data parallelism: average the gradients of the model's replicas, in buckets.

The ``dp`` replicas of a pipeline stage's tensor shard (same pp_rank and tp_rank, another dp_rank;
`ParallelContext.dp_group`) hold the same parameters and run the same schedule on different
micro-batches. Once a global batch's backward passes are done, every gradient is replaced by its
mean over the replicas (sum, then / dp). All-reduce hands every rank the same bits, so the
optimizer step that follows is the same on every replica and the parameters stay bitwise equal.

Buckets (PyTorch DDP, Li et al. 2020, "PyTorch Distributed"): gradients are copied into flat fp32
buffers of about 25 MiB and each buffer is reduced by one all-reduce (a few large messages beat
many small ones), then written back. fp16 / bf16 gradients are summed in fp32, as Megatron-LM does
for bf16 (its ``accumulate_allreduce_grads_in_fp32``): no overflow of the sum of loss-scaled
fp16 values, one rounding at the end.

Overlap: `start_grad_sync(key)` posts a parameter set's buckets as asynchronous all-reduces. The
engine calls it the moment a pipeline stage's last weight-gradient action (B or W) of the batch has
run, so that stage's reduction travels while the rank's other stages still compute (interleaved
schedules) and during the pipeline's cool-down (in 1F1B the last stage finishes its backward
first). `finish_grad_sync()` posts whatever is left, waits and writes the means back. What this does
not do: post buckets *during* a stage's last backward as their parameters become ready (DDP's
autograd hooks), so the reduction of the stage whose backward ends last is not hidden.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch
import torch.distributed as dist

BUCKET_BYTES = 25 * 1024 * 1024
"""Bucket size, DDP's default ``bucket_cap_mb=25``, counted in bytes of the fp32 buffer."""


def make_buckets(params: Sequence[torch.nn.Parameter], bucket_bytes: int = BUCKET_BYTES
                 ) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters packed greedily; a bucket closes once it holds ``bucket_bytes`` or
    more (so a tensor larger than a bucket is a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    buckets, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * 4  # fp32 on the wire
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class BucketedGradSync:
    """What every data-parallel gradient synchronisation shares: buckets per parameter set (a
    pipeline stage's), each set's buckets posted once per batch as soon as its gradients are final
    (`start_grad_sync`, overlapping the remaining backward), the rest posted and all awaited by
    `finish_grad_sync`. A subclass says how one bucket is posted (`_post`, returning what `_finish`
    takes) and finished: `DataParallelGrads` all-reduces, `mp_toolkit.parallel.zero.ShardedGrads`
    reduce-scatters."""

    def __init__(self, buckets: Mapping[Hashable, Sequence], group):
        self.group, self.size = group, dist.get_world_size(group)
        self.buckets = buckets
        self._inflight: list[tuple] = []  # what `_post` returned, per posted bucket
        self._started: set = set()

    @property
    def num_buckets(self) -> int:
        return sum(len(b) for b in self.buckets.values())

    def start_grad_sync(self, key: Hashable) -> None:
        """Post the reductions of ``key``'s buckets (once per batch; its gradients must be final)."""
        if key in self._started:
            return
        self._started.add(key)
        for bucket in self.buckets[key]:
            self._inflight.append(self._post(bucket))

    def finish_grad_sync(self) -> None:
        """Post every bucket not posted yet, wait for all, and finish each."""
        for key in self.buckets:
            self.start_grad_sync(key)
        for posted in self._inflight:
            self._finish(*posted)
        self._inflight.clear()
        self._started.clear()

    def _post(self, bucket) -> tuple:
        raise NotImplementedError

    def _finish(self, *posted) -> None:
        raise NotImplementedError


class DataParallelGrads(BucketedGradSync):
    """Averages the gradients of named parameter sets over ``group`` (the data-parallel group).

    Args:
        param_sets: key -> parameters whose gradients are complete at the same time (a pipeline
            stage's); the sets must be disjoint and listed in the same order on every replica.
        group: the data-parallel process group (of size > 1).
        bucket_bytes: target bucket size in bytes of fp32.
    """

    def __init__(self, param_sets: Mapping[Hashable, Sequence[torch.nn.Parameter]], group,
                 bucket_bytes: int = BUCKET_BYTES):
        ids = [id(p) for ps in param_sets.values() for p in ps]
        if len(ids) != len(set(ids)):
            raise ValueError("data-parallel parameter sets overlap: each parameter must be in exactly one")
        super().__init__({key: make_buckets(list(ps), bucket_bytes) for key, ps in param_sets.items()}, group)

    def _post(self, bucket) -> tuple:
        """All-reduce the bucket's gradients packed into one fp32 buffer."""
        grads = []
        for p in bucket:
            if p.grad is None:  # an unused parameter still takes part, so replicas' buckets line up
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch.cat([g.reshape(-1).float() for g in grads])  # (sum of numels,) fp32
        return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True), flat, grads

    def _finish(self, work, flat, grads) -> None:
        """Write the mean back into each gradient."""
        work.wait()
        flat.div_(self.size)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))  # rounds to the gradient's dtype under fp16 / bf16


__all__ = ["BucketedGradSync", "DataParallelGrads", "make_buckets", "BUCKET_BYTES"]
