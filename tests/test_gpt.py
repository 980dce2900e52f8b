"""The single-device GPT: shapes, causality, tying, layer list, init, config handling."""
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from model_zoo import GPT, PRESETS, GPTConfig, get_config
from model_zoo.gpt import GPTBlock, GPTEmbedding, GPTLMHead, lm_loss

torch.set_num_threads(1)
TINY = PRESETS["gpt-tiny"]


@pytest.fixture
def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(TINY).eval()


def test_logits_shape_and_dtype(tiny):
    ids = torch.randint(0, TINY.vocab_size, (3, 17))
    logits = tiny(ids)
    assert logits.shape == (3, 17, TINY.vocab_size)
    assert logits.dtype == torch.float32


def test_changing_a_future_token_leaves_earlier_logits_unchanged(tiny):
    ids = torch.randint(0, TINY.vocab_size, (2, 20))
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] + 1) % TINY.vocab_size
    a, b = tiny(ids), tiny(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=0)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_tied_head_is_the_embedding_parameter(tiny):
    assert tiny.lm_head.weight is tiny.embed.wte.weight
    assert tiny.tie_groups() == [[("embed", "wte.weight"), ("lm_head", "weight")]]
    dict(tiny.named_layers())["lm_head"].weight.data[0, 0] = 123.0
    assert tiny.embed.wte.weight[0, 0].item() == 123.0


def test_untied_head_has_its_own_parameter():
    torch.manual_seed(0)
    untied = GPT(dataclasses.replace(TINY, tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.embed.wte.weight
    assert untied.tie_groups() == []
    head = TINY.vocab_size * TINY.n_embd
    assert untied.num_parameters() == GPT(TINY).num_parameters() + head
    assert untied.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_named_layers_order_and_types(tiny):
    names = [name for name, _ in tiny.named_layers()]
    assert names == ["embed", "h.0", "h.1", "h.2", "h.3", "ln_f", "lm_head"]
    layers = dict(tiny.named_layers())
    assert isinstance(layers["embed"], GPTEmbedding)
    assert isinstance(layers["h.3"], GPTBlock)
    assert isinstance(layers["lm_head"], GPTLMHead)
    # The tensor-parallel plan refers to these names.
    block = layers["h.0"]
    assert block.attn.qkv.weight.shape == (3 * TINY.n_embd, TINY.n_embd)
    assert block.attn.proj.weight.shape == (TINY.n_embd, TINY.n_embd)
    assert block.mlp.fc.weight.shape == (4 * TINY.n_embd, TINY.n_embd)
    assert block.mlp.proj.weight.shape == (TINY.n_embd, 4 * TINY.n_embd)


def test_forward_equals_running_the_layer_list(tiny):
    ids = torch.randint(0, TINY.vocab_size, (2, 9))
    x = ids
    for _, layer in tiny.named_layers():
        x = layer(x)
    torch.testing.assert_close(tiny(ids), x, rtol=0, atol=0)


def test_embedding_is_token_plus_position(tiny):
    ids = torch.tensor([[5, 7, 5]])
    out = tiny.embed(ids)
    wte, wpe = tiny.embed.wte.weight, tiny.embed.wpe.weight
    torch.testing.assert_close(out[0, 2], wte[5] + wpe[2])
    with pytest.raises(ValueError, match="n_positions=64"):
        tiny.embed(torch.zeros(1, 65, dtype=torch.long))


def test_gpt2_parameter_counts_on_meta_device():
    # GPT-2 with a tied head, the numbers HuggingFace reports for the released checkpoints.
    expected = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080}
    for name, count in expected.items():
        with torch.device("meta"):
            model = GPT(get_config(name))
        assert model.num_parameters() == count, name


def test_init_is_deterministic_and_gpt2_style():
    torch.manual_seed(1)
    a = GPT(TINY)
    torch.manual_seed(1)
    b = GPT(TINY)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    block = a.h[0]
    assert torch.all(block.attn.qkv.bias == 0)
    assert torch.all(block.ln_1.weight == 1) and torch.all(block.ln_1.bias == 0)
    # Weights large enough for the std estimate: the embedding and the residual projection.
    assert a.embed.wte.weight.std().item() == pytest.approx(0.02, rel=0.1)
    residual = torch.cat([blk.mlp.proj.weight.flatten() for blk in a.h])
    assert residual.std().item() == pytest.approx(0.02 / math.sqrt(2 * TINY.n_layer), rel=0.1)


def test_gelu_choice_changes_the_activation():
    torch.manual_seed(0)
    exact = GPT(dataclasses.replace(TINY, activation_function="gelu"))
    x = torch.linspace(-3, 3, 7)
    torch.testing.assert_close(exact.h[0].mlp.act(x), F.gelu(x))
    torch.testing.assert_close(GPT(TINY).h[0].mlp.act(x), F.gelu(x, approximate="tanh"))


def test_dropout_only_in_training():
    torch.manual_seed(0)
    cfg = dataclasses.replace(TINY, resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    model.eval()
    torch.testing.assert_close(model(ids), model(ids), rtol=0, atol=0)
    model.train()
    assert not torch.allclose(model(ids), model(ids))


def test_lm_loss_is_mean_cross_entropy_ignoring_minus_100():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, 2, -100], [0, 4, 3]])
    keep = labels.reshape(-1) != -100
    expected = F.cross_entropy(logits.reshape(-1, 5)[keep], labels.reshape(-1)[keep])
    torch.testing.assert_close(lm_loss(logits, labels), expected)
    uniform = torch.zeros(1, 4, 8)
    assert lm_loss(uniform, torch.zeros(1, 4, dtype=torch.long)).item() == pytest.approx(math.log(8))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_embd": 30, "n_head": 4}, r"n_embd=30 is not divisible by n_head=4: choose n_head in"),
        ({"n_layer": 0}, r"n_layer=0 must be a positive integer"),
        ({"n_head": -2}, r"n_head=-2 must be a positive integer"),
        ({"n_inner": 0}, r"n_inner=0"),
        ({"activation_function": "relu"}, r"activation_function='relu' is not supported: choose one of"),
        ({"attn_pdrop": 1.5}, r"attn_pdrop=1.5 must be in \[0, 1\)"),
        ({"n_layer": "4"}, r"n_layer='4' has type str; expected int"),
        ({"n_layer": 4.0}, r"n_layer=4.0 has type float; expected int"),
        ({"tie_word_embeddings": 1}, r"tie_word_embeddings=1 has type int; expected bool"),
    ],
)
def test_config_validation_names_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.n_layer = 2


def test_from_dict_ignores_hf_keys_and_rejects_wrong_types():
    hf = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_ctx": 1024,
          "n_embd": 64, "n_head": 2, "n_layer": 3, "vocab_size": 100, "resid_pdrop": 0,
          "n_inner": None, "task_specific_params": {"text-generation": {"do_sample": True}}}
    cfg = GPTConfig.from_dict(hf)
    assert (cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.vocab_size) == (64, 2, 3, 100)
    assert cfg.resid_pdrop == 0.0 and isinstance(cfg.resid_pdrop, float)
    assert cfg.n_positions == 1024 and cfg.inner_size == 256
    with pytest.raises(ValueError, match="n_head='2'"):
        GPTConfig.from_dict({**hf, "n_head": "2"})
    with pytest.raises(ValueError, match="must be a JSON object"):
        GPTConfig.from_dict([1, 2])


def test_from_json_round_trip_and_get_config_path(tmp_path):
    cfg = dataclasses.replace(TINY, n_inner=48, tie_word_embeddings=False, bias=False)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg.to_dict(), "model_type": "gpt2"}))
    assert GPTConfig.from_json(path) == cfg
    assert get_config(str(path)) == cfg
    assert get_config(tmp_path) == cfg  # a model directory holding config.json
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read GPT config .*bad.json"):
        GPTConfig.from_json(bad)


def test_bias_false_builds_no_biases():
    model = GPT(dataclasses.replace(TINY, bias=False))
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, TINY.vocab_size)


def test_get_config_presets_and_unknown_name():
    assert get_config("gpt-tiny") is PRESETS["gpt-tiny"]
    assert get_config("gpt2-xl").n_embd == 1600
    assert get_config("gpt-small-cpu").vocab_size == 4096
    with pytest.raises(ValueError) as err:
        get_config("gpt3")
    assert str(err.value) == (
        "unknown model 'gpt3': choose one of gpt-tiny, gpt-small-cpu, gpt2, gpt2-medium, "
        "gpt2-large, gpt2-xl or a path to a GPT-2 config.json"
    )


def test_matches_huggingface_gpt2_with_copied_weights(tiny):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.GPT2Config(
        vocab_size=TINY.vocab_size, n_positions=TINY.n_positions, n_embd=TINY.n_embd,
        n_layer=TINY.n_layer, n_head=TINY.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    sd = {"transformer.wte.weight": tiny.embed.wte.weight, "transformer.wpe.weight": tiny.embed.wpe.weight,
          "transformer.ln_f.weight": tiny.ln_f.ln_f.weight, "transformer.ln_f.bias": tiny.ln_f.ln_f.bias,
          "lm_head.weight": tiny.lm_head.weight}
    for i, blk in enumerate(tiny.h):
        p = f"transformer.h.{i}."
        for ours, theirs in [(blk.ln_1, "ln_1"), (blk.ln_2, "ln_2")]:
            sd[p + theirs + ".weight"], sd[p + theirs + ".bias"] = ours.weight, ours.bias
        # HF Conv1D stores (in, out): transpose our nn.Linear (out, in) weights.
        for ours, theirs in [(blk.attn.qkv, "attn.c_attn"), (blk.attn.proj, "attn.c_proj"),
                             (blk.mlp.fc, "mlp.c_fc"), (blk.mlp.proj, "mlp.c_proj")]:
            sd[p + theirs + ".weight"], sd[p + theirs + ".bias"] = ours.weight.t(), ours.bias
    result = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith(("attn.bias", "attn.masked_bias")) for k in result.missing_keys)  # masks
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(tiny(ids), hf(ids).logits, rtol=1e-4, atol=1e-5)
