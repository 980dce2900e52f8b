"""Sequence parallelism (`mp_toolkit.parallel.sequence_parallel`, ``--sequence-parallel``).

The twins (tests/sp_workers.py): each model -- our GPT and BERT, HF GPT-2, Llama and BERT -- built
three times from the same weights: unsplit in one process, and on a tp = 2 group tensor parallel and
tensor + sequence parallel; one forward and backward on the same batch from the same random state,
dropout on where the model has it (the hidden dropouts; attention dropout stays off: its masks over
local heads are plain tp's business). What must hold:

* the hidden state between layers holds T / tp of the tokens;
* the loss is bitwise the plain tp run's: every token's values are computed by the same kernels on
  the same operands, the row-parallel sums are the same two-term sums, and `SequenceDropout` draws
  the very masks ``nn.Dropout`` draws on the whole tensor;
* the gradients: where one projection reads the gathered input (fused qkv: our GPT, HF GPT-2) every
  gradient tp shards, and every replicated one outside the split region, is bitwise the plain tp
  run's (the all-gather's backward reduce-scatters the very two-term sums ``f`` all-reduced). Where
  several do (separate q, k, v; Llama's gate and up) plain tp all-reduces each projection's partial
  input gradient and adds the results, sequence parallelism adds them first and reduce-scatters the
  sum: the same terms associated otherwise. Those, and the partial gradients (norms, row-parallel
  biases) summed over tp, must lie within 4 x the floor: the largest relative difference between
  the plain tp run and the unsplit run, measured in the same test on the same kernels.

The training oracle (pp x tp x dp cells against one process and its float64 floor) is in
tests/test_oracle_tp_dp.py.
"""

import dataclasses
import json

import pytest
import torch

from mp_toolkit.layers import LayerList
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.sequence_parallel import apply_sequence_parallel
from tests.cli_helpers import assert_one_line_exit_2
from tests.dist_harness import run_world
from tests.mpt_command import run_mpt
from tests.sp_workers import MODELS, T, dropout_rank, kept_rank, twins_rank


def test_sequence_dropout_keeps_its_slice_of_the_whole_mask():
    for report in run_world(dropout_rank, 2, timeout_s=120):
        assert report == {"equal": True, "same_state": True, "eval_identity": True, "kept_slice_only": True}


@pytest.fixture(scope="module")
def twins():
    reports = run_world(twins_rank, 2, list(MODELS), timeout_s=300)
    return {name: [r[name] for r in reports] for name in MODELS}


FUSED = ("gpt", "hf-gpt2")  # one projection reads each gathered input


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", list(MODELS))
def test_sequence_parallel_equals_plain_tensor_parallel(twins, name):
    worst = []
    for one, plain, sp in twins[name]:
        assert plain["hidden"][1] == T and sp["hidden"][1] == T // 2
        assert torch.equal(plain["loss"], sp["loss"]), (plain["loss"].item(), sp["loss"].item())
        assert plain["grads"].keys() == sp["grads"].keys() == one["grads"].keys()
        assert plain["sharded"] == sp["sharded"]
        assert sp["partial"] and not sp["partial"] & sp["sharded"] and not plain["partial"]
        floor = max(_relative(plain["grads"][k], one["grads"][k]) for k in one["grads"])
        assert floor > 0  # tp reassociates the matmul sums: a floor of zero would bound nothing
        outside = set(sp["grads"]) - sp["partial"]
        for key in sp["grads"]:
            err = _relative(sp["grads"][key], plain["grads"][key])
            if name in FUSED and key in outside:
                assert err == 0, (key, err)
            assert err <= 4 * floor, (key, err, floor)
            worst.append(err / floor)
    assert (twins[name][0][2]["dropouts"] > 0) == (name != "hf-llama")  # Llama has no hidden dropout
    print(f"\n{name}: worst sp-vs-tp gradient difference / tp-vs-unsplit floor: {max(worst):.3f}")


def test_the_partial_parameters_are_the_split_regions_replicated_ones(twins):
    _, _, sp = twins["gpt"][0]
    # LayerList names: layers.{index}.{path}; gpt-tiny: embed, h.0 .. h.3, ln_f, lm_head
    assert {"layers.1.ln_1.weight", "layers.1.attn.proj.bias", "layers.4.mlp.proj.bias", "layers.5.ln_f.bias"} \
        <= sp["partial"]
    assert not {"layers.0.wpe.weight", "layers.1.attn.qkv.bias"} & sp["partial"]
    _, _, sp = twins["bert"][0]
    assert "layers.1.attention.output.LayerNorm.weight" in sp["partial"]  # bert-tiny: embeddings, 4 layers, heads
    assert not any(k.startswith(("layers.0.", "layers.5.")) for k in sp["partial"])


def test_a_bad_plan_is_one_line_at_any_tp():
    layers, tp_plan, sp_plan, *_ = MODELS["gpt"]()
    one = ParallelContext()
    with pytest.raises(ValueError, match="unknown style"):
        apply_sequence_parallel(layers, one, {**sp_plan, "attn": "split"})
    with pytest.raises(ValueError, match=r"match no module"):
        apply_sequence_parallel(layers, one, {**sp_plan, "attn.nothing": "gather"})
    with pytest.raises(ValueError, match="needs an nn.Dropout"):
        apply_sequence_parallel(layers, one, {**sp_plan, "ln_1": "dropout"})
    assert isinstance(layers, LayerList)


def _refused(capsys, *args, mentions):
    assert_one_line_exit_2(capsys, ["train", "--data", "synthetic", "--steps", "1", "--model", "gpt-tiny", *args],
                           mentions)


def test_sequence_parallel_flags_are_checked_in_one_line(capsys):
    _refused(capsys, "--sequence-parallel", "--pp", "1", mentions="needs --tp 2 or more (got --tp 1)")
    _refused(capsys, "--sequence-parallel", "--pp", "1", "--tp", "2", "--seq-len", "31",
             mentions="multiple of --tp 2, and 31 is not")
    _refused(capsys, "--sequence-parallel", "--pp", "1", "--tp", "2", "--seq-len", "32", "--length-buckets", "15",
             mentions="15 is not")


def test_mpt_train_gpt_with_sequence_parallel_prints_the_plain_tp_losses(tmp_path):
    """Our GPT (fused qkv) under --tp 2 with and without --sequence-parallel, over a 2-stage
    pipeline (messages between stages hold half the tokens): the first step's loss bit for bit (the
    twins' reasoning), the later ones within tp's 1e-5 (tests/test_cli.py): the norms' gradients,
    summed over the tp ranks' halves of the tokens, round otherwise, and so does the step."""
    def losses(name, *extra):
        metrics = tmp_path / f"{name}.jsonl"
        r = run_mpt(["train", "--model", "gpt-tiny", "--data", "synthetic", "--steps", "3", "--microbatches", "3",
                     "--seq-len", "16", "--pp", "2", "--tp", "2", "--threads", "1", "--no-progress",
                     "--metrics", metrics, *extra], timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]

    plain, sp = losses("plain"), losses("sp", "--sequence-parallel")
    assert len(sp) == 3 and sp[0] == plain[0] and sp == pytest.approx(plain, rel=1e-5)


KEPT_CASES = [(family, sp, dropout) for family in ("gpt", "bert", "llama") for sp in (False, True)
              for dropout in ((0.0, 0.1) if family != "llama" else (0.0,))]


def test_kept_bytes_per_rank_equal_the_planners():
    """What each tp rank keeps per layer (saved-tensor hooks, `measure_layers`) against
    `layer_costs(..., tp=2, sp=...)`, within 5% as tests/test_cost_families.py bounds the planner:
    our GPT (dropout 0 and 0.1, its LM head with the vocab-parallel loss), our BERT and HF Llama
    (their heads left out: measured without the loss the run applies)."""
    from mp_toolkit.partition.cost import layer_costs, model_shape, shape_from_hf_config
    from tests.hf_workers import tiny_config

    reports = run_world(kept_rank, 2, KEPT_CASES, timeout_s=300)
    shapes = {"gpt": model_shape("gpt-tiny"), "bert": model_shape("bert-tiny"),
              "llama": shape_from_hf_config(tiny_config("llama").to_dict(), "llama", hf_modules=True)}
    ratios = {}
    for (family, sp, dropout), *measured in zip(KEPT_CASES, *reports):
        shape = dataclasses.replace(shapes[family], hidden_dropout=dropout, embd_dropout=dropout)
        planned = layer_costs(shape, 2, 32, "fp32", tp=2, sp=sp)
        check = planned if family == "gpt" else planned[:-1]
        for rank_measured in measured:
            for cost in check:
                got = rank_measured[cost.name]
                assert abs(got - cost.activation_bytes) <= 0.05 * cost.activation_bytes, (family, sp, dropout,
                                                                                          cost.name, got, cost)
        block = check[1].name
        ratios.setdefault((family, dropout), {})[sp] = measured[0][block]
    for (family, dropout), kept in ratios.items():  # the split parts are what moved
        assert kept[True] < kept[False], (family, dropout, kept)
