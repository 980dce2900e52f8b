"""ZeRO-1 masters: the fp32 master weights and optimizer state of this rank's pieces only.

`ShardedMasters` has `MasterWeights`'s interface, so `mp_toolkit.engine.step.OptimizerStep` runs
its one order of operations unchanged over pieces (`mp_toolkit.parallel.zero`: dp rank r owns
range r of every gradient bucket)::

    reduce-scatter (ShardedGrads)  -> grads_to_master: each piece's .grad is a view of the range
    unscale, tied sums, overflow   -> over pieces (a tie's pieces line up: its own bucket)
    global norm                    -> `partitioned_grad_norm`: every element on exactly one rank
    optimizer.step()               -> over pieces; LAMB / LARS sum the partial norms of tensors
                                      that straddle two ranks in one all-reduce (`ZeroPiece`)
    copy_back                      -> all-gather of the ranges into every replica's parameters

In fp32 a piece is a view of the model parameter (no copy: the master *is* the parameter, as
without ZeRO); under fp16 / bf16 the pieces are views of one fp32 range per bucket, which is
also what the all-gather sends. The optimizer state the optimizer creates is piece-shaped, so
a rank holds 1/dp of it (plus at most one bucket's padding).

Checkpoints stay layout-independent (DESIGN.md invariant 8): `gather` rebuilds a parameter's full
fp32 tensor from the ranks' pieces (collective over the dp group), `piece_of_full` cuts this rank's
piece out of a full tensor; `mp_toolkit.run.state` writes and reads whole tensors through them.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch
import torch.distributed as dist

from mp_toolkit.optim.groups import PartialSums, ZeroPiece, is_tensor_parallel
from mp_toolkit.parallel.zero import ShardedBucket, ShardedGrads, all_gather_buckets

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedMasters:
    """Pairs each model parameter with this rank's fp32 piece of it (see the module docstring).

    Args:
        params: this rank's model parameters, in the order the optimizer is built.
        buckets: stage -> `ShardedBucket`s of those parameters (`sharded_buckets`), alike on every
            dp rank.
        grads: the `ShardedGrads` that reduce-scatters them.
        group: the data-parallel group (size > 1); ``rank`` is this rank's place in it.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter],
                 buckets: Mapping[Hashable, Sequence[ShardedBucket]], grads: ShardedGrads, group):
        self.model = list(params)
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.grads = grads
        self.buckets = [b for bs in buckets.values() for b in bs]
        self.separate = any(p.dtype != torch.float32 for p in self.model)
        # Where every rank's piece of each parameter lies: [(rank, start, length)]
        self.spread: dict[int, list[tuple[int, int, int]]] = {}
        for bucket in self.buckets:
            for r in range(self.size):
                for piece in bucket.pieces(r):
                    self.spread.setdefault(id(piece.param), []).append((r, piece.start, piece.length))
        split = [p for b in self.buckets for p in b.params if len(self.spread.get(id(p), ())) > 1]
        partials = PartialSums(group, len(split))
        slot = {id(p): i for i, p in enumerate(split)}
        self.ranges: dict[ShardedBucket, torch.Tensor] = {}
        self._piece: dict[int, torch.Tensor] = {}
        self._at: dict[int, tuple[ShardedBucket, int]] = {}  # id(param) -> (bucket, offset in its range)
        for bucket in self.buckets:
            if self.separate:
                self.ranges[bucket] = torch.zeros(bucket.shard, dtype=torch.float32, device=bucket.params[0].device)
            for piece in bucket.pieces(self.rank):
                p = piece.param
                flat = p.detach().view(-1).narrow(0, piece.start, piece.length)
                if self.separate:
                    t = self.ranges[bucket].narrow(0, piece.offset, piece.length)
                    t.copy_(flat)
                else:
                    t = flat  # fp32: the master is the parameter itself, as without ZeRO
                t.requires_grad_(True)  # a trainable tensor to the optimizer (param groups skip frozen ones)
                t.zero_piece = ZeroPiece(tuple(p.shape), slot.get(id(p), -1), piece.start == 0, partials)
                if is_tensor_parallel(p):
                    t.tensor_model_parallel = True
                self._piece[id(p)] = t
                self._at[id(p)] = (bucket, piece.offset)
        empty = [p for p in self.model if id(p) not in self._piece]
        for p in empty:  # no element here: an empty stand-in keeps `of` total (tied sums, norms)
            t = torch.zeros(0, dtype=torch.float32, device=p.device).requires_grad_(True)
            t.zero_piece = ZeroPiece(tuple(p.shape), slot.get(id(p), -1), False, partials)
            self._piece[id(p)] = t
        self.master = [self._piece[id(p)] for p in self.model if id(p) in self._at]

    def of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's piece of a model parameter (1-D fp32; empty where the rank holds none of it)."""
        return self._piece[id(param)]

    def named(self, named: Sequence[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
        """The optimizer's tensors by their parameters' names: the non-empty pieces. A replica that
        holds no element of any of them (small buckets over many replicas) gets the empty stand-ins:
        its optimizer steps nothing but still joins the collectives of the others' steps (LAMB and
        LARS sum whole-tensor norms over the dp group)."""
        if not self._at:
            return [(n, self._piece[id(p)]) for n, p in named]
        return [(n, self._piece[id(p)]) for n, p in named if id(p) in self._at]

    def grads_to_master(self, inv_scale: float) -> None:
        """Each piece's .grad <- its part of the reduce-scattered mean gradient x inv_scale."""
        for bucket in self.buckets:
            g = self.grads.grad_shard[bucket]
            if inv_scale != 1.0:
                g.mul_(inv_scale)
        for p in self.model:
            if id(p) in self._at:
                bucket, offset = self._at[id(p)]
                piece = self._piece[id(p)]
                piece.grad = self.grads.grad_shard[bucket].narrow(0, offset, piece.numel())

    @torch.no_grad()
    def copy_back(self) -> None:
        """Every replica's parameters <- the ranks' updated pieces (an all-gather per bucket)."""
        all_gather_buckets({b: (lambda b=b: self._range(b)) for b in self.buckets}, self.group,
                           in_place=self.grads.in_place)

    def _range(self, bucket: ShardedBucket) -> torch.Tensor:
        """This rank's (shard,) fp32 range of ``bucket``: its pieces end to end, zero-padded."""
        if self.separate:
            return self.ranges[bucket]
        out = torch.zeros(bucket.shard, dtype=torch.float32, device=bucket.params[0].device)
        for piece in bucket.pieces(self.rank):
            out.narrow(0, piece.offset, piece.length).copy_(self._piece[id(piece.param)])
        return out

    def zero_grad(self) -> None:
        for p in self.model:
            p.grad = None
            self._piece[id(p)].grad = None
        self.grads.release()

    # ---------------------------------------------------------------- checkpoints

    @torch.no_grad()
    def gather(self, param: torch.nn.Parameter, value: torch.Tensor | None) -> torch.Tensor:
        """The full fp32 tensor (``param``'s shape) whose pieces the ranks hold as ``value``
        (this rank's piece-shaped tensor: its master, or a state such as exp_avg; None or empty
        where it holds none). Collective over the dp group; every rank receives it."""
        spread = self.spread[id(param)]
        longest = max(length for _, _, length in spread)
        mine = torch.zeros(longest, dtype=torch.float32, device=param.device)
        if value is not None and value.numel():
            mine[:value.numel()].copy_(value.reshape(-1))
        whole = torch.empty(self.size * longest, dtype=torch.float32, device=param.device)
        _all_gather(whole, mine, group=self.group)
        out = torch.empty(param.numel(), dtype=torch.float32, device=param.device)
        for r, start, length in spread:
            out[start:start + length].copy_(whole[r * longest:r * longest + length])
        return out.view(param.shape)

    @torch.no_grad()
    def piece_of_full(self, param: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece (a copy) of ``full``, a tensor of ``param``'s shape."""
        for r, start, length in self.spread[id(param)]:
            if r == self.rank:
                return full.reshape(-1)[start:start + length].clone()
        return full.reshape(-1)[:0].clone()
