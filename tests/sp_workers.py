"""Rank functions of tests/test_sequence_parallel.py: each model twice on the same tp group, once
tensor parallel and once tensor + sequence parallel, from the same weights, on the same batch and
the same random state (dropout on where the model has it), so the two can be compared figure by
figure; and the pieces of `mp_toolkit.parallel.sequence_parallel` on their own."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from model_zoo import bert, gpt
from mp_toolkit.arch.architectures import architecture_of
from mp_toolkit.hf.adapters import from_hf
from mp_toolkit.hf.losses import causal_lm_loss, pretraining_loss
from mp_toolkit.hf.tp_plans import apply_hf_tensor_parallel
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.groups import is_tensor_parallel
from mp_toolkit.parallel.context import ParallelContext, build_context
from mp_toolkit.parallel.sequence_parallel import SequenceDropout, apply_sequence_parallel, is_sequence_parallel
from mp_toolkit.parallel.tensor_parallel import apply_tensor_parallel, gather_full, vocab_parallel_cross_entropy
from mp_toolkit.parallel.tp_comms import all_gather
from mp_toolkit.partition.measure import measure_layers
from mp_toolkit.run.families import bert_vocab_parallel_loss
from tests.hf_workers import causal_inputs, tiny_hf

B, T = 2, 16  # T divisible by tp = 2


def _zoo_gpt():
    cfg = dataclasses.replace(gpt.PRESETS["gpt-tiny"], resid_pdrop=0.1, embd_pdrop=0.1)
    model = gpt.GPT(cfg, seed=3)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return LayerList.from_model(model), gpt.TP_PLAN, gpt.SP_PLAN, (ids,), labels, vocab_parallel_cross_entropy


def _zoo_bert():
    cfg = dataclasses.replace(bert.PRESETS["bert-tiny"], hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0)
    model = bert.BertForPreTraining(cfg, seed=3)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, cfg.vocab_size, (B, T), generator=g)
    types = (torch.arange(T) >= T // 2).long().expand(B, T)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T - 3:] = 0
    mlm = torch.where(torch.rand(B, T, generator=g) < 0.3, ids, -100)
    nsp = torch.tensor([0, 1])
    return LayerList.from_model(model), bert.TP_PLAN, bert.SP_PLAN, (ids, types, mask), (mlm, nsp), \
        bert_vocab_parallel_loss


def _hf(name: str, overrides: dict):
    def build():
        model = tiny_hf(name, train=True, **overrides)
        arch = architecture_of(model.config.model_type)
        ids, mask = causal_inputs(B=3, T=T)  # rows 1 and 2 padded
        layers = from_hf(model)
        if name.startswith("bert"):
            types = torch.zeros_like(ids)
            mlm = torch.where(mask.bool(), ids, -100)
            return (layers, None, arch.hf_sp_plan, (ids, mask, types), (mlm, torch.tensor([0, 1, 0])),
                    lambda out, labels, group: pretraining_loss(out, labels, group))
        labels = torch.where(mask.bool(), torch.roll(ids, -1, dims=1), -100)
        return layers, None, arch.hf_sp_plan, (ids, mask), labels, lambda out, y, group: causal_lm_loss(out, y, group)
    return build


MODELS = {
    "gpt": _zoo_gpt,
    "bert": _zoo_bert,
    "hf-gpt2": _hf("gpt2", dict(resid_pdrop=0.1, embd_pdrop=0.1)),
    "hf-llama": _hf("llama", {}),
    "hf-bert": _hf("bert-pretraining", dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0,
                                            intermediate_size=64)),
}


def _split(layers: LayerList, tp_plan, ctx) -> LayerList:
    return apply_tensor_parallel(layers, ctx, tp_plan) if tp_plan is not None else apply_hf_tensor_parallel(layers, ctx)


def _run(name: str, ctx, sequence_parallel: bool, split: bool = True) -> dict:
    """One forward + backward of model ``name`` on this rank; the partial gradients summed over tp
    as `OptimizerStep` sums them. ``split=False``: the unsplit model in this process."""
    layers, tp_plan, sp_plan, inputs, labels, loss_fn = MODELS[name]()
    if not split:
        ctx = ParallelContext()
    layers = _split(layers, tp_plan, ctx)
    layers = LayerList(list(zip(layers.names, layers.layers)), layers.tie_groups)  # called positionally
    if sequence_parallel:
        apply_sequence_parallel(layers, ctx, dict(sp_plan))
    layers.train()
    hidden = layers.layers[0](*inputs)
    hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    torch.manual_seed(11)  # the dropout masks: the same state for both twins
    loss = loss_fn(layers(*inputs), labels, ctx.tp_group)
    loss.backward()
    partial = [p for p in layers.parameters() if is_sequence_parallel(p)]
    for p in partial:
        dist.all_reduce(p.grad, group=ctx.tp_group)
    named = dict(layers.named_parameters())
    return {"loss": loss.detach(), "hidden": tuple(hidden.shape),
            "grads": {k: gather_full(p, ctx.tp_group, p.grad) for k, p in named.items()},
            "sharded": {k for k, p in named.items() if is_tensor_parallel(p)},
            "partial": {k for k, p in named.items() if is_sequence_parallel(p)},
            "dropouts": sum(isinstance(m, SequenceDropout) for m in layers.modules())}


def twins_rank(rank: int, world: int, names):
    """Per model: the unsplit run, the tp run and the tp + sp run on this rank (`_run`)."""
    ctx = build_context(pp=1, tp=world, dp=1)
    return {name: (_run(name, ctx, False, split=False), _run(name, ctx, False), _run(name, ctx, True))
            for name in names}


def dropout_rank(rank: int, world: int):
    """`SequenceDropout`'s slice against ``nn.Dropout`` on the whole tensor, from the same state."""
    ctx = build_context(pp=1, tp=world, dp=1)
    x = torch.randn(3, 8 * world, 5, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(4)
    whole = nn.Dropout(0.3).train()(x)
    torch.manual_seed(4)
    mine = x.chunk(world, dim=1)[ctx.tp_rank]
    sliced = SequenceDropout(0.3, ctx.tp_group).train()(mine)
    after = torch.rand(1)  # the generator advanced alike on every rank
    one = torch.randn(1, 8, 5, requires_grad=True)  # one sequence: a slice along dim 1 is contiguous
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.untyped_storage().nbytes()) or t,
                                                  lambda t: t):
        SequenceDropout(0.3, ctx.tp_group).train()(one)
    return {"equal": torch.equal(sliced, whole.chunk(world, dim=1)[ctx.tp_rank]),
            "same_state": all(torch.equal(after, o) for o in all_gather(after, ctx.tp_group)),
            "eval_identity": SequenceDropout(0.3, ctx.tp_group).eval()(mine) is mine,
            "kept_slice_only": kept == [one.numel() * 4]}


def kept_rank(rank: int, world: int, cases, b: int = 2, s: int = 32):
    """Per (family, sp, dropout) case: the bytes autograd keeps per layer on this rank
    (`measure_layers`' saved-tensor count) at tp = world; family "gpt", "bert" (ours) or "llama" (HF)."""
    ctx = build_context(pp=1, tp=world, dp=1)
    return [_kept(ctx, *case, b, s) for case in cases]


def _kept(ctx, family: str, sp: bool, dropout: float, b: int, s: int) -> dict[str, int]:
    if family == "gpt":
        cfg = dataclasses.replace(gpt.PRESETS["gpt-tiny"], resid_pdrop=dropout, embd_pdrop=dropout)
        layers, tp_plan, sp_plan = LayerList.from_model(gpt.GPT(cfg, seed=3)), gpt.TP_PLAN, gpt.SP_PLAN
        ids = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
        inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

        def loss(y, t):
            return vocab_parallel_cross_entropy(y, t, ctx.tp_group)
    elif family == "llama":
        model = tiny_hf("llama", train=True)
        layers = from_hf(model)
        layers = LayerList(list(zip(layers.names, layers.layers)), layers.tie_groups)
        tp_plan, sp_plan = None, dict(architecture_of("llama").hf_sp_plan)
        inputs, labels, loss = causal_inputs(B=b, T=s, padded=False), None, None
    else:
        cfg = dataclasses.replace(bert.PRESETS["bert-tiny"], hidden_dropout_prob=dropout)
        layers = LayerList.from_model(bert.BertForPreTraining(cfg, seed=3))
        tp_plan, sp_plan = bert.TP_PLAN, bert.SP_PLAN
        ids = torch.randint(5, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
        inputs, labels, loss = (ids, torch.zeros_like(ids), torch.ones_like(ids)), None, None
    layers = _split(layers, tp_plan, ctx)
    if sp:
        apply_sequence_parallel(layers, ctx, sp_plan)
    layers.train()
    measured = measure_layers(layers, inputs, loss, labels, warmup=0, repeats=1)
    return {m.name: m.activation_bytes for m in measured}
