"""Rank functions of the ZeRO-1 tests (tests/test_zero.py).

Every case trains gpt-tiny twice on the same (pp, tp, dp) grid and the same global batches, built
by `mp_toolkit.run.compose.build_engine` from the same seed on the meta device: once with plain
data parallelism (``zero=0``) and once with ZeRO-1 (``zero=1``). Each rank returns, for both runs,
the per-step losses, pre-clip norms and skip flags, its fp32 master weights after the last step gathered
to full tensors (over dp under ZeRO-1, over tp), the trust-ratio rows, and the elements of optimizer
state it holds (counted from the state tensors); the ZeRO run also reports whether a step skipped for
an injected overflow left its parameters, pieces and optimizer state bitwise unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from model_zoo.gpt import GPT, PRESETS
from mp_toolkit.parallel.context import build_context
from mp_toolkit.parallel.tensor_parallel import gather_full
from mp_toolkit.run.config import TrainConfig
from tests.floor import pair, rel_err
from tests.oracle_tp_dp_workers import CLIP, LR, WD, reference
from tests.oracle_workers import make_batches

STEPS, M = 3, 2


@dataclasses.dataclass(frozen=True)
class Case:
    """One comparison: optimizer, precision, clip (None: off), bucket MiB, and the step (1-based)
    whose gradient gets an inf on the last rank (0: none)."""

    optimizer: str
    precision: str = "fp32"
    clip: float | None = CLIP
    bucket_mb: float = 25.0
    overflow_step: int = 0
    in_place: bool | None = None
    """ZeRO-1's collectives: None as the backend picks (gloo: all-reduce and broadcasts); False:
    reduce-scatter and all-gather, which NCCL runs (gloo has them too)."""


def state_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements of the per-parameter state tensors (moments, momentum buffers; not 0-d step counts)."""
    return sum(v.numel() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _snapshot(engine) -> list[torch.Tensor]:
    out = [p.detach().clone() for _, p in engine.named_parameters()]
    out += [m.detach().clone() for m in engine.masters.master]
    out += [v.clone() for s in engine.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def full_master(engine, p: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 master of ``p`` as a whole tensor of ``p``'s shape: under ZeRO-1 gathered from the
    data-parallel ranks' pieces (a collective over the dp group)."""
    if engine.zero:
        return engine.masters.gather(p, engine.master_of(p))
    return engine.master_of(p).detach()


def _count_dp_all_reduces(engine, ctx) -> list[int]:
    """Filled with the all-reduces over the dp group each optimizer.step() makes (the real step runs)."""
    counts: list[int] = []
    real_step, real_all_reduce = engine.optimizer.step, dist.all_reduce

    def counting(tensor, *args, group=None, **kwargs):
        if group is ctx.dp_group:
            counts[-1] += 1
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    def step(*args, **kwargs):
        counts.append(0)
        dist.all_reduce = counting
        try:
            return real_step(*args, **kwargs)
        finally:
            dist.all_reduce = real_all_reduce

    engine.optimizer.step = step
    return counts


def train(ctx, pp, tp, dp, case: Case, zero: int, batches) -> dict:
    from mp_toolkit.run.compose import build_engine  # the composition the CLI runs
    from mp_toolkit.run.plan import resolve_run

    cfg = TrainConfig.of(model="gpt-tiny", seq_len=64, pp=pp, tp=tp, dp=dp, schedule="1f1b", microbatches=M,
                         partition="uniform", optimizer=case.optimizer, lr=LR, weight_decay=WD, clip_grad=case.clip,
                         precision=case.precision, dp_bucket_mb=case.bucket_mb, zero=zero, initial_scale_power=8)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(PRESETS["gpt-tiny"])
    engine = build_engine(resolve_run(cfg), ctx, model)
    if zero and case.in_place is not None:
        engine.dp_grads.in_place = case.in_place
    losses, norms, skipped, unchanged = [], [], [], None
    calls = _count_dp_all_reduces(engine, ctx)
    for step, batch in enumerate(batches, start=1):
        handle = None
        if step == case.overflow_step and ctx.rank == ctx.world_size - 1:
            victim = engine.named_parameters()[0][1]
            handle = victim.register_hook(lambda g: torch.full_like(g, float("inf")))
        before = _snapshot(engine) if step == case.overflow_step else None
        stats = engine.train_batch(iter(batch[ctx.dp_rank * M:(ctx.dp_rank + 1) * M]))
        if handle is not None:
            handle.remove()
        if before is not None:
            after = _snapshot(engine)
            unchanged = len(before) == len(after) and all(map(torch.equal, before, after))
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
        skipped.append(stats.skipped)
    params = {n: gather_full(p, ctx.tp_group, tensor=full_master(engine, p)) for n, p in engine.named_parameters()}
    return {"losses": losses, "norms": norms, "skipped": skipped, "unchanged": unchanged, "params": params,
            "trust": engine.trust_ratio_stats(), "state": state_numel(engine.optimizer), "dp_calls": calls,
            "buckets": engine.dp_grads.num_buckets,
            "model_numel": sum(p.numel() for _, p in engine.named_parameters())}


def compare(rank, world, pp, tp, dp, cases):
    """Each case with and without ZeRO-1 on the (pp, tp, dp) grid; the figures the test checks."""
    ctx = build_context(pp, tp, dp)
    vocab = PRESETS["gpt-tiny"].vocab_size
    out = []
    for case in cases:
        *batches, held_out = make_batches(STEPS + 1, dp * M, vocab)
        plain = train(ctx, pp, tp, dp, case, 0, batches)
        zero = train(ctx, pp, tp, dp, case, 1, batches)
        errors = {n: rel_err(zero["params"][n], p) for n, p in plain["params"].items()}
        floors = {}
        if case.precision == "fp32":  # the oracle's floor: the single process in fp32 and float64
            ref32, ref64 = (reference(PRESETS["gpt-tiny"], batches, held_out, dtype, case.optimizer)
                            for dtype in (torch.float32, torch.float64))
            floors = {n: pair(p, ref64["params"][n], ref32["params"][n]) for n, p in zero["params"].items()}
        names = sorted(plain["params"])
        out.append({
            "case": case, "errors": errors, "floors": floors,
            "model_err": rel_err(torch.cat([zero["params"][n].reshape(-1) for n in names]),
                                 torch.cat([plain["params"][n].reshape(-1) for n in names])),
            "dp_calls": (plain["dp_calls"], zero["dp_calls"]), "buckets": zero["buckets"],
            "loss_err": rel_err(zero["losses"], plain["losses"]),
            "norm_err": rel_err([x for x in zero["norms"] if x == x], [x for x in plain["norms"] if x == x]),
            "skipped": (plain["skipped"], zero["skipped"]), "unchanged": (plain["unchanged"], zero["unchanged"]),
            "trust": (plain["trust"], zero["trust"]), "state": (plain["state"], zero["state"]),
            "model_numel": plain["model_numel"], "norms": plain["norms"]})
    dist.barrier()
    return {"coords": (ctx.pp_rank, ctx.tp_rank, ctx.dp_rank), "cases": out}
