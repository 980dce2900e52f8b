"""Tiny random HF models and the rank functions of tests/test_hf.py (importable by spawned ranks).

Every model is built from a config in code (no hub, no network), fp32, with dropout off so that
training is deterministic. Each rank seeds identically and builds its own copies.
"""

from __future__ import annotations

import torch

from mp_toolkit.engine.pipeline import PipelineEngine
from mp_toolkit.hf.adapters import from_hf, hf_name_map
from mp_toolkit.hf.common import layer_state_dict
from mp_toolkit.hf.losses import causal_lm_loss, masked_lm_loss, pretraining_loss
from mp_toolkit.hf.tp_plans import apply_hf_tensor_parallel
from mp_toolkit.parallel.context import build_context
from mp_toolkit.parallel.tensor_parallel import gather_full, gather_vocab_parallel_logits
from tests.floor import pair
from tests.oracle_workers import OPTIMIZERS

# 200 ids: at tp = 2 the vocabulary is padded to 256 and both ranks hold real rows (0..127 and
# 128..199 + 56 padding rows); with 128 every real row would sit on rank 0.
VOCAB, SEQ = 200, 12
_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
_LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, **_IDS)
CONFIGS = {  # name: (transformers config class, model class, config kwargs)
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=4, n_head=4,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_IDS)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA),
    # window 4 < SEQ: the sliding-window mask differs from the causal one
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_LLAMA, sliding_window=4)),
    # layers 2 and 3 slide, 0 and 1 are full: per-layer masks
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_LLAMA, use_sliding_window=True, sliding_window=4,
                                                      max_window_layers=2)),
    "bert-pretraining": ("BertConfig", "BertForPreTraining", dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
}
CONFIGS["bert-mlm"] = (CONFIGS["bert-pretraining"][0], "BertForMaskedLM", CONFIGS["bert-pretraining"][2])
CAUSAL = ("gpt2", "llama", "mistral", "qwen2")


def tiny_config(name: str, attn: str = "sdpa", **overrides):
    import transformers

    config_cls, _, kwargs = CONFIGS[name]
    return getattr(transformers, config_cls)(**(kwargs | overrides), attn_implementation=attn)


def tiny_hf(name: str, attn: str = "sdpa", seed: int = 0, train: bool = False, **overrides):
    """A random tiny HF model (same weights for the same seed), in eval mode unless ``train``."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, CONFIGS[name][1])(tiny_config(name, attn, **overrides))
    return model.train(train)


def causal_inputs(B: int = 3, T: int = SEQ, seed: int = 0, padded: bool = True):
    """(input_ids, attention_mask) (B, T); row 1 padded on the right, row 2 on the left."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if padded:
        mask[1, T - 4:] = 0
        mask[2, :3] = 0
        ids = torch.where(mask.bool(), ids, 0)
    return ids, mask


def train_batches(steps: int, m: int, B: int = 2, T: int = SEQ, seed: int = 0) -> list[list[tuple]]:
    """steps x m micro-batches ((input_ids, attention_mask), labels) in our convention: labels are
    the next tokens (pre-shifted); row 1 of odd micro-batches is right-padded, its padded targets -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for k in range(m):
            window = torch.randint(3, VOCAB, (B, T + 1), generator=g)
            ids, labels = window[:, :-1].clone(), window[:, 1:].clone()
            mask = torch.ones(B, T, dtype=torch.long)
            if k % 2:
                mask[1, T - 5:] = 0
                ids[1, T - 5:] = 0
                labels[1, T - 6:] = -100  # the last real position's target is padding too
            step.append(((ids, mask), labels))
        out.append(step)
    return out


# ---------------------------------------------------------------- tensor parallel (tp = world)

def tp_rank(rank: int, world: int, names):
    """Per model: TP forward/backward on this rank's shard next to the unsharded twin.

    Returns {name: (gathered logits, full logits, tp loss, full loss, max relative grad error,
    sharded parameter count, local shapes)}; gradients are compared as gathered full tensors.
    """
    ctx = build_context(pp=1, tp=world, dp=1)
    out = {}
    for name in names:
        full = from_hf(tiny_hf(name, train=True))
        sharded = apply_hf_tensor_parallel(from_hf(tiny_hf(name, train=True)), ctx)
        ids, mask = causal_inputs()
        labels = torch.where(mask.bool(), torch.roll(ids, -1, dims=1), -100)
        # the HF-callable list as HF's model is called; the sharded one (a plain LayerList) positionally
        full_logits, local = full(input_ids=ids, attention_mask=mask), sharded(ids, mask)
        loss_full, loss_tp = causal_lm_loss(full_logits, labels), causal_lm_loss(local, labels, ctx.tp_group)
        loss_full.backward()
        loss_tp.backward()
        full_params = dict(full.named_parameters())  # LayerList's names: layers.{index}.{path}
        worst, n_sharded = 0.0, 0
        for key, p in sharded.named_parameters():
            want = full_params[key].grad
            got = gather_full(p, ctx.tp_group, p.grad)
            n_sharded += int(getattr(p, "tensor_model_parallel", False))
            worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
        gathered = gather_vocab_parallel_logits(local.detach(), ctx.tp_group, VOCAB)  # (B, T, 256 -> 200): unpadded
        shapes = {k: tuple(t.shape) for k, t in layer_state_dict(sharded).items()
                  if k.startswith(("h.0.block.attn", "layers.0.block.self_attn"))}
        attn = sharded["h.0"].block.attn if name == "gpt2" else None
        local_sizes = (attn.split_size, attn.num_heads) if attn is not None else None
        # a tied pair (GPT-2's wte / lm_head) is still one Parameter: one vocab shard
        tied = bool(sharded.tie_groups) and len({id(sharded[layer].get_parameter(path))
                                                 for layer, path in sharded.tie_groups[0]}) == 1
        out[name] = (gathered, full_logits.detach(), loss_tp.item(), loss_full.item(), worst, n_sharded, shapes,
                     local_sizes, tied)
    return out


def bert_tp_rank(rank: int, world: int, names):
    """`tp_rank` for HF BERT (pre-training / MLM), with a feed-forward tp divides. Returns {name:
    (gathered MLM logits, full ones, tp loss, full loss, max relative grad error, facts)}."""
    ctx = build_context(pp=1, tp=world, dp=1)
    out = {}
    for name in names:
        full = from_hf(tiny_hf(name, train=True, intermediate_size=64))
        sharded = apply_hf_tensor_parallel(from_hf(tiny_hf(name, train=True, intermediate_size=64)), ctx)
        ids, mask = causal_inputs(seed=1)
        types = (torch.arange(SEQ) >= SEQ // 2).long().expand_as(ids)
        mlm = torch.where(mask.bool() & (torch.arange(SEQ) % 3 == 0), ids, -100)
        labels = (mlm, torch.tensor([0, 1, 0]))
        full_out, local_out = full(ids, mask, types), sharded(ids, mask, types)  # HF BERT's order
        if name == "bert-pretraining":
            loss_full, loss_tp = pretraining_loss(full_out, labels), pretraining_loss(local_out, labels, ctx.tp_group)
            full_out, local_out = full_out[0], local_out[0]
        else:
            loss_full, loss_tp = masked_lm_loss(full_out, mlm), masked_lm_loss(local_out, mlm, ctx.tp_group)
        loss_full.backward()
        loss_tp.backward()
        full_params, worst = dict(full.named_parameters()), 0.0
        for key, p in sharded.named_parameters():
            if key.endswith("key.bias"):  # exact gradient 0 (softmax ignores a shift of all scores): both are noise
                continue
            want, got = full_params[key].grad, gather_full(p, ctx.tp_group, p.grad)
            worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
        pred = sharded["heads"].cls.predictions
        facts = {
            "bias_is_decoder_bias": pred.bias is pred.decoder.bias,
            "tied": pred.decoder.weight is sharded["embeddings"].embeddings.word_embeddings.weight,
            "shapes": {k: tuple(t.shape) for k, t in layer_state_dict(sharded).items()
                       if k.startswith("encoder.layer.0.block.attention") or "predictions" in k},
            "sharded": sum(int(getattr(p, "tensor_model_parallel", False)) for p in sharded.parameters()),
        }
        out[name] = (gather_vocab_parallel_logits(local_out.detach(), ctx.tp_group, VOCAB), full_out.detach(),
                     loss_tp.item(), loss_full.item(), worst, facts)
    return out


# ---------------------------------------------------------------- pipeline (pp = world) vs HF

def hf_reference(name: str, batches, overrides: dict, optimizer: str = "adamw", dtype=torch.float32,
                 by_row: bool = False):
    """Single-process gradient accumulation on the HF model itself: same micro-batches, same optimizer.
    In float64 (the same initial values, widened) it is tests/floor.py's reference. ``by_row`` runs
    each micro-batch one sequence at a time, each row's token losses summed and divided by the
    micro-batch's token count: the same mean loss and gradient, summed in another order."""
    model = tiny_hf(name, train=True, **overrides).to(dtype)
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    losses = []
    for step in batches:
        total = torch.zeros((), dtype=dtype)
        for (ids, mask), labels in step:
            if by_row:
                count = (labels != -100).sum()
                for r in range(len(ids)):
                    row = (slice(r, r + 1),)
                    loss = causal_lm_loss(model(input_ids=ids[row], attention_mask=mask[row]).logits, labels[row])
                    loss = loss * (labels[row] != -100).sum() / count / len(step)
                    loss.backward()
                    total += loss.detach()
                continue
            loss = causal_lm_loss(model(input_ids=ids, attention_mask=mask).logits, labels) / len(step)
            loss.backward()  # invariant 5: the loss, not the gradient, is scaled
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item())
    return model.state_dict(), losses


def pp_rank(rank: int, world: int, cases, steps: int = 2, m: int = 3):
    """Per (name, config overrides): this rank's stage after ``steps`` 1F1B steps vs the HF reference.

    The cut falls in the middle of the blocks (4 blocks: stage 0 = embedding + 2 blocks), so the
    padding mask (and for Llama the position ids) cross the boundary. Returns per case: (tensors
    compared, not bitwise equal, max |difference|, pipeline losses, reference losses, and
    `_floors` against a float64 HF run where the embedding is tied, which agrees to rounding only;
    None where the stages must be bitwise equal).
    """
    report = []
    for name, overrides in cases:
        batches = train_batches(steps, m)
        ref_state, ref_losses = hf_reference(name, batches, overrides)
        model = tiny_hf(name, train=True, **overrides)
        hf_names = hf_name_map(model)
        layers = from_hf(model)
        boundaries = [0, 3, len(layers)]  # [embed, block 0, block 1] | [block 2, block 3, norm, lm_head]
        engine = PipelineEngine(layers, build_context(world), boundaries, m, "1f1b",
                                optimizer=OPTIMIZERS["adamw"], loss_fn=causal_lm_loss)
        losses = [engine.train_batch(iter(step)).loss for step in batches]
        n, unequal, diff = 0, 0, 0.0
        for key, p in engine.named_parameters():
            want = ref_state[hf_names[key][0]]
            n += 1
            unequal += int(not torch.equal(p.detach(), want))
            diff = max(diff, (p.detach() - want).abs().max().item())
        tied = model.config.tie_word_embeddings
        floors = _floors(engine, lambda p: p, hf_names, (ref_state, ref_losses), losses,
                         hf_reference(name, batches, overrides, dtype=torch.float64)) if tied else None
        report.append((n, unequal, diff, losses, ref_losses, floors))
    return report


def _floors(engine, full, hf_names, ref32, losses, ref64, other32=None) -> dict:
    """{parameter name: (err, floor)} and "losses": tests/floor.py's pair of every parameter of this
    rank (``full`` gathers a shard) and of the losses, against the float64 HF reference. ``other32``:
    a second valid fp32 reference (`hf_reference` ``by_row``); the floor is then the larger of the
    two fp32 runs' errors."""
    (state32, losses32), (state64, losses64) = ref32, ref64

    def floored(got, name=None):
        ref, single = (losses64, losses32) if name is None else (state64[name], state32[name])
        err, floor = pair(got, ref, single)
        if other32 is not None:
            floor = max(floor, pair(other32[1] if name is None else other32[0][name], ref, single)[0])
        return err, floor

    out = {key: floored(full(p), hf_names[key][0]) for key, p in engine.named_parameters()}
    out["losses"] = floored(losses)
    return out


# ---------------------------------------------------------------- pipeline x tensor (pp = 2, tp = 2) vs HF

def pp_tp_rank(rank: int, world: int, cases, steps: int = 2, m: int = 3):
    """Per (model, optimizer name of OPTIMIZERS): 2 pipeline stages x 2 tensor-parallel shards,
    ``steps`` 1F1B steps with the vocab-parallel loss, against single-process accumulation on the
    HF model (`hf_reference`).

    Cut after the second block as in `pp_rank`, so the mask (and Llama's position ids, from which
    each block recomputes its rotary cos / sin) cross the boundary between sharded stages. Returns
    per case: (tensors compared, max |got - ref| over their elements (gathered over tp), losses,
    reference losses, `_floors` against the float64 HF reference).
    """
    import functools

    ctx = build_context(pp=2, tp=world // 2, dp=1)
    report = []
    for name, optimizer in cases:
        batches = train_batches(steps, m)
        ref_state, ref_losses = hf_reference(name, batches, {}, optimizer)
        model = tiny_hf(name, train=True)
        hf_names = hf_name_map(model)
        layers = apply_hf_tensor_parallel(from_hf(model), ctx)
        engine = PipelineEngine(layers, ctx, [0, 3, len(layers)], m, "1f1b", optimizer=OPTIMIZERS[optimizer],
                                loss_fn=functools.partial(causal_lm_loss, tp_group=ctx.tp_group))
        losses = [engine.train_batch(iter(step)).loss for step in batches]
        n, diff = 0, 0.0
        for key, p in engine.named_parameters():
            n += 1
            diff = max(diff, (gather_full(p, ctx.tp_group) - ref_state[hf_names[key][0]]).abs().max().item())
        floors = _floors(engine, lambda p: gather_full(p, ctx.tp_group), hf_names, (ref_state, ref_losses), losses,
                         hf_reference(name, batches, {}, optimizer, dtype=torch.float64),
                         hf_reference(name, batches, {}, optimizer, by_row=True))
        report.append((n, diff, losses, ref_losses, floors))
    return report
