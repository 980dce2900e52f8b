"""Activation recomputation (`mp_toolkit.recompute`, issue 19).

* The oracle (DESIGN.md invariant 1): with dropout on, recomputing full blocks or only their
  attention core, under every schedule (ZB-H1's input / weight split included), trains bitwise the
  same parameters and losses as the same pipeline without recomputation (pp=2).
* With tensor or data parallelism, within the measured floor of the single process
  (tests/floor.py), through `build_engine` as `mpt train --recompute` composes it.
* Kept bytes, measured: what autograd keeps for the backward (saved-tensor hooks), full < selective
  < none, and the figures the planner uses for what each mode drops.
* The DeepSpeed keys (``pipeline.activation_checkpoint_interval``, ``activation_checkpointing``) read
  and applied; bad requests refused in one line.
"""

import dataclasses
import json

import pytest
import torch

from model_zoo.gpt import GPT, GPTConfig, lm_loss
from mp_toolkit.ds.config import read_ds_config
from mp_toolkit.engine.split_backward import split_backward_input
from mp_toolkit.layers import LayerList
from mp_toolkit.partition.cost import ModelShape
from mp_toolkit.partition.recompute import attention_core_bytes
from mp_toolkit.recompute import RecomputeError, apply_recompute, parse_layer_counts, stage_choices
from tests.cli_helpers import assert_one_line_exit_2
from tests.dist_harness import run_world
from tests.floor import assert_all_within, assert_within
from tests.mpt_command import run_mpt
from tests.oracle_tp_dp_workers import oracle_grid
from tests.oracle_workers import TINY
from tests.recompute_workers import dropout_config, kept_bytes, recompute_vs_none

PIPELINE_CASES = [  # (schedule, m, chunks, mode, counts)
    ("gpipe", 3, 1, "full", None), ("gpipe", 3, 1, "selective", None),
    ("1f1b", 3, 1, "full", None), ("1f1b", 3, 1, "selective", None), ("1f1b", 3, 1, "full", (1,)),
    ("zbh1", 3, 1, "full", None), ("zbh1", 3, 1, "selective", None), ("zbh1", 3, 1, "full", (1, 2)),
    ("zbdrain", 3, 1, "full", None), ("zbdrain", 3, 1, "selective", None),
    ("interleaved", 4, 2, "full", None), ("interleaved", 4, 2, "selective", (1, 0, 1, 0)),
    ("zbv", 3, 2, "full", None), ("zbv", 3, 2, "selective", (1, 0, 1, 0)),
    ("dualpipev", 4, 2, "full", None), ("dualpipev", 4, 2, "selective", None),
]


def test_recompute_is_bitwise_equal_to_none_with_dropout_under_every_schedule():
    reports = run_world(recompute_vs_none, 2, PIPELINE_CASES, timeout_s=400)
    for i, case in enumerate(PIPELINE_CASES):
        for rank, r in enumerate(reports):
            compared, unequal, same_losses, _ = r[i]
            assert compared > 0
            assert unequal == 0, f"{case}: {unequal} of {compared} tensors differ on rank {rank}"
            assert same_losses, f"{case}: losses differ on rank {rank}"


def test_recomputation_changes_what_dropout_draws_nowhere():
    """One block, both halves of ZB-H1's split: input and weight gradients bitwise equal to an
    unsplit backward without recomputation, and the random state after it unchanged."""
    cfg = dropout_config(n_layer=2)

    def grads(mode, split):
        torch.manual_seed(0)
        layers = LayerList.from_model(GPT(cfg, seed=1))
        apply_recompute(layers, [0, len(layers)], stage_choices(mode, None, 1))
        ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        h = layers.layers[0](ids[:, :-1]).detach().requires_grad_(True)
        loss = lm_loss(LayerList(list(zip(layers.names[1:], layers.layers[1:])))(h), ids[:, 1:])
        params = [p for layer in layers.layers[1:] for p in layer.parameters()]
        if split:
            (gin,), weight_pass = split_backward_input([loss], None, [h], params)
            assert weight_pass is not None
            weight_pass.run()
        else:
            loss.backward()
            gin = h.grad
        return [gin] + [p.grad for p in params], torch.rand(3)

    ref, after = grads("none", False)
    for mode in ("full", "selective"):
        for split in (False, True):
            got, rng = grads(mode, split)
            assert all(torch.equal(a, b) for a, b in zip(ref, got)), (mode, split)
            assert torch.equal(rng, after), (mode, split)


def test_weight_pass_recomputes_a_block_once():
    """ZB-H1's W runs one backward call per group of weights; a recomputed block is rebuilt once
    for all of them (torch's GraphExecGroup), not once per group."""
    if not hasattr(torch.utils.checkpoint, "GraphExecGroup"):
        pytest.skip("this torch recomputes once per weight group (no GraphExecGroup)")
    cfg = dropout_config(n_layer=1)
    layers = LayerList.from_model(GPT(cfg, seed=1))
    block = layers.layers[1]
    apply_recompute(layers, [0, len(layers)], stage_choices("full", None, 1))
    calls = []
    block.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    h = layers.layers[0](ids[:, :-1]).detach().requires_grad_(True)
    loss = lm_loss(LayerList(list(zip(layers.names[1:], layers.layers[1:])))(h), ids[:, 1:])
    _, weight_pass = split_backward_input([loss], None, [h], list(block.parameters()))
    assert len(calls) == 2  # the forward, and I's recomputation
    assert len(weight_pass.groups) > 1
    weight_pass.run()
    assert len(calls) == 3


@pytest.mark.parametrize("layout,case", [((1, 2, 1), ("1f1b", 3, False, 25.0, "full")),
                                         ((1, 2, 1), ("gpipe", 2, True, 25.0, "selective")),
                                         ((1, 1, 2), ("1f1b", 3, True, 25.0, "full")),
                                         ((1, 1, 2), ("gpipe", 2, False, 25.0, "selective"))])
def test_recompute_with_tp_or_dp_is_within_the_floor(layout, case):
    pp, tp, dp = layout
    cases = [case]
    results = run_world(oracle_grid, pp * tp * dp, pp, tp, dp, cases, timeout_s=400)
    ratios = []
    for i, case in enumerate(cases):
        for r in results:
            c = r["cases"][i]
            ratios.append(assert_within(*c["loss_err"], f"{layout} {case}: losses"))
            ratios.append(assert_all_within(c["errors"], f"{layout} {case}"))
            ratios.append(assert_all_within(c["grad_errors"], f"{layout} {case}: step-1 gradient"))
            assert all(c["dp_same"]) and all(c["tp_same"]), f"{layout} {case}: replicas diverged"
    print(f"\nworst err / floor: {max(ratios):.2f}")


def _one_block(**overrides) -> LayerList:
    cfg = dataclasses.replace(dropout_config(), **overrides)
    return LayerList([("h.0", GPT(cfg, seed=1).h[0])])


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_lowers_the_kept_bytes(dropout):
    """Measured with saved-tensor hooks, no timing: full keeps the block's input alone; selective
    drops the attention core's tensors, as the planner's `attention_core_bytes` counts them: the
    log-sum-exp of the fused kernel without dropout, the math kernel's a*s*s tensors with it."""
    b, s, h, a = 2, 16, TINY["n_embd"], TINY["n_head"]
    x = torch.randn(b, s, h, requires_grad=True)
    kept = {}
    for mode in ("none", "selective", "full"):
        block = _one_block(attn_pdrop=dropout, resid_pdrop=dropout)
        apply_recompute(block, [0, 1], stage_choices(mode, None, 1))
        torch.manual_seed(0)
        kept[mode] = kept_bytes(block, (x,), {"h.0"} if mode == "full" else set())
    assert kept["full"] == b * s * h * 4 < kept["selective"] < kept["none"]
    shape = ModelShape("gpt2", TINY["vocab_size"], h, 1, a, 4 * h, attn_dropout=dropout)
    assert kept["none"] - kept["selective"] == attention_core_bytes(shape, b, s, 4)
    if dropout:  # at least the probabilities
        assert kept["none"] - kept["selective"] >= b * a * s * s * 4


def test_stage_choices_and_refusals():
    assert parse_layer_counts("2") == (2,) and parse_layer_counts("1,0") == (1, 0)
    with pytest.raises(RecomputeError, match="--recompute-layers"):
        parse_layer_counts("x")
    with pytest.raises(RecomputeError, match="3 counts for 2 stages"):
        stage_choices("full", (1, 1, 1), 2)
    layers = LayerList.from_model(GPT(GPTConfig(**TINY), seed=1))
    chosen = apply_recompute(layers, [0, 3, 7], stage_choices("full", (1, 2), 2))
    assert chosen == {"h.0": "full", "h.2": "full", "h.3": "full"}
    assert layers["h.1"].recompute == "none" and not hasattr(layers["embed"], "recompute")
    plain = LayerList([("h.0", torch.nn.Linear(2, 2))])
    with pytest.raises(RecomputeError, match="no selective recomputation"):
        apply_recompute(plain, [0, 1], stage_choices("selective", None, 1))
    assert apply_recompute(plain, [0, 1], stage_choices("full", None, 1)) == {"h.0": "full"}


def _ds_file(tmp_path, **blocks):
    path = tmp_path / f"ds{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, **blocks}))
    return path


def test_deepspeed_keys_are_read_and_applied(tmp_path, capsys):
    """``pipeline.activation_checkpoint_interval`` turns full recomputation on in a real `mpt train`
    run; ``activation_checkpointing`` is honoured where it can be and refused in one line naming the
    key where not: ``partition_activations`` is a no-op at tp 1 (listed as not used) and refused at
    tp > 1, where it would split the kept inputs over the tensor-parallel ranks."""
    path = _ds_file(tmp_path, pipeline={"stages": 2, "activation_checkpoint_interval": 1},
                    activation_checkpointing={"partition_activations": True, "contiguous_memory_optimization": True})
    settings = read_ds_config(path)
    assert settings.train_config_overrides()["recompute"] == "full"
    inert = ("activation_checkpointing.contiguous_memory_optimization",
             "activation_checkpointing.partition_activations (a no-op at tp 1)")
    assert settings.ignored == inert
    off = _ds_file(tmp_path, activation_checkpointing={"partition_activations": False})
    assert read_ds_config(off, tp=2).ignored == ()  # false: nothing to note, at any tp
    assert read_ds_config(_ds_file(tmp_path, pipeline={"activation_checkpoint_interval": 0})).recompute is None
    out = run_mpt(["train", "--config", path, "--model", "gpt-tiny", "--seq-len", "16", "--steps", "1",
                   "--data", "synthetic", "--threads", "1", "--no-progress"], timeout=300)
    assert out.returncode == 0, out.stderr
    assert "--recompute full: stage 0: full x 2 of 2 blocks; stage 1: full x 2 of 2 blocks" in out.stdout
    assert f"keys not used by mp_toolkit: {', '.join(inert)}" in out.stdout
    for key, tp in (("partition_activations", "2"), ("cpu_checkpointing", "1")):
        bad = _ds_file(tmp_path, activation_checkpointing={key: True})
        assert_one_line_exit_2(capsys, ["train", "--config", bad, "--model", "gpt-tiny", "--tp", tp],
                               mentions=f"activation_checkpointing.{key} true is not supported")


def test_train_refuses_in_one_line(capsys):
    tiny = ["train", "--model", "gpt-tiny", "--seq-len", "16"]
    # --recompute auto without --memory-gb plans for the device's capacity (issue 36): only a cap nothing fits refuses
    assert_one_line_exit_2(capsys, tiny + ["--recompute", "auto", "--memory-gb", "0.0001"], mentions="too small")
    assert_one_line_exit_2(capsys, tiny + ["--recompute", "full", "--recompute-layers", "1,1,1"],
                           mentions="3 counts for 2 stages")
    assert_one_line_exit_2(capsys, tiny + ["--recompute-layers", "a"], mentions="--recompute-layers")
    assert_one_line_exit_2(capsys, tiny + ["--recompute", "full", "--engine", "deepspeed"],
                           mentions="--recompute full is ours")


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert-pretraining"])
def test_hf_layers_recompute_full_bitwise_and_refuse_selective(name, tmp_path, capsys):
    """HF adapters' layers take ``full`` like any layer (dropout on where the family has it), under an
    unsplit backward and under ZB-H1's split; ``selective`` is refused in one line, by the library and
    by `mpt train --hf`."""
    pytest.importorskip("transformers")
    from mp_toolkit.hf.adapters import from_hf
    from tests.hf_workers import causal_inputs, tiny_hf

    drop = {"gpt2": dict(resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1),
            "bert-pretraining": dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)}.get(name, {})

    def grads(mode, split):
        layers = from_hf(tiny_hf(name, train=True, **drop))
        apply_recompute(layers, [0, len(layers)], stage_choices(mode, None, 1))
        ids, mask = causal_inputs()
        torch.manual_seed(3)
        first = layers.layers[0](ids, mask) if name != "bert-pretraining" else layers.layers[0](ids, None, mask)
        hidden = first[0].detach().requires_grad_(True)
        rest = LayerList(list(zip(layers.names[1:], layers.layers[1:])))
        out = rest(hidden, *first[1:])
        loss = sum(o.float().square().mean() for o in (out if isinstance(out, tuple) else (out,)))
        params = [p for layer in layers.layers[1:] for p in layer.parameters()]
        if split:
            (gin,), weight_pass = split_backward_input([loss], None, [hidden], params)
            weight_pass.run() if weight_pass is not None else loss.backward(inputs=params)
        else:
            loss.backward()
            gin = hidden.grad
        return [gin] + [p.grad for p in params]

    ref = grads("none", False)
    for split in (False, True):
        assert all(torch.equal(a, b) for a, b in zip(ref, grads("full", split))), split
    layers = from_hf(tiny_hf(name))
    with pytest.raises(RecomputeError, match="--recompute selective: layer"):
        apply_recompute(layers, [0, len(layers)], stage_choices("selective", None, 1))
    if name == "gpt2":
        import transformers

        transformers.utils.logging.disable_progress_bar()  # save_pretrained's bar would reach capsys's stderr
        tiny_hf(name).save_pretrained(tmp_path / "hf")
        assert_one_line_exit_2(capsys, ["train", "--hf", tmp_path / "hf", "--pp", "1", "--seq-len", "16", "--data",
                                        "synthetic", "--recompute", "selective"],
                               mentions="has no selective recomputation")
