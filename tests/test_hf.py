"""HF integration (mp_toolkit.hf): from_hf equals the HF forward bitwise, pp=2 training equals
single-process accumulation on the HF model, tp=2 equals unsharded, export round trips through
``from_pretrained``, and unsupported architectures get a one-line error.

Tiny random configs built here (tests/hf_workers.py), fp32, no hub access.
"""

import json

import pytest
import torch

from mp_toolkit.checkpoint import save_checkpoint, split_by_layer
from mp_toolkit.export.checkpoint import export_checkpoint
from mp_toolkit.export.hf_dir import export_hf, to_hf_state_dict
from mp_toolkit.hf.adapters import SUPPORTED, UnsupportedModelError, from_hf, hf_name_map
from mp_toolkit.hf.common import layer_state_dict
from mp_toolkit.hf.losses import causal_lm_loss, pretraining_loss, shift_labels
from mp_toolkit.hf.tp_plans import apply_hf_tensor_parallel, check_hf_tensor_parallel
from mp_toolkit.parallel.context import build_context
from tests.dist_harness import run_world
from tests.floor import assert_all_within
from tests.hf_workers import (
    CAUSAL,
    VOCAB,
    bert_tp_rank,
    causal_inputs,
    pp_rank,
    pp_tp_rank,
    tiny_config,
    tiny_hf,
    tp_rank,
)

torch.set_num_threads(1)


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same bits (NaN payloads and -0.0 included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.int32),
                                                                     b.contiguous().view(torch.int32))


def bert_inputs(padded=True):
    """(input_ids, attention_mask, token_type_ids): HF BERT's positional order."""
    ids, mask = causal_inputs(padded=padded)
    types = (torch.arange(ids.shape[1]) >= ids.shape[1] // 2).long().expand_as(ids).clone()
    return ids, mask, types


# --- from_hf: the same logits as HF, bit for bit ------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", CAUSAL)
def test_causal_lm_logits_bitwise_equal_hf(name, attn, padded):
    model = tiny_hf(name, attn)
    layers = from_hf(model)
    ids, mask = causal_inputs(padded=padded)
    with torch.no_grad():
        if padded:
            want, got = model(input_ids=ids, attention_mask=mask).logits, layers(input_ids=ids, attention_mask=mask)
            # the padding really reaches the blocks: row 2 (left padding) changes without its mask
            assert not torch.equal(model(input_ids=ids).logits[2], want[2])
        else:  # no mask at all on either side
            want, got = model(input_ids=ids).logits, layers(ids)
    assert got.shape == (3, 12, VOCAB)
    assert bitwise(got, want), f"max |diff| {(got - want).abs().max().item()}"


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["bert-pretraining", "bert-mlm"])
def test_bert_logits_bitwise_equal_hf(name, attn, padded):
    model = tiny_hf(name, attn)
    layers = from_hf(model)
    ids, mask, types = bert_inputs(padded)
    with torch.no_grad():
        ref, got = model(input_ids=ids, token_type_ids=types, attention_mask=mask), layers(ids, mask, types)
        if padded:  # bidirectional: the padding changes the real positions of row 1 too
            unmasked = model(input_ids=ids, token_type_ids=types)[0]
            assert not torch.equal(unmasked[1, :8], ref[0][1, :8])
    if name == "bert-pretraining":
        assert bitwise(got[0], ref.prediction_logits) and bitwise(got[1], ref.seq_relationship_logits)
        assert got[1].shape == (3, 2)
    else:
        assert bitwise(got, ref.logits)


# --- called as the HF model is called: HF's positional order, keywords, labels ----------------
def hf_calls(name):
    """[(description, args, kwargs)]: each way this HF model is called, with the same inputs."""
    ids, mask = causal_inputs()
    if name.startswith("bert"):
        types = bert_inputs()[2]
        labels = torch.where(mask.bool() & (torch.arange(ids.shape[1]) % 3 == 0), ids, -100)
        extra = {"next_sentence_label": torch.tensor([0, 1, 0])} if name == "bert-pretraining" else {}
        return [("positional", (ids, mask, types), {}),
                ("keywords", (), dict(input_ids=ids, attention_mask=mask, token_type_ids=types)),
                ("keywords, shuffled", (), dict(token_type_ids=types, input_ids=ids, attention_mask=mask)),
                ("positional + keyword", (ids,), dict(token_type_ids=types, attention_mask=mask)),
                ("positional, position ids", (ids, mask, types, torch.arange(12).flip(0)[None]), {}),
                ("labels", (), dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels, **extra))]
    hf_labels = torch.where(mask.bool(), ids, -100)
    calls = [("keywords", (), dict(input_ids=ids, attention_mask=mask)),
             ("keywords, shuffled", (), dict(attention_mask=mask, input_ids=ids)),
             ("keywords, position ids", (), dict(input_ids=ids, attention_mask=mask,
                                                 position_ids=torch.arange(3, 15).expand(3, 12))),
             ("labels", (), dict(input_ids=ids, attention_mask=mask, labels=hf_labels)),
             ("labels, positional", (ids,), dict(labels=hf_labels))]
    if name == "gpt2":  # HF's order: input_ids, cache, attention_mask, token_type_ids
        return calls + [("positional", (ids, None, mask), {}),
                        ("token types", (), dict(input_ids=ids, attention_mask=mask, token_type_ids=mask.flip(1)))]
    return calls + [("positional", (ids, mask), {})]  # Llama family: input_ids, attention_mask, position_ids


def as_tuple(out):
    """HF's return_dict=False tuple, or our return value, as a tuple of tensors."""
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("name", list(CAUSAL) + ["bert-pretraining", "bert-mlm"])
def test_layer_list_is_called_as_its_hf_model(name):
    """Every way of calling the HF model, applied to the layer list, gives HF's outputs (loss
    first with labels), bitwise; BERT's positional order is HF's (mask before token types)."""
    model = tiny_hf(name)
    layers = from_hf(model)
    calls = hf_calls(name)
    with torch.no_grad():
        for what, args, kwargs in calls:
            want = [t for t in model(*args, **kwargs, return_dict=False) if isinstance(t, torch.Tensor)]  # no cache
            got = as_tuple(layers(*args, **kwargs))
            assert len(got) == len(want), what
            assert all(bitwise(a, b) for a, b in zip(got, want)), (name, what)
    if name.startswith("bert"):  # the order matters: the old (ids, token types, mask) differs
        ids, mask, types = bert_inputs()
        with torch.no_grad():
            assert not torch.equal(as_tuple(layers(ids, types, mask))[0], as_tuple(layers(ids, mask, types))[0])


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert-pretraining"])
def test_layer_list_refuses_what_it_cannot_take(name):
    layers = from_hf(tiny_hf(name))
    ids, mask = causal_inputs()
    with pytest.raises(ValueError, match=r"does not take inputs_embeds"):
        layers(inputs_embeds=torch.zeros(3, 12, 32))
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'attn_mask'.*it takes .*forward's arguments"):
        layers(input_ids=ids, attn_mask=mask)
    if name == "gpt2":  # HF's second parameter is the cache: a mask given there is refused, not misread
        with pytest.raises(ValueError, match=r"does not take cache"):
            layers(ids, mask)
    if name == "bert-pretraining":  # HF silently computes no loss from labels alone; we say so
        with pytest.raises(ValueError, match=r"labels= and next_sentence_label= together"):
            layers(input_ids=ids, labels=ids)
    if name == "bert-pretraining":
        return
    with torch.no_grad():  # a cache asked for nothing (use_cache=False) is no cache
        assert bitwise(as_tuple(layers(input_ids=ids, use_cache=False))[0], as_tuple(layers(input_ids=ids))[0])


def test_layer_names_ties_and_shared_modules():
    gpt2, llama, bert = tiny_hf("gpt2"), tiny_hf("llama"), tiny_hf("bert-pretraining")
    g, ll, b = from_hf(gpt2), from_hf(llama), from_hf(bert)
    assert g.names == ("embed", "h.0", "h.1", "h.2", "h.3", "ln_f", "lm_head")
    assert ll.names == ("embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head")
    assert b.names == ("embeddings", "encoder.layer.0", "encoder.layer.1", "heads")
    assert g.tie_groups == ((("embed", "wte.weight"), ("lm_head", "weight")),)  # GPT-2 ties by default
    assert b.tie_groups == ((("embeddings", "embeddings.word_embeddings.weight"),
                             ("heads", "cls.predictions.decoder.weight")),)
    assert ll.tie_groups == () and from_hf(tiny_hf("gpt2", tie_word_embeddings=False)).tie_groups == ()
    assert from_hf(tiny_hf("llama", tie_word_embeddings=True)).tie_groups == (
        (("embed_tokens", "embed_tokens.weight"), ("lm_head", "weight")),)
    # HF's own modules, shared: the blocks are the model's, the LM head is the model's nn.Linear
    assert g["h.2"].block is gpt2.transformer.h[2] and g["lm_head"] is gpt2.lm_head
    assert ll["layers.3"].block is llama.model.layers[3] and ll["layers.0"].rotary_emb is llama.model.rotary_emb
    # int tensors travel between layers: (hidden, mask) and, for rotary models, position ids
    ids, mask = causal_inputs()
    hidden, passed, pos = ll["embed_tokens"](ids, mask)
    assert hidden.shape == (3, 12, 32) and passed is mask and pos.tolist() == [list(range(12))]
    assert g["embed"](ids)[1].tolist() == torch.ones(3, 12, dtype=torch.long).tolist()  # no mask: ones


@pytest.mark.parametrize("name", list(CAUSAL) + ["bert-pretraining", "bert-mlm"])
def test_hf_name_map_is_mechanical_and_round_trips(name):
    model = tiny_hf(name)
    names = hf_name_map(model)
    expected = {
        "gpt2": {"h.0.block.attn.c_attn.weight": ("transformer.h.0.attn.c_attn.weight",),
                 "embed.wte.weight": ("transformer.wte.weight", "lm_head.weight"),
                 "ln_f.norm.bias": ("transformer.ln_f.bias",)},
        "llama": {"layers.1.block.self_attn.k_proj.weight": ("model.layers.1.self_attn.k_proj.weight",),
                  "embed_tokens.embed_tokens.weight": ("model.embed_tokens.weight",),
                  "norm.norm.weight": ("model.norm.weight",), "lm_head.weight": ("lm_head.weight",)},
        "bert-pretraining": {"heads.pooler.dense.weight": ("bert.pooler.dense.weight",),
                             "heads.cls.predictions.decoder.bias": ("cls.predictions.bias",
                                                                    "cls.predictions.decoder.bias"),
                             "encoder.layer.1.block.output.dense.weight":
                                 ("bert.encoder.layer.1.output.dense.weight",)},
    }.get(name, {})
    for ours, theirs in expected.items():
        assert names[ours] == theirs
    for ours, theirs in names.items():  # the rule: drop the wrapper level, add the HF module's path
        assert all(t.split(".")[-1] == ours.split(".")[-1] for t in theirs), (ours, theirs)
    back = to_hf_state_dict(layer_state_dict(from_hf(model)), model)
    want = model.state_dict()
    assert sorted(back) == sorted(want) and all(bitwise(back[k], want[k]) for k in want)


def test_causal_lm_loss_is_hf_loss_with_pre_shifted_labels():
    model = tiny_hf("llama")
    ids, mask = causal_inputs()
    hf_labels = torch.where(mask.bool(), ids, -100)  # HF style: labels = input_ids, shifted inside
    ours = shift_labels(hf_labels)
    assert ours[:, :-1].tolist() == hf_labels[:, 1:].tolist() and ours[:, -1].tolist() == [-100] * 3
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, labels=hf_labels).loss
        got = causal_lm_loss(from_hf(model)(ids, mask), ours)  # Llama's order: (input_ids, attention_mask)
    assert bitwise(got, want)
    with pytest.raises(ValueError, match=r"already shifted"):
        causal_lm_loss(torch.zeros(2, 5, 7), torch.zeros(2, 4, dtype=torch.long))


# --- unsupported architectures -----------------------------------------------------------------
@pytest.mark.parametrize("arch", ["opt", "t5", "gpt2-base"])
def test_unsupported_architecture_is_a_one_line_error(arch):
    import transformers as tf

    if arch == "opt":
        model = tf.OPTForCausalLM(tf.OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                               num_attention_heads=2, max_position_embeddings=32,
                                               word_embed_proj_dim=16))
    elif arch == "t5":
        model = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                                          num_heads=2, decoder_start_token_id=0))
    else:
        model = tf.GPT2Model(tiny_config("gpt2"))  # the base model: no LM head
    with pytest.raises(UnsupportedModelError) as e:
        from_hf(model)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(type(model).__name__ + " is not supported")
    assert all(s in msg for s in SUPPORTED) and "LayerList([(name, module), ...], tie_groups)" in msg
    assert len(SUPPORTED) == 6 and isinstance(e.value, ValueError)


def test_tensor_parallel_sizes_are_checked_with_one_line_errors():
    check_hf_tensor_parallel(tiny_config("llama"), 2)
    for name in ("gpt2", "llama", "bert-pretraining", "bert-mlm"):  # tp = 1 validates the plan, returns the list
        layers = from_hf(tiny_hf(name))
        assert apply_hf_tensor_parallel(layers, build_context(1)) is layers
    with pytest.raises(ValueError, match=r"^--tp 2 does not divide inner=37: choose --tp in \[1\]$"):
        check_hf_tensor_parallel(tiny_config("bert-mlm"), 2)  # the vocabulary needs no check: it is padded
    with pytest.raises(ValueError, match=r"^--tp 4 does not divide num_key_value_heads=2: .* choose --tp in \[1, 2\]$"):
        check_hf_tensor_parallel(tiny_config("llama"), 4)
    with pytest.raises(ValueError, match=r"^--tp 3 does not divide n_head=4: choose --tp in \[1, 2, 4\]$"):
        check_hf_tensor_parallel(tiny_config("gpt2"), 3)


# --- tensor parallel: tp=2 vs unsharded ------------------------------------------------------
def test_tp2_equals_unsharded_for_gpt2_and_llama():
    """2 gloo ranks. Logits (gathered over the vocab shards), loss and every gradient (gathered
    into full tensors) agree with the unsharded layer list to 1e-5 relative to the largest
    value (fp32; measured ~3e-7 logits, ~6e-7 gradients): the row-parallel sums and the
    vocab-parallel softmax add in another order, so bitwise is not expected."""
    reports = run_world(tp_rank, 2, ["gpt2", "llama"], timeout_s=300)
    for rank_out in reports:
        for name, (gathered, full, loss_tp, loss_full, grad_err, n_sharded, shapes, sizes, tied) in rank_out.items():
            assert gathered.shape == full.shape == (3, 12, VOCAB)
            assert ((gathered - full).abs().max() / full.abs().max()).item() < 1e-5, name
            assert loss_tp == pytest.approx(loss_full, rel=1e-6) and grad_err < 1e-5, name
            if name == "gpt2":  # Conv1D layout kept: c_attn (C, 3C / tp), c_proj rows (C / tp, C)
                assert shapes["h.0.block.attn.c_attn.weight"] == (32, 48)
                assert shapes["h.0.block.attn.c_proj.weight"] == (16, 32)
                assert sizes == (16, 2) and tied  # local split_size and heads; wte / lm_head one shard
                # per block 4 Conv1D weights + 2 column biases (row biases replicated); wte
                assert n_sharded == 4 * 6 + 1
            else:  # GQA: 4 q heads -> 2, 2 k/v heads -> 1 per rank (head_dim 8)
                assert shapes["layers.0.block.self_attn.q_proj.weight"] == (16, 32)
                assert shapes["layers.0.block.self_attn.k_proj.weight"] == (8, 32)
                assert shapes["layers.0.block.self_attn.o_proj.weight"] == (32, 16)
                assert n_sharded == 4 * 7 + 2  # q k v o gate up down per block, embed, lm_head


def test_tp2_equals_unsharded_for_bert():
    """HF BERT's plan (query/key/value column, both output.dense row, intermediate column, word
    embedding and tied MLM decoder vocab-parallel, vocab 200 padded to 256): MLM logits gathered
    without the padding, the MLM (+ NSP) loss and every gradient agree with the unsharded layer
    list (fp32 reduction order; the tolerances of the GPT-2 / Llama test above)."""
    reports = run_world(bert_tp_rank, 2, ["bert-pretraining", "bert-mlm"], timeout_s=300)
    for rank_out in reports:
        for name, (gathered, full, loss_tp, loss_full, grad_err, facts) in rank_out.items():
            assert gathered.shape == full.shape == (3, 12, VOCAB)
            assert ((gathered - full).abs().max() / full.abs().max()).item() < 1e-5, name
            assert loss_tp == pytest.approx(loss_full, rel=1e-6) and grad_err < 1e-5, name
            assert facts["bias_is_decoder_bias"] and facts["tied"], name
            shapes = facts["shapes"]
            assert shapes["encoder.layer.0.block.attention.self.query.weight"] == (16, 32)  # 2 of 4 heads
            assert shapes["encoder.layer.0.block.attention.output.dense.weight"] == (32, 16)
            assert shapes["heads.cls.predictions.decoder.weight"] == (128, 32)  # 256 / 2 rows
            assert shapes["heads.cls.predictions.bias"] == (128,)
            # per layer q, k, v (weight, bias), 2 row weights, intermediate (weight, bias); word
            # embedding (= decoder weight) and the decoder's bias
            assert facts["sharded"] == 2 * 10 + 2, name


# --- pipeline: pp=2 1F1B vs single-process accumulation on the HF model --------------------------
def test_pp2_1f1b_equals_hf_gradient_accumulation():
    """2 gloo ranks, 2 AdamW steps of 3 micro-batches (padding in some), cut after the second of
    four blocks. Untied GPT-2 and Llama are bitwise equal to the HF model trained by plain
    accumulation (same ops in the same order; Llama's position ids and both masks cross the cut).
    GPT-2 with its tied embedding on both stages sums the two gradient halves in another order
    than one backward does: there every parameter tensor and the losses lie within `floor.K` times
    the fp32 HF run's own error against a float64 HF run (DESIGN.md invariant 10; AdamW's
    1/sqrt(v) magnifies the rounding by an amount that depends on the CPU's kernels)."""
    cases = [("gpt2", {"tie_word_embeddings": False}, "bitwise"), ("llama", {}, "bitwise"), ("gpt2", {}, "tied")]
    reports = run_world(pp_rank, 2, [c[:2] for c in cases], timeout_s=300)
    for i, (name, overrides, expect) in enumerate(cases):
        compared = sum(r[i][0] for r in reports)
        n_params = len(list(tiny_hf(name, **overrides).parameters()))
        assert compared == n_params + (expect == "tied")  # a tied weight is compared on both stages
        for n, unequal, diff, losses, ref_losses, floors in (r[i] for r in reports):
            if expect == "bitwise":
                assert unequal == 0, f"{name}: {unequal} of {n} tensors differ (max {diff})"
                assert losses == ref_losses and floors is None
            else:
                assert "losses" in floors and len(floors) == n + 1, sorted(floors)
                worst = assert_all_within(floors, f"{name} tied")
                print(f"\n{name} tied: worst err / floor {worst:.2f}")


# --- pipeline x tensor: pp=2 x tp=2 vs the HF model in one process ------------------------------
def test_pp2_tp2_equals_hf_single_process_training():
    """4 gloo ranks (stage 0: embedding + 2 blocks, stage 1: 2 blocks, norm, head; each split over 2
    tp ranks), 2 steps of 3 micro-batches with padding, vocab-parallel cross-entropy, against the
    HF model trained by plain accumulation in one process; every parameter gathered over tp.
    Tolerance (DESIGN.md invariant 10, tests/floor.py): every parameter tensor and the losses within
    `floor.K` times the larger error of two fp32 HF runs against a float64 HF run: the micro-batches
    as they come, and row by row (`hf_reference` ``by_row``: the same gradients summed in another
    order, as tensor parallelism sums them in another order). A fixed 1e-4 absolute held with 1.5x
    headroom on one CPU: AdamW divides a near-zero gradient, summed in another order, by its own
    square root (c_attn's key bias, whose exact gradient is 0, and the like). One fp32 run alone can
    land close to float64 where that happens: on an AVX-512 AMD EPYC (Zen 4) Llama's fp32 run erred
    2.5e-7 (median tensor) while tp = 2 and the row-by-row run erred 1e-5 to 1e-4 on the attention
    projections, one element each with a gradient of ~6e-8 (six times AdamW's eps) from cancellation."""
    cases = [(name, optimizer) for optimizer in ("sgd", "adamw") for name in ("gpt2", "llama")]
    reports = run_world(pp_tp_rank, 4, cases, timeout_s=300)
    for i, (name, optimizer) in enumerate(cases):
        n_params = len(list(tiny_hf(name).parameters()))
        # each tensor is compared on both tp ranks of its stage; GPT-2's tied weight on both stages
        assert sum(r[i][0] for r in reports) == 2 * (n_params + (name == "gpt2")), name
        for n, _diff, losses, _ref_losses, floors in (r[i] for r in reports):
            assert len(floors) == n + 1 and losses[0] != losses[1], (name, sorted(floors))
            worst = assert_all_within(floors, f"{name} {optimizer}")
            print(f"\n{name} {optimizer}: worst err / floor {worst:.2f}")


# --- export -------------------------------------------------------------------------------------
def one_step(name, layers):
    """One AdamW step on the layer list, so exported weights are not the initial ones."""
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-2)
    if name.startswith("bert"):
        ids, mask, types = bert_inputs()
        out = layers(ids, mask, types)
        mlm = torch.where(mask.bool(), ids, -100)
        loss = pretraining_loss(out, (mlm, torch.tensor([0, 1, 0]))) if name == "bert-pretraining" else \
            torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), mlm.reshape(-1))
    else:
        ids, mask = causal_inputs()
        loss = causal_lm_loss(layers(input_ids=ids, attention_mask=mask),
                              shift_labels(torch.where(mask.bool(), ids, -100)))
    loss.backward()
    opt.step()
    layers.eval()


def load_exported(name, path):
    import transformers as tf

    cls = {"bert-pretraining": tf.BertForPreTraining, "bert-mlm": tf.BertForMaskedLM}.get(name, tf.AutoModelForCausalLM)
    return cls.from_pretrained(path).eval()


def assert_same_logits(name, layers, loaded):
    with torch.no_grad():
        if name.startswith("bert"):
            ids, mask, types = bert_inputs()
            got, ref = layers(ids, mask, types), loaded(input_ids=ids, token_type_ids=types, attention_mask=mask)
            want = (ref.prediction_logits, ref.seq_relationship_logits) if name == "bert-pretraining" else (ref.logits,)
            got = got if isinstance(got, tuple) else (got,)
        else:
            ids, mask = causal_inputs()
            got = (layers(input_ids=ids, attention_mask=mask),)
            want = (loaded(input_ids=ids, attention_mask=mask).logits,)
    assert all(bitwise(a, b) for a, b in zip(got, want)) and len(got) == len(want)


def tiny_tokenizer(path):
    """A real (word-level) fast tokenizer built offline, saved with save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[PAD]", "the", "cat", "sat", "on", "mat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(path)
    return path


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "bert-pretraining", "bert-mlm"])
def test_export_round_trip_through_from_pretrained(name, tmp_path):
    from transformers import PreTrainedTokenizerFast

    model = tiny_hf(name, train=True)
    layers = from_hf(model)
    one_step(name, layers)
    tok = tiny_tokenizer(tmp_path / "tok")
    out = export_hf(layers, model.config, tmp_path / "hf", tokenizer_dir=tok)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    loaded = load_exported(name, out)
    assert type(loaded).__name__ == type(model).__name__
    assert_same_logits(name, layers, loaded)
    with torch.no_grad():  # the step changed the weights, so equality is not the initial model's
        fresh = tiny_hf(name)
        assert not torch.equal(next(fresh.parameters()), next(loaded.parameters()))
    # tokenizer files copied as they are (AutoTokenizer would pick Qwen2's class from config.json
    # for this word-level tokenizer, hence the explicit class)
    for f in tok.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes()
    assert PreTrainedTokenizerFast.from_pretrained(out)("the cat sat on the mat")["input_ids"] == [2, 3, 4, 5, 2, 6]


def test_export_from_a_checkpoint_with_the_config_in_its_manifest(tmp_path):
    """Checkpoint layers hold full tensors under LayerList names; a tied weight is stored once
    (under the layer that holds it first), and the HF config rides in the manifest's meta."""
    model = tiny_hf("gpt2", train=True)
    layers = from_hf(model)
    one_step("gpt2", layers)
    named, seen = {}, set()
    for key, t in layer_state_dict(layers, keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            named[key] = t.detach().clone()
    assert "lm_head.weight" not in named  # the tie is stored as embed.wte.weight only
    save_checkpoint(tmp_path / "ckpt", 7, split_by_layer(named, layers.names),
                    manifest={"hf_config": json.loads(model.config.to_json_string())})
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert_same_logits("gpt2", layers, load_exported("gpt2", out))
    with pytest.raises(ValueError, match=r"gather tensor-parallel shards"):
        export_hf({**named, "h.0.block.attn.c_attn.weight": named["h.0.block.attn.c_attn.weight"][:, :48]},
                  model.config, tmp_path / "bad")
