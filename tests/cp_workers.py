"""Rank functions of tests/test_context_parallel.py (importable by spawned ranks)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp_toolkit.parallel.context_parallel import ring_attention, ulysses_attention, zigzag_slice
from tests.floor import pair


def ring_rank(rank: int, world: int, fused, B: int = 2, H: int = 4, T: int = 16, hs: int = 8) -> dict:
    """Ring attention over the world (the cp group; ``fused``: each block by the CPU flash kernel, else
    by its scores) against one process's causal attention of the whole sequence, in fp32 and float64:
    this rank's slice of the output and of q, k, v's gradients."""
    dist.barrier()
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(B, H, T, hs, generator=g, dtype=torch.float64) for _ in range(4))
    out = {}
    for dtype in (torch.float32, torch.float64):
        full = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, is_causal=True)
        (ref * w.to(dtype)).sum().backward()
        mine = [zigzag_slice(t.detach(), world, rank, dim=2).requires_grad_(True) for t in full]
        if fused == "ulysses":
            got = ulysses_attention(*mine, dist.group.WORLD)
        else:
            got = ring_attention(*mine, dist.group.WORLD, fused)
        (got * zigzag_slice(w.to(dtype), world, rank, dim=2)).sum().backward()
        out[str(dtype)] = {
            "ref": [zigzag_slice(t, world, rank, dim=2) for t in (ref.detach(), *(f.grad for f in full))],
            "got": [got.detach(), *(m.grad for m in mine)]}
    return out


def dropout_twins_rank(rank: int, world: int, tp: int = 1) -> dict:
    """Our GPT on the whole sequence in one process and split over the world at cp = world / tp
    (`apply_context_parallel`, `context_parallel_loss`; with tp > 1 tensor and sequence parallel
    first), from the same random state, with hidden dropout 0.1 and without: per dropout, the largest
    relative difference of the loss and of the gradients between the two (averaged over cp as the run
    averages them; tp shards gathered whole)."""
    return {f"dropout {p}": _twins(world, tp, p) for p in (0.0, 0.1)}


def _twins(world: int, tp: int, dropout: float) -> dict:
    import dataclasses

    from model_zoo.gpt import GPT, PRESETS, SP_PLAN, TP_PLAN
    from mp_toolkit.layers import LayerList
    from mp_toolkit.parallel.context import build_context
    from mp_toolkit.parallel.context_parallel import apply_context_parallel, context_parallel_loss
    from mp_toolkit.parallel.sequence_parallel import apply_sequence_parallel, is_sequence_parallel
    from mp_toolkit.parallel.tensor_parallel import apply_tensor_parallel, gather_full, vocab_parallel_cross_entropy

    ctx = build_context(pp=1, tp=tp, dp=1, cp=world // tp)
    cfg = dataclasses.replace(PRESETS["gpt-tiny"], resid_pdrop=dropout, embd_pdrop=dropout)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
    labels[1, 20:] = -100  # unlabelled tokens: each rank's share of the labelled ones differs
    out = {}
    for split in (False, True):
        layers = LayerList.from_model(GPT(cfg, seed=3)).train()
        group = ctx.tp_group if split else None
        loss_fn = functools.partial(vocab_parallel_cross_entropy, group=group)
        if split:
            if tp > 1:
                layers = apply_tensor_parallel(layers, ctx, TP_PLAN)
                apply_sequence_parallel(layers, ctx, SP_PLAN)
            apply_context_parallel(layers, ctx)
            loss_fn = context_parallel_loss(loss_fn, ctx)
        torch.manual_seed(11)
        loss = loss_fn(layers(ids), labels)
        loss.backward()
        if split:  # as the step: partial sums over tp, then the mean over grad_group (here the cp group)
            for p in layers.parameters():
                if is_sequence_parallel(p):
                    dist.all_reduce(p.grad, group=ctx.tp_group)
                dist.all_reduce(p.grad, group=ctx.cp_group)
                p.grad /= ctx.cp
            total = loss.detach().clone()
            dist.all_reduce(total, group=ctx.cp_group)
            loss = total / ctx.cp
        grads = {k: gather_full(p, group, p.grad).clone() for k, p in layers.named_parameters()}
        out[split] = (loss.item(), grads)
    (one, g1), (cp, g2) = out[False], out[True]
    worst = max(((g2[k] - g1[k]).abs().max() / g1[k].abs().max().clamp_min(1e-30)).item() for k in g1)
    return {"loss": abs(cp - one) / abs(one), "grad": worst}


def kept_rank(rank: int, world: int, b: int = 2, s: int = 32) -> dict[str, int]:
    """Bytes autograd keeps per layer of our gpt-tiny on this rank at cp = world (`measure_layers`'
    saved-tensor count), the LM head with the run's loss (its share of the tokens)."""
    from model_zoo.gpt import GPT, PRESETS
    from mp_toolkit.layers import LayerList
    from mp_toolkit.parallel.context import build_context
    from mp_toolkit.parallel.context_parallel import apply_context_parallel, context_parallel_loss
    from mp_toolkit.parallel.tensor_parallel import vocab_parallel_cross_entropy
    from mp_toolkit.partition.measure import measure_layers

    ctx = build_context(pp=1, tp=1, dp=1, cp=world)
    cfg = PRESETS["gpt-tiny"]
    layers = LayerList.from_model(GPT(cfg, seed=3)).train()
    apply_context_parallel(layers, ctx)
    ids = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    loss = context_parallel_loss(lambda y, t: vocab_parallel_cross_entropy(y, t, None), ctx)
    measured = measure_layers(layers, ids[:, :-1].contiguous(), loss, ids[:, 1:].contiguous(), warmup=0, repeats=1)
    return {m.name: m.activation_bytes for m in measured}


def llama_twins_rank(rank: int, world: int) -> dict:
    """HF Llama (grouped-query heads, rotary positions) in one process in fp32 and float64 and at
    cp = world in fp32: the loss and each gradient (averaged over cp as the run averages them) as
    (err, floor) pairs against the float64 run (tests/floor.py)."""
    from mp_toolkit.hf.adapters import from_hf
    from mp_toolkit.hf.losses import causal_lm_loss
    from mp_toolkit.layers import LayerList
    from mp_toolkit.parallel.context import build_context
    from mp_toolkit.parallel.context_parallel import apply_context_parallel, context_parallel_loss
    from tests.hf_workers import causal_inputs, tiny_hf

    ctx = build_context(pp=1, tp=1, dp=1, cp=world)
    ids, mask = causal_inputs(B=2, T=16, padded=False)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    out = {}
    for split, dtype in ((False, torch.float64), (False, torch.float32), (True, torch.float32)):
        hf = from_hf(tiny_hf("llama", train=True))
        layers = LayerList(list(zip(hf.names, hf.layers)), hf.tie_groups).to(dtype)
        loss_fn = causal_lm_loss
        if split:
            apply_context_parallel(layers, ctx)
            loss_fn = context_parallel_loss(causal_lm_loss, ctx)
        loss = loss_fn(layers(ids, mask), labels)
        loss.backward()
        if split:
            for p in layers.parameters():
                dist.all_reduce(p.grad, group=ctx.cp_group)
                p.grad /= ctx.cp
            total = loss.detach().clone()
            dist.all_reduce(total, group=ctx.cp_group)
            loss = total / ctx.cp
        out[(split, dtype)] = (loss.detach(), {k: p.grad.clone() for k, p in layers.named_parameters()})
    (l64, g64), (l32, g32) = out[(False, torch.float64)], out[(False, torch.float32)]
    lcp, gcp = out[(True, torch.float32)]
    return {"loss": pair(lcp, l64, l32), "grads": {k: pair(gcp[k], g64[k], g32[k]) for k in g64}}
