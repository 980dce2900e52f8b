"""The planner's memory against what runs keep (issue 20): kept bytes per layer family against what
autograd keeps, and static bytes per parameter against a measured optimizer step (at the end).

Every layer of each family's model is run on its real input in training mode and the tensors it
saves for backward are counted with `torch.autograd.graph.saved_tensors_hooks`, one count per
storage, parameters excluded (`mp_toolkit.partition.measure.measure_layers`). The cost model
(`mp_toolkit.partition.cost.layer_costs`) must agree within 5% for every layer, in fp32, bf16 and
fp16, with dropout 0 and 0.1 where the family has dropout: model_zoo's GPT and BERT, and
transformers' GPT-2, BERT, Llama, Mistral and Qwen2 built from their own modules (`from_hf`). The
last layer is left out where its loss is not the one the run applies (HF heads, BERT's heads);
model_zoo GPT's LM head is checked with its loss, as the pipeline's last stage runs it.
These are CPU kernels' figures: on CPU attention with dropout falls back to the math kernel
(fp32 (heads, s, s) tensors), and dropout keeps masks in the activation dtype.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model_zoo.bert import BertConfig, BertForPreTraining
from model_zoo.gpt import GPT, PRESETS, GPTConfig, lm_loss
from mp_toolkit.hf.adapters import from_hf
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.master import PRECISIONS
from mp_toolkit.partition.cost import bytes_per_param, layer_costs, shape_from_hf_config, step_bytes_per_param
from mp_toolkit.partition.measure import measure_layers
from mp_toolkit.partition.planner import PlanRequest, make_plan
from tests.cli_helpers import assert_one_line_exit_2

transformers = pytest.importorskip("transformers")

B, S, VOCAB = 2, 32, 300
TOLERANCE = 0.05
HF = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64), "gpt2"),
    "bert": ("BertConfig", "BertForPreTraining", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                      intermediate_size=96), "bert"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, intermediate_size=96), None),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                                            num_key_value_heads=2, intermediate_size=80), None),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, intermediate_size=96,
                                                      tie_word_embeddings=True), None),
}
DROPOUT_KEYS = {"gpt2": ("attn_pdrop", "resid_pdrop", "embd_pdrop"),
                "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob")}


def kept(layers: LayerList, dtype: str, loss_fn=None, labels=None, ids=None) -> list:
    torch.manual_seed(0)
    layers = layers.to(PRECISIONS[dtype])
    layers.train()
    ids = torch.randint(0, VOCAB, (B, S)) if ids is None else ids
    return measure_layers(layers, ids, loss_fn, labels, warmup=0, repeats=1, microbatches=1)


def assert_agree(measured, planned, skip_last: bool) -> None:
    pairs = list(zip(measured, planned))
    assert [m.name for m, _ in pairs] == [p.name for _, p in pairs]
    for m, p in pairs[:-1] if skip_last else pairs:
        assert p.activation_bytes == pytest.approx(m.activation_bytes, rel=TOLERANCE), (
            m.name, m.activation_bytes, p.activation_bytes)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gpt_with_and_without_dropout(dtype, dropout):
    """model_zoo's GPT, every layer including the LM head with its loss; at dropout 0.1 a block keeps
    about 1.9x (fp32) to 2.8x (bf16) what it keeps at 0: the math kernel's fp32 (heads, s, s) tensors."""
    config = GPTConfig(**{**PRESETS["gpt-tiny"].to_dict(), "attn_pdrop": dropout, "resid_pdrop": dropout,
                          "embd_pdrop": dropout})
    ids = torch.randint(0, config.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(1))
    measured = kept(LayerList.from_model(GPT(config)), dtype, lambda y, t: lm_loss(y.float(), t), ids[:, 1:],
                    ids[:, :-1].contiguous())
    planned = layer_costs(shape_from_hf_config({"model_type": "gpt2", **config.to_dict()}), B, S, dtype)
    assert_agree(measured, planned, skip_last=False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_model_zoo_bert(dtype, dropout):
    d = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
             hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    measured = kept(LayerList.from_model(BertForPreTraining(BertConfig(**d))), dtype)
    assert_agree(measured, layer_costs(shape_from_hf_config({"model_type": "bert", **d}), B, S, dtype), skip_last=True)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("family,dropout", [("gpt2", 0.0), ("gpt2", 0.1), ("bert", 0.0), ("bert", 0.1),
                                            ("llama", 0.0), ("mistral", 0.0), ("qwen2", 0.0)])
def test_hf_layers(family, dropout, dtype):
    """transformers' own modules (``mpt train --hf``): HF GPT-2's composed gelu_new, HF RMSNorm's
    fp32 copies (Llama, Mistral, Qwen2), HF's default dropout 0.1 when the config does not say."""
    config_cls, model_cls, kwargs, drop_family = HF[family]
    kwargs = {**kwargs, "vocab_size": VOCAB}
    if drop_family is not None:
        kwargs.update({k: dropout for k in DROPOUT_KEYS[drop_family]})
    config = getattr(transformers, config_cls)(**kwargs)
    measured = kept(from_hf(getattr(transformers, model_cls)(config)), dtype)
    shape = shape_from_hf_config(json.loads(config.to_json_string()), hf_modules=True)
    assert_agree(measured, layer_costs(shape, B, S, dtype), skip_last=True)


def test_absent_dropout_keys_mean_each_implementations_default():
    """HF GPT2Config's absent pdrop keys are 0.1; model_zoo's GPTConfig reads them as 0."""
    d = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}
    hf, zoo = shape_from_hf_config(d, hf_modules=True), shape_from_hf_config(d)
    assert (hf.attn_dropout, hf.hidden_dropout, hf.embd_dropout) == (0.1, 0.1, 0.1)
    assert (zoo.attn_dropout, zoo.hidden_dropout, zoo.embd_dropout) == (0.0, 0.0, 0.0)
    block = lambda shape: layer_costs(shape, 1, 1024)[1].activation_bytes  # noqa: E731
    assert block(hf) > 5 * block(zoo)  # distilgpt2-like at s=1024: the fp32 (heads, s, s) tensors dominate


# -- static bytes per parameter against a measured optimizer step ----------------------------------------

PRECISIONS_MEASURED, OPTIMIZERS_MEASURED = ("fp32", "bf16", "fp16"), ("adamw", "lamb", "sgd")


@pytest.fixture(scope="module")
def measured_steps() -> dict:
    """`tests/static_bytes_workers.py` in its own process, every precision x optimizer pair."""
    out = subprocess.run([sys.executable, "-m", "tests.static_bytes_workers", ",".join(PRECISIONS_MEASURED),
                          ",".join(OPTIMIZERS_MEASURED)], capture_output=True, text=True, timeout=280,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {(r["precision"], r["optimizer"]): r for r in rows}


@pytest.mark.parametrize("precision", PRECISIONS_MEASURED)
@pytest.mark.parametrize("optimizer", OPTIMIZERS_MEASURED)
def test_static_and_step_bytes_match_a_measured_step(measured_steps, precision, optimizer):
    """What the planner charges per parameter (`bytes_per_param`: held from backward to the step;
    plus `step_bytes_per_param` at the step's peak) against a real step of our engine: bf16 + AdamW
    holds 16 B/param and peaks at 18, not the 20 + 8 the planner charged before."""
    r = measured_steps[(precision, optimizer)]
    static = bytes_per_param(precision, optimizer) * r["params"]
    assert static == pytest.approx(r["held"], rel=TOLERANCE)
    peak = (bytes_per_param(precision, optimizer) + step_bytes_per_param(precision, optimizer)) * r["params"]
    assert peak == pytest.approx(r["held"] + r["transient"], rel=TOLERANCE)


def test_mpt_plan_hf_counts_transformers_modules(tmp_path, capsys):
    """``mpt plan --hf``: the same GPT-2 config.json planned for transformers' modules keeps more (an
    absent attn_pdrop is HF's 0.1; gelu_new composed); presets and measuring are refused in one line."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 300,
                                "n_positions": 64}))
    zoo, hf = (make_plan(PlanRequest(model=str(path), pp=1, seq_len=64, tflops=1.0, hf=hf)) for hf in (False, True))
    assert hf.stages[0].memory_bytes > zoo.stages[0].memory_bytes
    assert_one_line_exit_2(capsys, ["plan", "--model", "gpt-tiny", "--hf", "--seq-len", "16"], "model_zoo preset")
    assert_one_line_exit_2(capsys, ["plan", "--model", path, "--hf", "--measure", "--seq-len", "16"],
                           "--hf plans from the cost model")
