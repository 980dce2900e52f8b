"""``--check-replicas N``: the data-parallel replicas of a stage hold the same values, bit for bit.

Every replica (and every context-parallel slice) of a stage receives the same averaged gradients and
applies the same optimizer step, so its parameters, fp32 masters and optimizer state stay bitwise
equal to the others' in every precision. A flipped bit in one replica's memory (silent data
corruption) would train on unnoticed; every N steps each rank hashes each of those tensors
(BLAKE2b, 8 bytes) and the replicas all-gather the hashes over their gradient group (one small
all-gather of 8 bytes per tensor). A tensor whose hashes differ is named with the step, its stage
and the replica that differs (the odd one out of three or more; of two, the second), nothing is
saved, and every rank stops with exit 6 (`ReplicasDiffer`).

Under ZeRO-1 each replica holds its own piece of the masters and of the optimizer state: only the
model parameters (gathered after every step) are compared.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_toolkit.engine.interface import TrainEngine
from mp_toolkit.errors import PeerFailed
from mp_toolkit.parallel.agree import agree
from mp_toolkit.parallel.context import ParallelContext


class ReplicasDiffer(Exception):
    """Data-parallel replicas of a stage hold different values (every rank raises it, exit 6; the one
    that names the tensor has a message, the others an empty one)."""


def digest(t: torch.Tensor) -> int:
    """A signed 64-bit BLAKE2b hash of the bytes of ``t`` (any dtype, any device)."""
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)


def replica_tensors(engine: TrainEngine) -> list[tuple[str, torch.Tensor]]:
    """(what it is, tensor) for every value the replicas must agree on, in the same order on each:
    each parameter, its master when that is another tensor, and the master's optimizer state; under
    ZeRO-1 the parameters only (masters and state are per-replica pieces)."""
    zero = bool(getattr(engine, "zero", 0))
    state = engine.optimizer.state
    out = []
    for name, p in engine.named_parameters():
        out.append((f"parameter {name}", p))
        if zero:
            continue
        master = engine.master_of(p)
        if master is not p:
            out.append((f"fp32 master of {name}", master))
        for key, value in sorted(state.get(master, {}).items()):
            if torch.is_tensor(value):
                out.append((f"optimizer state {key} of {name}", value))
    return out


def _stage_of(engine: TrainEngine, param_name: str) -> str:
    stages = getattr(engine, "stages", None) or {}
    for index in sorted(stages):
        if any(param_name == n or param_name.startswith(n + ".") for n in stages[index].names):
            return f"stage {index}"
    return "its stage"


@dataclass(frozen=True)
class ReplicaCheck:
    """Compares the replicas every ``every`` steps (0: never)."""

    every: int

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def __call__(self, engine: TrainEngine, ctx: ParallelContext, step: int) -> None:
        """Every rank calls it after the same step; raises `ReplicasDiffer` on every rank when any
        stage's replicas differ (the lowest rank that saw it has the line, the others an empty one)."""
        error = None
        if ctx.grad_group is not None:
            tensors = replica_tensors(engine)
            mine = torch.tensor([digest(t) for _, t in tensors], dtype=torch.int64)
            every = [torch.empty_like(mine) for _ in range(ctx.grad_size)]
            dist.all_gather(every, mine.to(ctx.device), group=ctx.grad_group)
            table = torch.stack([t.cpu() for t in every])  # [replica, tensor]
            bad = (table != table[0]).any(dim=0).nonzero().flatten().tolist()
            if bad:
                error = ReplicasDiffer(self._line(engine, ctx, step, tensors, table, bad))
        try:
            agree(error, ctx)
        except PeerFailed:
            raise ReplicasDiffer("") from None

    @staticmethod
    def _line(engine, ctx: ParallelContext, step: int, tensors, table: torch.Tensor, bad: list[int]) -> str:
        column = table[:, bad[0]].tolist()
        common, count = Counter(column).most_common(1)[0]
        odd = next(i for i, v in enumerate(column) if v != common) if count > 1 else 1
        reference = next(i for i, v in enumerate(column) if v == common and i != odd)
        ranks = dist.get_process_group_ranks(ctx.grad_group)
        named = [tensors[i][0] for i in bad[:3]]
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        stage = _stage_of(engine, named[0].rsplit(" ", 1)[-1])
        return (f"replica check after step {step}: {stage}, {'; '.join(named)}{more}: data-parallel replica "
                f"{odd} (rank {ranks[odd]}) differs from replica {reference} (rank {ranks[reference]}); silent "
                f"corruption or a non-deterministic step: nothing saved, stopping every rank")

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip_bit(engine: TrainEngine, tensor: int, element: int, bit: int) -> str:
    """Test hook (``MPT_FAULTS`` ``flip``): invert bit ``bit`` of element ``element`` of the ``tensor``-th
    of `replica_tensors`; returns what was flipped."""
    tensors = replica_tensors(engine)
    what, t = tensors[tensor % len(tensors)]
    width = t.element_size() * 8
    ints = t.detach().view(_SAME_WIDTH_INT[t.element_size()]).reshape(-1)
    mask = 1 << (bit % width)
    if width > 8 and mask >= 1 << (width - 1):  # the sign bit of a signed integer
        mask -= 1 << width
    with torch.no_grad():
        ints[element % ints.numel()] ^= mask
    return f"bit {bit % width} of element {element % ints.numel()} of {what}"
