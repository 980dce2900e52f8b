"""Rank functions of the recomputation oracle (tests/test_recompute.py)."""

from __future__ import annotations

import dataclasses

import torch

from model_zoo.gpt import GPT, GPTConfig, lm_loss
from mp_toolkit.engine.pipeline import PipelineEngine
from mp_toolkit.layers import LayerList
from mp_toolkit.parallel.context import build_context
from mp_toolkit.partition import uniform
from mp_toolkit.recompute import apply_recompute, stage_choices
from tests.oracle_workers import OPTIMIZERS, TINY, make_batches

# Dropout everywhere, so a recomputation that drew other masks than its forward would show.
DROPOUT = dict(resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1)


def train(ctx, schedule: str, m: int, mode: str, counts, chunks: int, steps: int = 3):
    """(engine, losses) of ``steps`` AdamW steps of the dropout gpt-tiny, untied, on ``ctx``'s pipeline."""
    cfg = GPTConfig(**TINY, **DROPOUT, tie_word_embeddings=False)
    batches = make_batches(steps, m, cfg.vocab_size)
    torch.manual_seed(0)  # the same model and the same dropout stream for every mode
    layers = LayerList.from_model(GPT(cfg))
    bounds = uniform(len(layers), ctx.pp * chunks)
    apply_recompute(layers, bounds, stage_choices(mode, counts, len(bounds) - 1))
    engine = PipelineEngine(layers, ctx, bounds, m, schedule, optimizer=OPTIMIZERS["adamw"], loss_fn=lm_loss,
                            chunks=chunks)
    return engine, [engine.train_batch(iter(step)).loss for step in batches]


def recompute_vs_none(rank: int, world: int, cases):
    """Per (schedule, m, chunks, mode, counts): (tensors compared, tensors not bitwise equal, losses
    equal) of the run with recomputation against the same layout without."""
    ctx = build_context(world)
    out = []
    refs = {}
    for schedule, m, chunks, mode, counts in cases:
        if (schedule, m, chunks) not in refs:
            engine, losses = train(ctx, schedule, m, "none", None, chunks)
            refs[(schedule, m, chunks)] = ({n: p.detach().clone() for n, p in engine.named_parameters()}, losses)
        ref, ref_losses = refs[(schedule, m, chunks)]
        engine, losses = train(ctx, schedule, m, mode, counts, chunks)
        named = engine.named_parameters()
        unequal = sum(not torch.equal(p.detach(), ref[n]) for n, p in named)
        out.append((len(named), unequal, losses == ref_losses, losses))
    return out


def kept_bytes(layer_list: LayerList, inputs, recomputed) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of one forward, parameters
    left out: what `saved_tensors_hooks` sees packed outside recomputed regions, plus the inputs a
    recomputed layer keeps (torch's checkpoint holds them for the recomputation, not through the
    hooks: inside its region its own hooks replace ours)."""
    params = {p.untyped_storage().data_ptr() for p in layer_list.parameters()}
    seen: dict[int, int] = {}

    def note(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()

    def pack(t):
        note(t)
        return t

    def note_inputs(_module, args) -> None:
        for a in args:
            if torch.is_tensor(a):
                note(a)

    handles = [layer.register_forward_pre_hook(note_inputs)
               for name, layer in zip(layer_list.names, layer_list.layers) if name in recomputed]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer_list(*inputs)
    finally:
        for h in handles:
            h.remove()
    del out
    return sum(seen.values())


def dropout_config(**overrides) -> GPTConfig:
    return dataclasses.replace(GPTConfig(**TINY, **DROPOUT, tie_word_embeddings=False), **overrides)
