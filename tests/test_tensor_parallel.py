"""Tensor parallelism, sharded against unsharded (STYLE.md 10), on 2 gloo ranks.

Tolerance: fp32 with rtol 1e-5, atol 1e-6 for the layers and the loss. A shard computes the same
products as the full layer but sums them in another order (partial matmuls + all-reduce), so
agreement is to rounding, not bitwise. The whole-GPT gradients are compared with rtol 1e-5 and
an atol of 1e-5 times the tensor's largest entry, plus a relative Frobenius error <= 1e-5.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model_zoo.gpt import GPT, PRESETS, TP_PLAN
from mp_toolkit.layers import LayerList
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    check_tensor_parallel,
    shard_full,
    vocab_parallel_cross_entropy,
)
from tests.dist_harness import run_world
from tests.tp_workers import fairscale_checks, gpt_checks, layer_checks

RTOL, ATOL = 1e-5, 1e-6


def _close(pairs, prefix="", rtol=RTOL, atol=ATOL):
    picked = {k: v for k, v in pairs.items() if k.startswith(prefix)}
    assert picked, f"no results under {prefix!r}"
    for label, (got, want) in picked.items():
        assert got is not None and want is not None, label
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, label=label: f"{label}: {m}")


@pytest.fixture(scope="module")
def layers2():
    return run_world(layer_checks, 2, timeout_s=120)


@pytest.fixture(scope="module")
def gpt2ranks():
    return run_world(gpt_checks, 2, timeout_s=180)


@pytest.mark.parametrize("layer", ["column", "qkv", "column_gather", "row", "row_scatter", "embedding", "lm_head"])
def test_layer_matches_unsharded(layers2, layer):
    for rank_result in layers2:
        pairs = rank_result["pairs"]
        _close(pairs, f"{layer}/out")
        _close(pairs, f"{layer}/grad_")  # input grad, and each weight-grad shard == slice of full grad
        _close(pairs, f"{layer}/gather_", rtol=0, atol=0)  # gather_full(shard) is the full weight


def test_loss_matches_cross_entropy_with_ignore_index(layers2):
    for rank_result in layers2:
        for ignore in (-100, 3):
            _close(rank_result["pairs"], f"xent{ignore}/")
    # the ranks agree on the loss exactly (it is all-reduced)
    assert torch.equal(layers2[0]["pairs"]["xent-100/loss"][0], layers2[1]["pairs"]["xent-100/loss"][0])


def test_megatron_attributes(layers2):
    attrs = layers2[0]["attrs"]
    assert attrs["column.weight"] == (True, 0, 1, (6, 8))
    assert attrs["column.bias"] == (True, 0, 1, (6,))
    assert attrs["qkv.weight"] == (True, 0, 3, (12, 8))
    assert attrs["row.weight"] == (True, 1, 1, (8, 6))
    assert attrs["row.bias"] == (False, None, None, (8,))  # replicated, added once after the reduce
    assert attrs["embedding.weight"] == (True, 0, 1, (8, 6))
    assert attrs["lm_head.weight"] == (True, 0, 1, (8, 6))


def test_indivisible_sizes_are_named(layers2):
    errors = layers2[0]["errors"]
    assert "out_features = 9 is not divisible by tp = 2" in errors["column"]
    assert "out_features = 9 is not divisible by tp*3 = 6" in errors["qkv"]
    assert "in_features = 7 is not divisible by tp = 2" in errors["row"]


def test_gpt_tiny_tp2_matches_unsplit(gpt2ranks):
    for rank_result in gpt2ranks:
        pairs, facts = rank_result["pairs"], rank_result["facts"]
        _close(pairs, "loss")
        _close(pairs, "logits")
        _close(pairs, "weight:", rtol=0, atol=0)  # both runs start from identical weights
        grads = {k: v for k, v in pairs.items() if k.startswith("grad:")}
        assert len(grads) == 2 + 4 * 12 + 2 + 1  # embed (wte, wpe), 4 blocks, ln_f, the tied head again
        for label, (got, want) in grads.items():
            rel = ((got - want).norm() / want.norm()).item()
            assert rel <= 1e-5, f"{label}: relative error {rel:.2e}"
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=label)
        assert facts["names_match"] and facts["tied"] and facts["tie_members"] == 1
        assert facts["unique_params"] == facts["ref_unique_params"]  # tie is still one Parameter
        assert facts["qkv_local_shape"] == (48, 32)  # [q_r; k_r; v_r] of 2 heads x 8 dims, C = 32
        assert facts["local_logits_shape"] == (2, 16, 128)
        sharded = facts["sharded"]
        assert "embed.wte.weight" in sharded and "lm_head.weight" in sharded
        assert "h.0.attn.qkv.bias" in sharded and "h.3.mlp.fc.weight" in sharded
        assert "h.0.attn.proj.bias" not in sharded and "h.0.ln_1.weight" not in sharded
        assert "embed.wpe.weight" not in sharded
    assert torch.equal(gpt2ranks[0]["pairs"]["loss"][0], gpt2ranks[1]["pairs"]["loss"][0])


def test_fairscale_cross_check():
    pytest.importorskip("fairscale")
    for pairs in run_world(fairscale_checks, 2, timeout_s=120):
        _close(pairs, "column/weight", rtol=0, atol=0)  # same slice of the master weight
        _close(pairs, "qkv/weight", rtol=0, atol=0)  # Megatron's stride-3 split, as fairscale does it
        _close(pairs, "row/weight", rtol=0, atol=0)
        _close(pairs)


# ---------------------------------------------------------------- single process

def test_strided_shard_keeps_each_ranks_q_k_v():
    full = torch.arange(24.0).view(24, 1)  # rows of a fused (3C, .) weight with C = 8
    # tp = 2: chunks of 4 rows: q0 q1 k0 k1 v0 v1 -> rank 0 keeps [q0; k0; v0]
    assert shard_full(full, (0, 3), 0, 2).flatten().tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert shard_full(full, (0, 3), 1, 2).flatten().tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    assert shard_full(full, (0, 1), 1, 4).flatten().tolist() == [6, 7, 8, 9, 10, 11]
    replicated = nn.Parameter(torch.ones(3))
    assert shard_full(full, replicated, 1, 2) is full
    with pytest.raises(ValueError, match="not divisible by tp\\*stride = 5\\*3"):
        shard_full(full, (0, 3), 0, 5)


def test_check_tensor_parallel_messages():
    check_tensor_parallel(2, n_head=4, hidden=32, inner=128)
    with pytest.raises(ValueError, match=r"--tp 3 does not divide n_head=4: choose --tp in \[1, 2, 4\]"):
        check_tensor_parallel(3, n_head=4, hidden=32, inner=128)
    check_tensor_parallel(2, n_head=12, hidden=768)  # gpt2's vocab 50257 is padded, not checked
    with pytest.raises(ValueError, match="--tp 0 is not a positive integer"):
        check_tensor_parallel(0, n_head=4)


def test_tp1_is_identity():
    ctx = ParallelContext()  # tp = 1, tp_group None
    torch.manual_seed(0)
    layer_list = LayerList.from_model(GPT(PRESETS["gpt-tiny"]))
    before = {n: p.detach().clone() for n, p in layer_list.named_parameters()}
    assert apply_tensor_parallel(layer_list, ctx, TP_PLAN) is layer_list
    assert {n: p for n, p in layer_list.named_parameters()}.keys() == before.keys()
    assert not any(getattr(p, "tensor_model_parallel", False) for p in layer_list.parameters())
    # the layers themselves degrade to the unsharded computation with no communication
    lin, emb, x = nn.Linear(8, 12), nn.Embedding(10, 4), torch.randn(2, 8)
    torch.testing.assert_close(ColumnParallelLinear.from_full(lin, ctx, stride=3)(x), lin(x), rtol=0, atol=0)
    lin2 = nn.Linear(12, 8)
    torch.testing.assert_close(RowParallelLinear.from_full(lin2, ctx)(lin(x)), lin2(lin(x)), rtol=0, atol=0)
    ids = torch.tensor([[1, 9, 0]])
    torch.testing.assert_close(VocabParallelEmbedding.from_full(emb, ctx)(ids), emb(ids), rtol=0, atol=0)


def test_loss_on_one_process_is_cross_entropy():
    torch.manual_seed(1)
    logits, labels = torch.randn(3, 7, 11, requires_grad=True), torch.randint(0, 11, (3, 7))
    labels[1] = -100
    ref = copy.deepcopy(logits.detach()).requires_grad_(True)
    got = vocab_parallel_cross_entropy(logits, labels, None)
    want = F.cross_entropy(ref.reshape(-1, 11), labels.reshape(-1))
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(logits.grad, ref.grad, rtol=RTOL, atol=ATOL)


def test_bad_plans_name_the_problem():
    ctx = ParallelContext()
    layer_list = LayerList.from_model(GPT(PRESETS["gpt-tiny"]))
    with pytest.raises(ValueError, match="unknown style.*'attn.qkv': 'diagonal'"):
        apply_tensor_parallel(layer_list, ctx, {"attn.qkv": "diagonal"})
    with pytest.raises(ValueError, match=r"key\(s\) \['attn.c_attn'\] match no module"):
        apply_tensor_parallel(layer_list, ctx, {"attn.c_attn": "column"})
    with pytest.raises(ValueError, match="h.0.ln_1 is a LayerNorm; style 'row' needs an nn.Linear"):
        apply_tensor_parallel(layer_list, ctx, {"ln_1": "row"})
    with pytest.raises(ValueError, match="keys .* all match 'h.0.attn.proj'"):
        apply_tensor_parallel(layer_list, ctx, {"proj": "row", "attn.proj": "row"})
