"""Rank functions of the pipeline x tensor x data parallel oracle (tests/test_oracle_tp_dp.py).

Every rank trains the reference too: the unsplit gpt-tiny in one process, LAMB and
`torch.nn.utils.clip_grad_norm_`, on the whole global batch of dp x m micro-batches (each loss
divided by dp x m). The parallel run is built by `mp_toolkit.run.compose.build_engine` (apply TP, cut
stages, average over dp) from the same seed, on the meta device, each rank materialising only its
own layers' shards (DESIGN.md invariant 9) -- so the oracle also proves every layout starts from
the unsplit model's weights; data-parallel replica d trains on micro-batches
d*m .. d*m + m - 1 of that global batch. Each rank compares its parameters after the last step
and its clipped gradients of the first, gathered to full tensors with `gather_full`, against the
reference's and returns the errors, with the losses, norms and `eval_batch`'s loss on a held-out
batch; it also checks that the dp replicas hold bitwise equal parameters after every step and
that the tensor-parallel-replicated ones (LayerNorms, row-parallel biases, position embedding) are
bitwise equal over tp.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from model_zoo.gpt import GPT, PRESETS, lm_loss
from mp_toolkit.layers import LayerList
from mp_toolkit.names import stages_per_rank
from mp_toolkit.optim.factory import build_optimizer
from mp_toolkit.optim.groups import is_tensor_parallel
from mp_toolkit.optim.settings import Optim
from mp_toolkit.parallel.context import build_context
from mp_toolkit.parallel.tensor_parallel import gather_full
from mp_toolkit.parallel.tp_comms import all_gather
from mp_toolkit.run.config import TrainConfig
from tests.floor import pair
from tests.oracle_workers import make_batches

LR, WD, CLIP, STEPS = 1e-2, 0.01, 0.4, 3  # CLIP binds: every pre-clip norm of the reference is above 0.4


def _named(model: LayerList) -> list[tuple[str, torch.nn.Parameter]]:
    seen, out = set(), []
    for n, layer in zip(model.names, model.layers):
        for path, p in layer.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((f"{n}.{path}", p))
    return out


def reference(cfg, batches, held_out, dtype=torch.float32, optimizer: str = "lamb") -> dict:
    """Unsplit model in ``dtype``, plain accumulation over the global batch, clip_grad_norm_, LAMB
    (or another ``optimizer`` of `build_optimizer`).

    Returns the final parameters ("params") and the first step's clipped gradients ("grads") by
    name (tied weights under both names), the per-step mean losses and pre-clip norms, the trained
    model's mean loss on the ``held_out`` global batch ("eval"), and the last step's trust ratios
    of adapted tensors ("trust"). Run in float32 it is the oracle's single process; in float64 it
    is the reference both are measured against (tests/floor.py)."""
    torch.manual_seed(0)
    model = LayerList.from_model(GPT(cfg)).to(dtype)  # the same initial values, widened
    named = _named(model)
    opt = build_optimizer(Optim(optimizer, lr=LR, weight_decay=WD), named)
    losses, norms, first_grads = [], [], None
    for step in batches:
        total = torch.zeros((), dtype=dtype)
        for x, y in step:
            loss = lm_loss(model(x), y) / len(step)
            loss.backward()
            total += loss.detach()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        if first_grads is None:
            first_grads = _by_name(model, lambda p: p.grad.clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item())
    with torch.no_grad():
        held_out_loss = sum(lm_loss(model(x), y) / len(held_out) for x, y in held_out).item()
    adapted = {id(p) for g in opt.param_groups if g.get("adapt") for p in g["params"]}
    last = opt.last_trust_ratios() if hasattr(opt, "last_trust_ratios") else {}  # AdamW has none
    ratios = {id(p): r for p, r in last.items() if id(p) in adapted}
    trust = {n: ratios[id(p)] for n, p in _by_name(model, lambda p: p).items() if id(p) in ratios}
    return {"params": _by_name(model, lambda p: p.detach()), "grads": first_grads, "losses": losses,
            "norms": norms, "eval": held_out_loss, "trust": trust}


def _by_name(model: LayerList, value) -> dict:
    return {f"{n}.{path}": value(p) for n, layer in zip(model.names, model.layers)
            for path, p in layer.named_parameters(remove_duplicate=False)}


def _first_step_grads(engine, ctx) -> dict:
    """Filled, during the first step, with the full clipped gradients the optimizer is about to
    use (LAMB overwrites them): the real step runs unchanged after the snapshot."""
    grads: dict = {}
    real = engine.optimizer.step

    def snapshot_then_step(*args, **kwargs):
        if not grads:
            for name, p in engine.named_parameters():
                grads[name] = gather_full(p, ctx.tp_group, p.grad).clone()
        return real(*args, **kwargs)

    engine.optimizer.step = snapshot_then_step
    return grads


def _bitwise_equal_over(group, tensors: list[torch.Tensor]) -> bool:
    """Every rank of ``group`` holds the very same bits of ``tensors`` (True for a missing group)."""
    if group is None or not tensors:
        return True
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    return all(torch.equal(flat, other) for other in all_gather(flat, group))


def _log_dp_calls(engine) -> list:
    """Filled, in order, with the stages whose buckets get posted and "finish" when the step waits
    for them; the real calls run unchanged. Posting during the schedule reads [stage, "finish"]."""
    calls: list = []
    dp = engine.dp_grads
    if dp is None:
        return calls
    real_start, real_finish = dp.start_grad_sync, dp.finish_grad_sync

    def start(key):
        if key not in dp._started:
            calls.append(key)
        real_start(key)

    def finish():
        calls.append("finish")
        real_finish()

    dp.start_grad_sync, dp.finish_grad_sync = start, finish
    return calls


def run_case(ctx, pp, tp, dp, schedule, m, tied, bucket_mb, recompute="none", lengths=None, sp=False, zero=0,
             cp_attention="ring"):
    """One case on this rank. Every approximate figure comes back as (err, floor): the parallel
    result's and the fp32 single process's relative error against the float64 reference
    (tests/floor.py); the test bounds one by a multiple of the other. ``recompute``: the run's
    ``--recompute`` (the reference never recomputes). ``lengths``: `make_batches`'s sequence lengths
    (micro-batches of mixed lengths, different on each replica). ``sp``: ``--sequence-parallel``;
    ``zero``: ``--zero``; ``cp_attention``: ``--cp-attention`` (the cp degree is the context's)."""
    from mp_toolkit.run.compose import build_engine  # the composition the CLI runs
    from mp_toolkit.run.plan import resolve_run

    cfg = dataclasses.replace(PRESETS["gpt-tiny"], tie_word_embeddings=tied)
    *batches, held_out = make_batches(STEPS + 1, dp * m, cfg.vocab_size, lengths=lengths)
    ref32 = reference(cfg, batches, held_out)
    ref64 = reference(cfg, batches, held_out, torch.float64)
    train_cfg = TrainConfig.of(model="gpt-tiny", seq_len=64, pp=pp, tp=tp, dp=dp, schedule=schedule, microbatches=m,
                               partition="uniform", optimizer="lamb", lr=LR, weight_decay=WD, clip_grad=CLIP,
                               precision="fp32", dp_bucket_mb=bucket_mb,
                               chunks=stages_per_rank(schedule), recompute=recompute,
                               sequence_parallel=sp, zero=zero, cp=ctx.cp, cp_attention=cp_attention)
    torch.manual_seed(0)
    with torch.device("meta"):  # as mpt train builds it: each rank draws only its own layers and shards
        model = GPT(cfg)
    engine = build_engine(resolve_run(train_cfg), ctx, model)
    named = engine.named_parameters()
    replicated = [p for _, p in named if not is_tensor_parallel(p)]
    calls = _log_dp_calls(engine)
    grads = _first_step_grads(engine, ctx) if not zero else {}  # ZeRO-1: each replica holds pieces of the mean
    losses, norms, dp_same, tp_same = [], [], [], []
    t0 = time.perf_counter()
    for step in batches:
        stats = engine.train_batch(iter(step[ctx.dp_rank * m:(ctx.dp_rank + 1) * m]))
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
        dp_same.append(_bitwise_equal_over(ctx.grad_group, [p for _, p in named]))  # dp replicas and cp slices
        tp_same.append(_bitwise_equal_over(ctx.tp_group, replicated))
    seconds = time.perf_counter() - t0
    # trust-ratio row of this pipeline rank (min, median, max) vs the references' ratios of its tensors
    rows = engine.trust_ratio_stats()
    mine = [n for n, _ in named if n in ref32["trust"]]
    expected = {key: _min_median_max([ref["trust"][n] for n in mine]) for key, ref in (("32", ref32), ("64", ref64))}
    trust = pair(_min_median_max([rows[ctx.pp_rank][k] for k in ("min", "median", "max")]),
                 expected["64"], expected["32"])
    before = [p.detach().clone() for _, p in named]
    eval_loss = engine.eval_batch(iter(held_out[ctx.dp_rank * m:(ctx.dp_rank + 1) * m]))
    eval_changed = not all(torch.equal(a, p) for a, (_, p) in zip(before, named))
    errors = {name: pair(gather_full(p, ctx.tp_group), ref64["params"][name], ref32["params"][name])
              for name, p in named}
    grad_errors = {name: pair(g, ref64["grads"][name], ref32["grads"][name]) for name, g in grads.items()}
    ln = [n for n, p in named if ".ln_" in n and not is_tensor_parallel(p)]
    return {"losses": losses, "norms": norms, "ref_norms": ref32["norms"],
            "loss_err": pair(losses, ref64["losses"], ref32["losses"]),
            "norm_err": pair(norms, ref64["norms"], ref32["norms"]),
            "eval": (eval_loss, pair(eval_loss, ref64["eval"], ref32["eval"]), eval_changed),
            "trust": (rows, trust), "errors": errors, "grad_errors": grad_errors,
            "dp_same": dp_same, "tp_same": tp_same, "ln_checked": ln, "seconds": seconds,
            "sharded": sorted(n for n, p in named if is_tensor_parallel(p)),
            "stages": sorted(engine.stages), "dp_calls": calls[:len(engine.stages) + 1],  # the first step's
            "dp_buckets": engine.dp_grads.num_buckets if engine.dp_grads is not None else 0}


def _min_median_max(values) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    return [t.min().item(), t.median().item(), t.max().item()]


def oracle_grid(rank, world, pp, tp, dp, cases, cp=1):
    """Run each (schedule, m, tied, bucket_mb[, recompute, lengths]) case, or (schedule, m, tied, bucket_mb,
    {run_case's keywords}), on the (pp, tp, dp) grid (with ``cp`` > 1: pp x tp x cp x dp); results per case."""
    ctx = build_context(pp, tp, dp, cp=cp)
    out = [run_case(ctx, pp, tp, dp, *case[:4], **case[4]) if len(case) == 5 and isinstance(case[4], dict)
           else run_case(ctx, pp, tp, dp, *case) for case in cases]
    dist.barrier()
    coords = (ctx.pp_rank, ctx.tp_rank, ctx.dp_rank) + ((ctx.cp_rank,) if cp > 1 else ())
    return {"coords": coords, "cases": out}
