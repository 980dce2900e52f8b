"""Rank functions of tests/test_vocab_padding.py: a GPT whose vocabulary (997, a prime) no tp divides.

At tp = 2 the vocabulary is padded to 1024 (a multiple of 128 x 2): rank 0 holds ids 0..511, rank
1 ids 512..1023, of which 997..1023 are padding.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from model_zoo.gpt import GPT, GPTConfig
from mp_toolkit.parallel.context import build_context
from mp_toolkit.parallel.tensor_parallel import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    gather_full,
    gather_vocab_parallel_logits,
    shard_full,
    vocab_parallel_cross_entropy,
)
from mp_toolkit.run.config import TrainConfig
from tests.floor import pair
from tests.oracle_tp_dp_workers import CLIP, LR, WD, reference
from tests.oracle_workers import SEQ, make_batches

VOCAB, PADDED = 997, 1024
CONFIG = GPTConfig(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2)
STEPS, M = 3, 2


def padding_rows(t: torch.Tensor, tp_rank: int, vocab: int = VOCAB) -> torch.Tensor:
    """The rows of this rank's vocab shard ``t`` (dim 0) that lie past the real vocabulary."""
    per = t.shape[0]
    return t[max(0, min(per, vocab - tp_rank * per)):]


def largest_in_padding(tensors, tp_rank: int) -> float:
    """The largest |value| in the padding rows of ``tensors`` (0.0 on a rank that holds none)."""
    return max([padding_rows(t, tp_rank).abs().max().item() for t in tensors if padding_rows(t, tp_rank).numel()],
               default=0.0)


def padded_oracle(rank, world, optimizer: str, tied: bool) -> dict:
    """3 steps of ``optimizer`` (clipping binds, weight decay on) at tp = 2, the LM head ``tied`` to
    the embedding or not, against the unsplit model in fp32 and float64: losses, full parameters
    and trust ratios as (err, floor) pairs, and the padded rows of the parameters and of the
    optimizer state (which must be exactly zero)."""
    from mp_toolkit.run.compose import build_engine  # the composition the CLI runs
    from mp_toolkit.run.plan import resolve_run

    ctx = build_context(1, 2, 1)
    *batches, held_out = make_batches(STEPS + 1, M, VOCAB)
    config = dataclasses.replace(CONFIG, tie_word_embeddings=tied)
    ref32 = reference(config, batches, held_out, optimizer=optimizer)
    ref64 = reference(config, batches, held_out, torch.float64, optimizer=optimizer)
    model_file = Path(tempfile.mkdtemp(prefix="vocab-padding-")) / "config.json"  # the run names its model
    model_file.write_text(json.dumps(config.to_dict()))
    cfg = TrainConfig.of(model=str(model_file), seq_len=SEQ, pp=1, tp=2, dp=1, microbatches=M, partition="uniform",
                         optimizer=optimizer, lr=LR, weight_decay=WD, clip_grad=CLIP, precision="fp32")
    torch.manual_seed(0)
    engine = build_engine(resolve_run(cfg), ctx, GPT(config))
    named = engine.named_parameters()
    padded = {n: p for n, p in named if hasattr(p, "unpadded_size")}
    pad_max = {"init": largest_in_padding(padded.values(), ctx.tp_rank)}
    losses = [engine.train_batch(iter(step)).loss for step in batches]
    pad_max["trained"] = largest_in_padding(padded.values(), ctx.tp_rank)
    state = [v for p in padded.values() for v in engine.optimizer.state[engine.masters.of(p)].values()
             if v.shape == p.shape]  # exp_avg, exp_avg_sq (LAMB) or the momentum buffer (LARS)
    pad_max["optimizer_state"] = largest_in_padding(state, ctx.tp_rank)
    ratios = engine.optimizer.last_trust_ratios()
    by_id = {id(engine.masters.of(p)): n for n, p in named}
    trust = {by_id[id(p)]: pair(r, ref64["trust"][by_id[id(p)]], ref32["trust"][by_id[id(p)]])
             for p, r in ratios.items() if by_id[id(p)] in ref32["trust"]}
    full = {n: gather_full(p, ctx.tp_group) for n, p in named}
    return {
        "losses": pair(losses, ref64["losses"], ref32["losses"]),
        "params": {n: pair(full[n], ref64["params"][n], ref32["params"][n]) for n in full},
        "trust": trust, "pad_max": pad_max, "state_tensors": len(state),
        "padded": {n: (tuple(p.shape), tuple(full[n].shape)) for n, p in padded.items()},
        "reshard": all(torch.equal(shard_full(full[n], p, ctx.tp_rank, ctx.tp), p) for n, p in named),
    }


def padded_layers(rank, world) -> dict:
    """The padded embedding, LM head (with a bias, as BERT's MLM decoder) and loss against the
    unsplit layers: outputs, logits gathered without padding, loss and every gradient."""
    ctx = build_context(1, 2, 1)
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)
    ids = torch.tensor([[0, 511, 512, 996], [700, 3, 996, 511]])  # both ranks' ids, the last real one
    labels = torch.tensor([[996, 512, 0, 511], [-100, 996, 7, 600]])
    want = torch.nn.functional.cross_entropy(head(emb(ids)).reshape(-1, VOCAB), labels.reshape(-1))
    want.backward()
    vemb = VocabParallelEmbedding.from_full(emb, ctx)
    vhead = VocabParallelLMHead.from_full(head, ctx)
    local = vhead(vemb(ids))  # (B, T, 512), padded ids at -inf
    got = vocab_parallel_cross_entropy(local, labels, ctx.tp_group)
    got.backward()
    out = {"loss": (got.detach(), want.detach()),
           "logits": (gather_vocab_parallel_logits(local.detach(), ctx.tp_group, VOCAB), head(emb(ids)).detach())}
    for name, p, ref in (("emb", vemb.weight, emb.weight), ("head", vhead.weight, head.weight),
                         ("bias", vhead.bias, head.bias)):
        out[f"grad:{name}"] = (gather_full(p, ctx.tp_group, p.grad), ref.grad)
        out[f"weight:{name}"] = (gather_full(p, ctx.tp_group), ref.detach())
    pads = [padding_rows(t, ctx.tp_rank) for p in (vemb.weight, vhead.weight, vhead.bias)
            for t in (p.detach(), p.grad)]
    return {"pairs": out, "local_shape": tuple(local.shape),
            "pad_rows": padding_rows(vemb.weight, ctx.tp_rank).shape[0],
            "pad_zero": all(bool((t == 0).all()) for t in pads),
            "pad_logits_inf": bool(torch.isneginf(padding_rows(local.detach().movedim(-1, 0), ctx.tp_rank)).all()),
            "shapes": (tuple(vemb.weight.shape), tuple(vhead.weight.shape), tuple(vhead.bias.shape))}


__all__ = ["padded_oracle", "padded_layers", "CONFIG", "VOCAB", "PADDED"]
