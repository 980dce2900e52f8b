"""Rank functions of the oracle tests (importable, so spawned processes can run them)."""

from __future__ import annotations

import torch

from model_zoo.gpt import GPT, GPTConfig, lm_loss
from mp_toolkit.engine.pipeline import PipelineEngine
from mp_toolkit.layers import LayerList
from mp_toolkit.parallel.context import build_context
from mp_toolkit.partition import uniform
from tests.floor import pair

TINY = dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=4, n_head=4)
MICRO_BATCH, SEQ = 2, 16
# Sequence lengths per step and micro-batch, mixed within each step, with lengths that first appear
# in later steps (12, then 4): the engine agrees each new shape when it meets it (engine/shapes.py).
MIXED_LENGTHS = ((16, 8, 16, 8), (8, 12, 16, 12), (4, 16, 12, 4))


def make_batches(steps: int, m: int, vocab: int, seed: int = 0, lengths=None) -> list[list[tuple]]:
    """steps x m micro-batches of (input_ids, labels) from a fixed generator; SEQ tokens each, or
    with ``lengths`` (per step, per micro-batch, cycled) micro-batch j of step i has
    ``lengths[i][j]`` tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        step = []
        for j in range(m):
            row = lengths[i % len(lengths)] if lengths else (SEQ,)
            seq = torch.randint(0, vocab, (MICRO_BATCH, row[j % len(row)] + 1), generator=g)
            step.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
        out.append(step)
    return out


OPTIMIZERS = {  # each takes [(name, param), ...] as the engine passes them, or a plain list
    "adamw": lambda ps: torch.optim.AdamW(_params(ps), lr=1e-2, weight_decay=0.01, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(_params(ps), lr=0.1, momentum=0.9),
}


def _params(ps):
    return [p[1] if isinstance(p, tuple) else p for p in ps]


def single_process(cfg: GPTConfig, batches, optimizer: str = "adamw", seed: int = 0, dtype=torch.float32):
    """The reference: the unsplit model, plain gradient accumulation, same optimizer. In float64
    (the same initial values, widened) it is what tests/floor.py measures both fp32 runs against."""
    torch.manual_seed(seed)
    model = LayerList.from_model(GPT(cfg)).to(dtype)
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    losses = []
    for step in batches:
        total = torch.zeros((), dtype=dtype)
        for x, y in step:
            loss = lm_loss(model(x), y) / len(step)  # invariant 5: the loss, not the gradient, is scaled
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item())
    # every layer's view, tied weights under each of their names
    named = {f"{n}.{path}": p for n, layer in zip(model.names, model.layers) for path, p in layer.named_parameters()}
    return named, losses


def pipeline_run(cfg: GPTConfig, pp: int, schedule: str, batches, optimizer: str = "adamw", seed: int = 0,
                 chunks: int = 1):
    ctx = build_context(pp)
    torch.manual_seed(seed)
    layers = LayerList.from_model(GPT(cfg))
    engine = PipelineEngine(layers, ctx, uniform(len(layers), pp * chunks), len(batches[0]), schedule,
                            optimizer=OPTIMIZERS[optimizer], loss_fn=lm_loss, chunks=chunks)
    losses = [engine.train_batch(iter(step)).loss for step in batches]
    return engine, losses


def oracle_cases(rank: int, world: int, cases, steps: int = 3, lengths=None):
    """For every (schedule, m, tied[, optimizer[, chunks]]): this rank's stage after ``steps`` steps vs the reference.
    ``lengths``: `make_batches`'s sequence lengths (default: SEQ for every micro-batch).

    Returns per case: (number of tensors compared, number not bitwise equal, max abs difference,
    pipeline losses, reference losses, this rank's tied weight if any, and -- for tied cases, which
    agree to rounding only -- {name: (err, floor)} of the parameters and "losses" against a float64
    single process, tests/floor.py's pair; None for untied cases, which must be bitwise), then the
    engine's shape passes, receive buffers allocated and reused, receives posted ahead, and the tie groups
    this rank joined (a tie whose members share a rank is local: none).
    """
    report = []
    for schedule, m, tied, *rest in cases:
        opt, chunks = (list(rest) + ["adamw", 1][len(rest):])[:2]
        cfg = GPTConfig(**TINY, tie_word_embeddings=tied)
        batches = make_batches(steps, m, cfg.vocab_size, lengths=lengths)
        ref_params, ref_losses = single_process(cfg, batches, opt)
        engine, losses = pipeline_run(cfg, world, schedule, batches, opt, chunks=chunks)
        n, unequal, max_diff = 0, 0, 0.0
        for name, p in engine.named_parameters():
            ref = ref_params[name]
            n += 1
            unequal += int(not torch.equal(p.detach(), ref.detach()))
            max_diff = max(max_diff, (p.detach() - ref.detach()).abs().max().item())
        tied_copy = next(iter(engine.ties.members.values())).detach().clone() if engine.ties.members else None
        floors = None
        if tied:
            ref64, ref64_losses = single_process(cfg, batches, opt, dtype=torch.float64)
            floors = {name: pair(p.detach(), ref64[name].detach(), ref_params[name].detach())
                      for name, p in engine.named_parameters()}
            floors["losses"] = pair(losses, ref64_losses, ref_losses)
        pool = engine.p2p.recv_buffers
        comms = (engine.shapes.passes, pool.allocated, pool.reused, engine.executor.posted_ahead,
                 len(engine.ties.groups))
        report.append((n, unequal, max_diff, losses, ref_losses, tied_copy, floors, *comms))
    return report


def eval_matches(rank, world, schedule, chunks=1, lengths=None):
    """eval_batch's mean loss after training equals the reference model's, and changes nothing.
    Returns (loss, reference loss, nothing changed, shape passes the engine ran)."""
    cfg = GPTConfig(**TINY, tie_word_embeddings=False)
    batches = make_batches(3, 4, cfg.vocab_size, lengths=lengths)
    engine, _ = pipeline_run(cfg, world, schedule, batches[:2], chunks=chunks)
    ref_params, _ = single_process(cfg, batches[:2])
    before = [p.detach().clone() for _, p in engine.named_parameters()]
    loss = engine.eval_batch(iter(batches[2]))
    torch.manual_seed(0)
    ref = LayerList.from_model(GPT(cfg))
    with torch.no_grad():
        for name, p in dict(_all_named(ref)).items():
            p.copy_(ref_params[name])
        expected = torch.zeros(())
        for x, y in batches[2]:
            expected += lm_loss(ref(x), y) / len(batches[2])
    unchanged = all(torch.equal(a, p) for a, (_, p) in zip(before, engine.named_parameters()))
    return loss, expected.item(), unchanged, engine.shapes.passes


def mixed_lengths(rank, world, cases):
    """`oracle_cases` over MIXED_LENGTHS, then `eval_matches` (1F1B) over them, in one world."""
    return oracle_cases(rank, world, cases, 3, MIXED_LENGTHS), eval_matches(rank, world, "1f1b", 1, MIXED_LENGTHS)


def _all_named(model: LayerList):
    return [(f"{n}.{path}", p) for n, layer in zip(model.names, model.layers) for path, p in layer.named_parameters()]


def messages_sent(rank, world, cases):
    """Per (schedule, m, chunks): the messages this rank's engine posted in one training step, by peer rank,
    and the SEND actions its schedule list holds (each send is one message)."""
    out = []
    for schedule, m, chunks in cases:
        cfg = GPTConfig(**TINY, tie_word_embeddings=False)
        torch.manual_seed(0)
        layers = LayerList.from_model(GPT(cfg))
        engine = PipelineEngine(layers, build_context(world), uniform(len(layers), world * chunks), m, schedule,
                                optimizer=OPTIMIZERS["adamw"], loss_fn=lm_loss, chunks=chunks)
        sent: dict[int, int] = {}
        post = engine.p2p.post

        def counting(sends, recvs, keys=None, post=post, sent=sent):
            for peer, _ in sends:
                sent[peer] = sent.get(peer, 0) + 1
            return post(sends, recvs, keys)

        engine.p2p.post = counting
        engine.train_batch(iter(make_batches(1, m, cfg.vocab_size)[0]))
        actions = engine.schedule.rank_actions(rank)
        out.append((sent, sum(a.kind.is_send for a in actions)))
    return out
