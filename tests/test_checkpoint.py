"""Checkpoints: bitwise round trips, optimizer state across regroupings, RNG."""

import hashlib
import json
import random

import numpy as np
import pytest
import torch
from torch import nn

import mp_toolkit.checkpoint as ckpt_pkg
from mp_toolkit.checkpoint import (
    CheckpointError,
    begin,
    capture_rng,
    latest_step,
    load_optimizer_state_by_name,
    open_checkpoint,
    optimizer_state_by_name,
    param_groups_by_name,
    restore_rng,
    save_checkpoint,
    split_by_layer,
    write_layer_shard,
)
from mp_toolkit.checkpoint.files import check_name
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.lamb import LAMB
from mp_toolkit.optim.lars import LARS
from mp_toolkit.optim.loss_scaler import DynamicLossScaler
from tests.checkpoint_helpers import assert_bitwise, one_line_error, raw, sample_layers

torch.set_num_threads(1)

# -- round trip ---------------------------------------------------------------------------------

def test_save_then_load_is_bitwise_and_keeps_the_manifest(tmp_path):
    layers = sample_layers()
    scaler = DynamicLossScaler(initial_scale_power=8, hysteresis=3)
    scaler.update(True)
    manifest = {"config": {"model": "gpt-tiny", "pp": 2, "tp": 1, "lr": 3e-4, "betas": [0.9, 0.95]},
                "data": {"epoch": 1, "position": 37}, "loss_scaler": scaler.state_dict(), "note": None}
    final = save_checkpoint(tmp_path, 12, layers, manifest=manifest)
    assert final == tmp_path / "step-00000012"
    assert (tmp_path / "latest").read_text() == "step-00000012\n"
    assert latest_step(tmp_path) == 12

    for ck in (open_checkpoint(tmp_path), open_checkpoint(final)):
        assert ck.step == 12 and ck.path == final
        assert ck.manifest == manifest
        assert ck.layer_names == ("embed", "h.0", "h.2", "h.10")  # natural order
        for name, tensors in layers.items():
            assert_bitwise(ck.read_layer(name), tensors)
        ck.verify()
    restored = DynamicLossScaler(initial_scale_power=8, hysteresis=3)
    restored.load_state_dict(open_checkpoint(tmp_path).manifest["loss_scaler"])
    assert restored.state_dict() == scaler.state_dict() == {
        "cur_scale": 256.0, "cur_iter": 1, "last_overflow_iter": 0, "cur_hysteresis": 2}
    doc = json.loads((final / "manifest.json").read_text())
    assert doc["step"] == 12 and doc["format_version"] == ckpt_pkg.FORMAT_VERSION
    assert sorted(doc["files"]) == sorted(f"layers/{n}.safetensors" for n in layers)
    shard = final / "layers" / "h.0.safetensors"
    assert doc["files"]["layers/h.0.safetensors"] == {
        "sha256": hashlib.sha256(shard.read_bytes()).hexdigest(), "bytes": shard.stat().st_size}


def test_split_by_layer_takes_the_longest_layer_prefix():
    named = {"h.1.w": 1, "h.10.w": 2, "h.1.mlp.b": 3, "embed.wte.weight": 4}
    assert split_by_layer(named, ["embed", "h.1", "h.10"]) == {
        "h.1": {"h.1.w": 1, "h.1.mlp.b": 3}, "h.10": {"h.10.w": 2}, "embed": {"embed.wte.weight": 4}}
    with pytest.raises(CheckpointError) as e:
        split_by_layer({"lm_head.weight": 0}, ["embed"])
    one_line_error(e, "lm_head.weight")


@pytest.mark.parametrize("name", ["h.0", "embed", "encoder.layer.3", "lm_head", "blk-7"])
def test_safe_layer_names_pass(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["a/b", "..", "../x", "a..b", ".hidden", "", "a\\b", "/abs", "a b", "x" * 201])
def test_unsafe_layer_names_are_refused(tmp_path, name):
    tmp = begin(tmp_path, 1)
    with pytest.raises(CheckpointError) as e:
        write_layer_shard(tmp, name, {f"{name}.w": torch.zeros(1)})
    one_line_error(e, "cannot be a checkpoint file name")


def test_a_parameter_outside_its_layer_is_refused(tmp_path):
    tmp = begin(tmp_path, 1)
    with pytest.raises(CheckpointError) as e:
        write_layer_shard(tmp, "h.1", {"h.10.w": torch.zeros(1)})
    one_line_error(e, "'h.10.w'", "'h.1'")


# -- optimizer state by name --------------------------------------------------------------------

def tiny_model(seed: int) -> LayerList:
    torch.manual_seed(seed)
    layers = [("embed", nn.Linear(4, 8)), ("h.0", nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))),
              ("h.1", nn.Linear(8, 8)), ("head", nn.Linear(8, 3))]
    return LayerList(layers)


def named_params(model: LayerList) -> list:
    return list(model.slice(0, len(model)).named_layer_parameters())


OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=1e-1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "lamb": lambda groups: LAMB(groups, lr=1e-2),
    "lars": lambda groups: LARS(groups, lr=1e-1, momentum=0.9, weight_decay=1e-4),
}


def train_step(model, optimizer, k: int) -> None:
    g = torch.Generator().manual_seed(100 + k)
    x, y = torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_optimizer_state_resumes_bitwise_under_another_grouping_and_order(tmp_path, kind):
    model = tiny_model(0)
    named = named_params(model)
    original = OPTIMIZERS[kind]([p for _, p in named])
    for k in range(2):
        train_step(model, original, k)
    tensors, scalars = optimizer_state_by_name(original, {p: n for n, p in named})
    assert sorted(tensors) == sorted(n for n, _ in named)
    layer_names = model.names
    save_checkpoint(tmp_path, 2, split_by_layer({n: p for n, p in named}, layer_names),
                    split_by_layer(tensors, layer_names), optim_scalars=split_by_layer(scalars, layer_names),
                    manifest={"param_groups": param_groups_by_name(original, named)})
    # The returned tensors are the optimizer's own: snapshot them before the run goes on.
    at_save = {n: {k: t.clone() for k, t in state.items()} for n, state in tensors.items()}
    train_step(model, original, 2)  # the uninterrupted run's third step
    expected = {n: p.detach().clone() for n, p in named}

    # A new process: other initial weights, the parameters in reversed order and split into two
    # groups, as a rank of another layout would build them.
    fresh = tiny_model(1)
    fresh_named = named_params(fresh)
    ck = open_checkpoint(tmp_path)
    saved_t, saved_s = {}, {}
    with torch.no_grad():
        for layer in ck.layer_names:
            for n, t in ck.read_layer(layer).items():
                dict(fresh_named)[n].copy_(t)
            t_part, s_part = ck.read_optimizer(layer)
            saved_t.update(t_part)
            saved_s.update(s_part)
    rev = [p for _, p in reversed(fresh_named)]
    optimizer = OPTIMIZERS[kind]([{"params": rev[:3]}, {"params": rev[3:]}])
    load_optimizer_state_by_name(optimizer, fresh_named, saved_t, saved_s)
    for n, p in fresh_named:
        for key, t in optimizer.state[p].items():
            assert raw(t) == raw(at_save[n][key]) and t.dtype == at_save[n][key].dtype
            assert t.device == at_save[n][key].device
            assert t.data_ptr() != saved_t[n][key].data_ptr()  # a copy, not the loaded object
    if kind in ("adamw", "lamb"):
        first = optimizer.state[fresh_named[0][1]]["step"]
        assert first.dtype == torch.float32 and first.item() == 2.0 and first.device.type == "cpu"
    train_step(fresh, optimizer, 2)
    for n, p in fresh_named:
        assert raw(p.detach()) == raw(expected[n]), n
    groups = ck.manifest["param_groups"]
    assert groups[0]["params"] == [n for n, _ in named] and groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_step_tensor_follows_torchs_capturable_rule():
    p = nn.Parameter(torch.ones(3))
    saved = {"w": {"step": torch.tensor(4.0, dtype=torch.float64), "exp_avg": torch.ones(3, dtype=torch.float64),
                   "exp_avg_sq": torch.ones(3)}}
    plain = torch.optim.Adam([p])
    load_optimizer_state_by_name(plain, {p: "w"}, saved)
    assert plain.state[p]["step"].dtype == torch.float64  # not capturable: step is left as saved
    assert plain.state[p]["exp_avg"].dtype == torch.float32  # moments take the parameter's dtype
    capturable = torch.optim.Adam([p], capturable=True)
    load_optimizer_state_by_name(capturable, {p: "w"}, saved)
    step = capturable.state[p]["step"]
    assert step.dtype == torch.float32 and step.device == p.device and step.item() == 4.0


def test_loading_refuses_unsaved_parameters_and_changes_nothing():
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
    saved = {"a": {"momentum_buffer": torch.full((2,), 3.0)}, "other_rank.w": {"momentum_buffer": torch.ones(5)}}
    with pytest.raises(CheckpointError) as e:
        load_optimizer_state_by_name(opt, {a: "a", b: "b"}, saved)
    one_line_error(e, "1 parameter(s): b", "strict=False")
    assert len(opt.state) == 0
    load_optimizer_state_by_name(opt, {a: "a", b: "b"}, saved, strict=False)
    assert opt.state[a]["momentum_buffer"].tolist() == [3.0, 3.0] and b not in opt.state
    with pytest.raises(CheckpointError) as e:
        optimizer_state_by_name(opt, {a: "a"})
    one_line_error(e, "has no name")


# -- RNG ----------------------------------------------------------------------------------------

def test_rng_round_trip_restores_every_generator(tmp_path):
    torch.manual_seed(3), random.seed(4), np.random.seed(5)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    np.random.standard_normal()
    state = capture_rng()
    expected = (torch.rand(4).tolist(), [random.random() for _ in range(3)], random.gauss(0, 1),
                np.random.rand(3).tolist(), float(np.random.standard_normal()))
    save_checkpoint(tmp_path, 1, {}, rng=state)
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    ck = open_checkpoint(tmp_path)
    assert ck.rng_ranks == (0,)
    restore_rng(ck.read_rng(0))
    got = (torch.rand(4).tolist(), [random.random() for _ in range(3)], random.gauss(0, 1),
           np.random.rand(3).tolist(), float(np.random.standard_normal()))
    assert got == expected
    with pytest.raises(CheckpointError) as e:
        ck.read_rng(1)
    one_line_error(e, "no RNG state for rank 1")
