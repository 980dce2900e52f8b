"""Context parallelism (`mp_toolkit.parallel.context_parallel`): the zig-zag split and ring attention.

Ring attention on 2 and 4 ranks, its blocks by the CPU flash kernel and by their scores, and all-to-all
(Ulysses) attention equal one process's causal attention of the whole sequence
(``scaled_dot_product_attention``) on every rank's slice of the output and of the q, k, v gradients.
Tolerance (DESIGN.md invariant 10): both are fp32 computations of the same sums in another order,
so the ring's relative error against the float64 reference must lie within 8 x the single process's
own, measured in the same test (tests/floor.py).
"""

import json

import pytest
import torch

from mp_toolkit.parallel.context_parallel import zigzag_positions, zigzag_slice
from tests.cli_helpers import assert_one_line_exit_2
from tests.cp_workers import dropout_twins_rank, kept_rank, llama_twins_rank, ring_rank
from tests.dist_harness import run_world
from tests.floor import assert_all_within, assert_within, pair
from tests.mpt_command import run_mpt


def test_zigzag_split_balances_the_causal_work():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (2, 4):
        allowed = [int(sum(p + 1 for p in zigzag_positions(32, cp, r))) for r in range(cp)]
        assert len(set(allowed)) == 1  # every rank's queries see as many keys in all
        assert sorted(torch.cat([zigzag_positions(32, cp, r) for r in range(cp)]).tolist()) == list(range(32))
    x = torch.arange(2 * 8).reshape(2, 8)
    assert zigzag_slice(x, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    with pytest.raises(ValueError, match="multiple of 2 x cp = 4"):
        zigzag_positions(10, 2, 0)


@pytest.mark.parametrize("world,fused", [(2, True), (4, True), (2, False), (4, False), (2, "ulysses"),
                                         (4, "ulysses")])
def test_ring_attention_equals_whole_sequence_attention(world, fused):
    for report in run_world(ring_rank, world, fused, timeout_s=120):
        f32, f64 = report["torch.float32"], report["torch.float64"]
        for what, got, ref64, ref32 in zip(("output", "dq", "dk", "dv"), f32["got"], f64["ref"], f32["ref"]):
            assert_within(*pair(got, ref64, ref32), f"cp {world}: {what}")
        for got, ref in zip(f64["got"], f64["ref"]):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)], ids=["cp2", "tp2-sp-cp2"])
def test_dropout_masks_and_loss_shares_follow_the_whole_sequence(world, tp):
    """Hidden dropout under cp (and under sequence parallelism beside it) draws the single process's
    masks (`SliceDropout` on the zig-zag tokens, and their tp slice), and each rank's loss is its share
    of the labelled tokens (a sequence half unlabelled). The floor, measured in the same test: the same
    comparison without dropout (the split's reassociation alone; its loss share included). With the
    masks the single process's, dropout adds no difference of its own: within 8 x that floor (a wrong
    mask or share moves the loss by 1e-2, 10^4 x past it)."""
    for report in run_world(dropout_twins_rank, world, tp, timeout_s=120):
        plain, dropped = report["dropout 0.0"], report["dropout 0.1"]
        floor = max(plain["loss"], plain["grad"], 2.0**-24)
        assert dropped["loss"] <= 8 * floor and dropped["grad"] <= 8 * floor, report


def test_cp_flags_are_checked_in_one_line(capsys, tmp_path):
    base = ["train", "--data", "synthetic", "--steps", "1", "--pp", "1"]
    bad = [
        (["--model", "bert-tiny", "--cp", "2"], "BERT (its bidirectional, padded attention) cannot use it"),
        (["--model", "gpt-tiny", "--cp", "2", "--seq-len", "30"], "2 x cp = 4 (the zig-zag split), and 30 is not"),
        (["--model", "gpt-tiny", "--cp", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "36"],
         "2 x cp x tp = 8 (with --sequence-parallel)"),
        (["--model", "gpt-tiny", "--cp", "0"], "--cp 0 must be at least 1"),
        (["--model", "gpt-tiny", "--cp", "2", "--engine", "deepspeed"], "--cp 2 is ours"),
        (["--model", "gpt-tiny", "--cp", "4", "--tp", "2", "--cp-attention", "ulysses"],
         "cp x tp = 8 does not divide the 4 heads"),
    ]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"vocab_size": 256, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 4,
                                  "attn_pdrop": 0.1}))
    bad.append((["--model", str(config), "--cp", "2"], "attn_pdrop 0.1"))
    for args, mentions in bad:
        assert_one_line_exit_2(capsys, [*base, *args], mentions)


def test_mpt_train_at_cp_2_resumes_at_cp_1(tmp_path):
    """`mpt train --cp 2` over a 2-stage pipeline trains the single process's model (losses within tp's
    1e-5, tests/test_cli.py); a run at tp 2 with sequence parallelism x cp 2 saves a checkpoint of whole
    tensors at step 2, and a run at cp 1 without either resumes from it: its steps equal the
    uninterrupted cp 2 run's within the same 1e-5."""
    def losses(name, *extra):
        metrics = tmp_path / f"{name}.jsonl"
        r = run_mpt(["train", "--model", "gpt-tiny", "--data", "synthetic", "--steps", "4", "--microbatches", "2",
                     "--seq-len", "32", "--threads", "1", "--no-progress", "--metrics", metrics, *extra], timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()], r.stdout

    one, _ = losses("one", "--pp", "1")
    cp, _ = losses("cp", "--pp", "2", "--cp", "2")
    assert cp == pytest.approx(one, rel=1e-5)
    losses("a", "--pp", "1", "--tp", "2", "--sequence-parallel", "--cp", "2", "--steps", "2",
           "--save-dir", tmp_path / "ck")
    resumed, out = losses("b", "--pp", "1", "--save-dir", tmp_path / "ck", "--resume", "latest")
    assert "resumed from" in out and resumed == pytest.approx(cp[2:], rel=1e-5)


def test_kept_bytes_per_rank_equal_the_planners():
    """What each cp rank keeps per layer (saved-tensor hooks) against `layer_costs(..., cp=2)`,
    within 5% as tests/test_cost_families.py bounds the planner, and 1/cp of the cp 1 figures where
    the figure is per token."""
    from mp_toolkit.partition.cost import layer_costs, model_shape

    planned = layer_costs(model_shape("gpt-tiny"), 2, 32, "fp32", cp=2)
    for measured in run_world(kept_rank, 2, timeout_s=120):
        for cost in planned:
            got = measured[cost.name]
            assert abs(got - cost.activation_bytes) <= 0.05 * cost.activation_bytes, (cost.name, got, cost)
    whole = layer_costs(model_shape("gpt-tiny"), 2, 32, "fp32")
    assert planned[1].activation_bytes < whole[1].activation_bytes * 0.55  # a block keeps about half
    assert planned[1].output_bytes == whole[1].output_bytes // 2  # and sends half


def test_hf_llama_at_cp_2_equals_one_process():
    """HF Llama (grouped-query attention: 4 heads over 2 k/v heads; rotary positions from the zig-zag
    position ids) through HF's own decoder layers, the attention handed to the ring: the loss and the
    cp-averaged gradients within 8 x the fp32 single process's own error against float64 (tests/floor.py)."""
    for report in run_world(llama_twins_rank, 2, timeout_s=120):
        assert_within(*report["loss"], "cp 2 Llama: loss")
        assert_all_within(report["grads"], "cp 2 Llama: gradients")
