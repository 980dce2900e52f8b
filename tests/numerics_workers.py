"""Rank functions of the numerics tests: LAMB + clipping oracle, overflow consensus, precisions."""

from __future__ import annotations

import torch

from model_zoo.gpt import GPT, GPTConfig, lm_loss
from mp_toolkit.engine.pipeline import PipelineEngine
from mp_toolkit.layers import LayerList
from mp_toolkit.names import stages_per_rank
from mp_toolkit.optim.factory import build_optimizer
from mp_toolkit.optim.loss_scaler import DynamicLossScaler
from mp_toolkit.optim.settings import Optim
from mp_toolkit.parallel.context import build_context
from mp_toolkit.partition import uniform
from tests.oracle_workers import TINY, make_batches

LR, WD, MAX_NORM = 2e-2, 0.01, 0.05  # MAX_NORM well below the gradient norm: clipping is active


def _named(model: LayerList):
    seen, out = set(), []
    for n, layer in zip(model.names, model.layers):
        for path, p in layer.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((f"{n}.{path}", p))
    return out


def _engine(cfg, world, optimizer="lamb", precision="fp32", scaler=None, m=3, clip=MAX_NORM, schedule="1f1b",
            lr=LR):
    torch.manual_seed(0)
    layers = LayerList.from_model(GPT(cfg))
    stages = world * stages_per_rank(schedule)
    return PipelineEngine(layers, build_context(world), uniform(len(layers), stages), m, schedule,
                          optimizer=lambda named: build_optimizer(Optim(optimizer, lr=lr, weight_decay=WD), named),
                          loss_fn=lm_loss, clip_grad=clip, precision=precision, loss_scaler=scaler)


def lamb_clip_oracle(rank, world, optimizer, schedule, steps=3, m=3):
    """Pipeline LAMB/LARS + global clipping vs the unsplit model with clip_grad_norm_."""
    cfg = GPTConfig(**TINY, tie_word_embeddings=False)
    batches = make_batches(steps, m, cfg.vocab_size)
    torch.manual_seed(0)
    ref = LayerList.from_model(GPT(cfg))
    named = _named(ref)
    opt = build_optimizer(Optim(optimizer, lr=LR, weight_decay=WD), named)
    ref_norms = []
    for step in batches:
        for x, y in step:
            (lm_loss(ref(x), y) / len(step)).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    engine = _engine(cfg, world, optimizer, m=m, schedule=schedule)
    norms = [engine.train_batch(iter(step)).grad_norm for step in batches]
    ref_params = dict(named)
    unequal = [n for n, p in engine.named_parameters() if not torch.equal(p, ref_params[n])]
    return unequal, norms, ref_norms, engine.trust_ratio_stats()


def _snapshot(engine):
    params = [p.detach().clone() for _, p in engine.named_parameters()]
    masters = [p.detach().clone() for p in engine.masters.master]
    state = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
             for k, s in enumerate(engine.optimizer.state.values())}
    return params, masters, state


def _same(a, b) -> bool:
    pa, ma, sa = a
    pb, mb, sb = b
    same_state = sa.keys() == sb.keys() and all(
        all(torch.equal(v, sb[k][n]) if torch.is_tensor(v) else v == sb[k][n] for n, v in s.items())
        for k, s in sa.items())
    return all(map(torch.equal, pa, pb)) and all(map(torch.equal, ma, mb)) and same_state


def overflow_on_one_stage(rank, world, hysteresis, schedule="1f1b", m=3):
    """Step 1 clean; step 2 with inf injected into one gradient of the LAST stage only (on whichever rank
    holds it: the last under 1F1B, the first under a V)."""
    cfg = GPTConfig(**TINY)
    scaler = DynamicLossScaler(initial_scale_power=10, loss_scale_window=1000, hysteresis=hysteresis)
    engine = _engine(cfg, world, "lamb", "fp16", scaler, m=m, schedule=schedule)
    batches = make_batches(2, m, cfg.vocab_size)
    first = engine.train_batch(iter(batches[0]))
    before = _snapshot(engine)
    last = engine.schedule.num_stages - 1
    handle = None
    if last in engine.stages:
        victim = next(engine.stages[last].parameters())
        handle = victim.register_hook(lambda g: torch.full_like(g, float("inf")))
    second = engine.train_batch(iter(batches[1]))
    if handle is not None:
        handle.remove()
    return first.skipped, second.skipped, _same(before, _snapshot(engine)), first.loss_scale, scaler.scale


def overflow_cases(rank, world, cases):
    """`overflow_on_one_stage` for several (hysteresis, schedule, m) in one world."""
    return [overflow_on_one_stage(rank, world, *case) for case in cases]


def precision_curve(rank, world, precision, steps):
    """Per-step losses of gpt-tiny at pp=world in one precision, and bytes this rank sent."""
    cfg = GPTConfig(**TINY)
    scaler = DynamicLossScaler(initial_scale_power=12) if precision == "fp16" else None
    engine = _engine(cfg, world, "adamw", precision, scaler, m=2, clip=1.0, lr=3e-3)
    batches = make_batches(2, 2, cfg.vocab_size, seed=1) * (steps // 2)  # learnable: seen again and again
    losses = [engine.train_batch(iter(step)).loss for step in batches]
    return losses, engine.p2p.bytes_sent if engine.p2p is not None else 0  # one process sends nothing


def many_optimizers_oracle(rank, world, pairs):
    """`lamb_clip_oracle` for several (optimizer, schedule[, m]) in one world."""
    return [lamb_clip_oracle(rank, world, optimizer, schedule, 3, *m) for optimizer, schedule, *m in pairs]
