"""The cost model against independent counts: torch's parameters, HF models, autograd's saved
tensors and torch's FLOP counter."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from model_zoo.gpt import GPT, PRESETS, lm_loss
from mp_toolkit.layers import LayerList
from mp_toolkit.partition.cost import (
    CostModelError,
    bytes_per_param,
    layer_costs,
    model_shape,
    total_parameters,
)
from mp_toolkit.partition.measure import measure_layers

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-small-cpu", "gpt2", "gpt2-xl"])
def test_gpt_preset_parameter_counts(name):
    with torch.device("meta"):
        model = GPT(PRESETS[name])
    assert total_parameters(model_shape(name)) == model.num_parameters()
    layers = LayerList.from_model(model)
    costs = layer_costs(model_shape(name), 1, 1)
    assert [c.name for c in costs] == list(layers.names)
    assert [c.params for c in costs] == layers.layer_parameter_counts()


HF = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=3, n_head=4, vocab_size=300, n_positions=64)),
    "bert": ("BertConfig", "BertForPreTraining", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                                      intermediate_size=96, vocab_size=300)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                                      num_key_value_heads=2, intermediate_size=96, vocab_size=300)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(hidden_size=64, num_hidden_layers=2,
                                                            num_attention_heads=8, num_key_value_heads=2,
                                                            intermediate_size=80, vocab_size=300)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, intermediate_size=96, vocab_size=300,
                                                      tie_word_embeddings=True)),
}


@pytest.mark.parametrize("family", sorted(HF))
def test_hf_config_parameter_counts_match_transformers(tmp_path, family):
    config_cls, model_cls, kwargs = HF[family]
    config = getattr(transformers, config_cls)(**kwargs)
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    assert total_parameters(model_shape(str(path))) == sum(p.numel() for p in model.parameters())
    assert model_shape(str(tmp_path)).hidden == 64  # a model directory works too


def test_bad_configs_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CostModelError, match="cannot read"):
        model_shape(str(bad))
    bad.write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(CostModelError, match="model_type 't5' is not supported"):
        model_shape(str(bad))
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(CostModelError, match="needs the key"):
        model_shape(str(bad))
    bad.write_text(json.dumps({"model_type": "gpt2", "n_embd": -3}))
    with pytest.raises(CostModelError, match="n_embd=-3 must be a positive integer"):
        model_shape(str(bad))
    with pytest.raises(CostModelError, match="unknown model"):
        model_shape("no-such-model")


@pytest.mark.parametrize("dtype,torch_dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_activation_bytes_equal_what_autograd_keeps(dtype, torch_dtype):
    torch.manual_seed(0)
    config = PRESETS["gpt-tiny"]
    layers = LayerList.from_model(GPT(config)).to(torch_dtype)
    b, s = 3, 16
    ids = torch.randint(0, config.vocab_size, (b, s + 1))
    measured = measure_layers(layers, ids[:, :-1].contiguous(), lambda y, t: lm_loss(y.float(), t), ids[:, 1:],
                              warmup=0, repeats=1)
    predicted = layer_costs(model_shape("gpt-tiny"), b, s, dtype)
    for m, p in zip(measured, predicted):
        assert m.name == p.name
        # the loss keeps one extra fp32 scalar; everything else is exact
        assert abs(m.activation_bytes - p.activation_bytes) <= 8, (m.name, m.activation_bytes, p.activation_bytes)
        assert m.forward_s > 0 and m.backward_s >= 0


def test_flops_match_torch_flop_counter():
    """torch's counter sees the matrix products (it has no formula for the CPU attention kernel);
    ours adds causal attention's lower triangle, 2 * b * s^2 * h for QK^T and PV together."""
    torch.manual_seed(0)
    config = PRESETS["gpt-tiny"]
    model = GPT(config)
    b, s, h = 2, 16, config.n_embd
    costs = {c.name: c for c in layer_costs(model_shape("gpt-tiny"), b, s)}
    x = torch.randn(b, s, h)
    for name, layer, arg in (("h.0", model.h[0], x), ("lm_head", model.lm_head, x)):
        with FlopCounterMode(display=False) as counter:
            layer(arg)
        full = counter.get_total_flops()
        attention = 2 * b * s * s * h if name == "h.0" else 0
        assert full > 0 and costs[name].flops_fwd == full + attention


def test_static_bytes_per_parameter():
    assert bytes_per_param("fp32", "adamw") == 16  # weight, grad, two moments
    assert bytes_per_param("bf16", "lamb") == 16   # bf16 weight and grad, fp32 master, two moments
    assert bytes_per_param("fp16", "sgd") == 12     # the fp32 master grad lives only in the step
    assert bytes_per_param("fp32", "lars") == 12
    with pytest.raises(CostModelError):
        bytes_per_param("fp32", "adafactor")


def test_tensor_parallel_divides_sharded_parts():
    one = layer_costs(model_shape("gpt2"), 1, 128)
    two = layer_costs(model_shape("gpt2"), 1, 128, tp=2)
    block1, block2 = one[1], two[1]
    h, f = 768, 3072
    assert block1.params - block2.params == (4 * h * h + 2 * h * f + 3 * h + f) // 2
    assert block2.flops_fwd == block1.flops_fwd / 2
    assert two[-1].params == one[-1].params // 2  # the vocabulary splits
