"""Checkpoints: bitwise round trips, optimizer state across regroupings, RNG, corruption, crashes."""

import ast
import hashlib
import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import mp_toolkit.checkpoint as ckpt_pkg
from mp_toolkit.checkpoint import (
    CheckpointError, begin, capture_rng, commit, latest_step, load_optimizer_state_by_name,
    open_checkpoint, optimizer_state_by_name, param_groups_by_name, restore_rng, save_checkpoint,
    split_by_layer, write_layer_shard,
)
from mp_toolkit.checkpoint.files import check_name
from mp_toolkit.layers import LayerList
from mp_toolkit.optim import LAMB, LARS, DynamicLossScaler

torch.set_num_threads(1)


def raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes, so equality is bitwise (NaN payloads and -0.0 included)."""
    return bytes(t.contiguous().flatten().view(torch.uint8).tolist())


def assert_bitwise(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k
        assert raw(a[k]) == raw(b[k]), k


def sample_layers() -> dict:
    g = torch.Generator().manual_seed(0)
    weird = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45, 3.0])
    qkv = torch.randn(6, 4, generator=g)
    return {
        "embed": {"embed.wte.weight": torch.randn(10, 4, generator=g),
                  "embed.ids": torch.arange(-5, 5, dtype=torch.int64) * (2 ** 40)},
        "h.0": {"h.0.attn.qkv.weight": qkv.to(torch.bfloat16),
                "h.0.attn.q": qkv[:2],                        # a view: shares storage with qkv
                "h.0.mlp.weight": torch.randn(3, 5, generator=g).half(),
                "h.0.special": weird, "h.0.empty": torch.zeros(0, 3)},
        "h.10": {"h.10.ln.weight": torch.randn(4, generator=g, dtype=torch.float64)},
        "h.2": {"h.2.ln.bias": torch.tensor(7.5)},
    }


def reseal(directory: Path, rel: str) -> None:
    """Rewrite the manifest entry of ``rel`` to the file's current hash: an attacker who
    controls the whole directory, so only parsing stands between the file and the loader."""
    manifest = json.loads((directory / "manifest.json").read_text())
    data = (directory / rel).read_bytes()
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (directory / "manifest.json").write_text(json.dumps(manifest))


def one_line_error(excinfo, *needles: str) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


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


# -- damaged and hostile files ------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    save_checkpoint(tmp_path, 3, sample_layers(), manifest={"a": 1})
    return tmp_path / "step-00000003"


def test_a_truncated_shard_is_refused(saved):
    shard = saved / "layers" / "h.0.safetensors"
    shard.write_bytes(shard.read_bytes()[:-7])
    ck = open_checkpoint(saved.parent)
    for call in (lambda: ck.read_layer("h.0"), ck.verify):
        with pytest.raises(CheckpointError) as e:
            call()
        one_line_error(e, "layers/h.0.safetensors", "truncated")
    assert ck.read_layer("embed")["embed.ids"].tolist()[0] == -5 * 2 ** 40  # other shards still load


def test_a_modified_byte_is_refused(saved):
    shard = saved / "layers" / "h.2.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    ck = open_checkpoint(saved)
    for call in (lambda: ck.read_layer("h.2"), ck.verify):
        with pytest.raises(CheckpointError) as e:
            call()
        one_line_error(e, "layers/h.2.safetensors", "SHA-256 mismatch")


def test_a_missing_shard_is_refused(saved):
    (saved / "layers" / "h.10.safetensors").unlink()
    ck = open_checkpoint(saved)
    for call in (lambda: ck.read_layer("h.10"), ck.verify):
        with pytest.raises(CheckpointError) as e:
            call()
        one_line_error(e, "layers/h.10.safetensors", "missing")
    with pytest.raises(CheckpointError) as e:
        ck.read_layer("h.99")
    one_line_error(e, "no layer 'h.99'")


def test_a_garbage_manifest_is_refused(saved):
    (saved / "manifest.json").write_bytes(b"{\"format\": \x00 garbage")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(saved.parent)
    one_line_error(e, "manifest.json is not valid JSON", str(saved))
    (saved / "manifest.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(saved)
    one_line_error(e, "manifest.json", "not an mp_toolkit checkpoint manifest")


def test_an_extra_file_fails_verify_but_is_never_read(saved):
    (saved / "layers" / "intruder.safetensors").write_bytes(b"x")
    ck = open_checkpoint(saved)
    assert "intruder" not in ck.layer_names
    with pytest.raises(CheckpointError) as e:
        ck.verify()
    one_line_error(e, "unexpected file layers/intruder.safetensors")


def test_a_manifest_path_outside_the_checkpoint_is_refused(saved):
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["files"]["../../etc/passwd.safetensors"] = {"sha256": "0" * 64, "bytes": 1}
    (saved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(saved)
    one_line_error(e, "unsafe path")


def header_file(header: bytes, length: int | None = None, body: bytes = b"") -> bytes:
    return (len(header) if length is None else length).to_bytes(8, "little") + header + body


@pytest.mark.parametrize("payload, reason", [
    (header_file(b"{}", length=1 << 62), "header length"),
    (header_file(b"{\"a\": [1, 2"), "not valid JSON"),
    (header_file(b"[1, 2, 3]"), "not a JSON object"),
    (header_file(json.dumps({"h.0.w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}).encode(),
                 body=b"\0" * 16), "invalid shape or byte range"),
    (header_file(json.dumps({"h.0.w": {"dtype": "OBJ", "shape": [1], "data_offsets": [0, 8]}}).encode(),
                 body=b"\0" * 8), "no supported dtype"),
    (header_file(json.dumps({"h.0.w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                             "h.0.v": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode(),
                 body=b"\0" * 8), "not a valid safetensors file"),   # overlapping tensors
    (b"\x01\x02", "shorter than a safetensors header"),
])
def test_crafted_safetensors_headers_are_refused_cleanly(saved, payload, reason):
    rel = "layers/h.0.safetensors"
    (saved / rel).write_bytes(payload)
    reseal(saved, rel)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(saved).read_layer("h.0")
    one_line_error(e, rel, reason)


class _Trap:
    """Unpickling this creates a file: proof that the loader never unpickles."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_pickle_disguised_as_a_shard_is_refused_without_running_it(saved, tmp_path):
    trap = tmp_path / "pwned"
    rel = "layers/embed.safetensors"
    (saved / rel).write_bytes(pickle.dumps({"embed.wte.weight": _Trap(trap)}))
    reseal(saved, rel)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(saved).read_layer("embed")
    one_line_error(e, rel)
    assert not trap.exists()


def test_the_checkpoint_source_never_unpickles():
    banned_modules = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
    sources = sorted(Path(ckpt_pkg.__file__).parent.glob("*.py"))
    assert len(sources) >= 5
    for path in sources:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & banned_modules, path
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in banned_modules, path
            if isinstance(node, ast.Attribute) and node.attr in ("load", "loads"):
                base = node.value
                assert not (isinstance(base, ast.Name) and base.id in ("torch", "np", "numpy", "pickle")), path
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec"), path
            if isinstance(node, ast.keyword):
                assert node.arg not in ("allow_pickle", "weights_only"), path


# -- crash safety and retention -----------------------------------------------------------------

def test_a_crash_before_commit_keeps_latest_and_the_next_save_cleans_up(tmp_path):
    save_checkpoint(tmp_path, 1, {"h.0": {"h.0.w": torch.tensor([1.0])}})
    tmp = begin(tmp_path, 2)
    write_layer_shard(tmp, "h.0", {"h.0.w": torch.tensor([2.0])})
    # ... the process dies here: no commit.
    assert tmp.is_dir() and latest_step(tmp_path) == 1
    ck = open_checkpoint(tmp_path)
    assert ck.step == 1 and ck.read_layer("h.0")["h.0.w"].tolist() == [1.0]
    save_checkpoint(tmp_path, 3, {"h.0": {"h.0.w": torch.tensor([3.0])}})
    assert not tmp.exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step-00000001", "step-00000003"]
    assert open_checkpoint(tmp_path).read_layer("h.0")["h.0.w"].tolist() == [3.0]


def fail_on(monkeypatch, func: str, target: str):
    """Make ``os.<func>`` raise when its destination is named ``target``: a crash at that point."""
    real = getattr(os, func)

    def crash(src, dst, *args, **kwargs):
        if Path(dst).name == target:
            raise OSError(f"simulated crash before {func} onto {target}")
        return real(src, dst, *args, **kwargs)
    monkeypatch.setattr(os, func, crash)


def test_a_crash_between_the_rename_and_latest_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"h.0": {"h.0.w": torch.tensor([1.0])}})
    with monkeypatch.context() as m:
        fail_on(m, "replace", "latest")
        with pytest.raises(OSError, match="simulated crash"):
            save_checkpoint(tmp_path, 2, {"h.0": {"h.0.w": torch.tensor([2.0])}})
    assert (tmp_path / "step-00000002" / "manifest.json").is_file()  # renamed, never committed
    assert (tmp_path / "latest").read_text() == "step-00000001\n" and latest_step(tmp_path) == 1
    assert open_checkpoint(tmp_path).read_layer("h.0")["h.0.w"].tolist() == [1.0]
    # The resumed run reaches step 2 again: its save replaces the uncommitted directory.
    save_checkpoint(tmp_path, 2, {"h.0": {"h.0.w": torch.tensor([2.5])}})
    assert open_checkpoint(tmp_path).read_layer("h.0")["h.0.w"].tolist() == [2.5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001", "step-00000002"]


def test_replacing_the_latest_step_never_leaves_latest_dangling(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"h.0": {"h.0.w": torch.tensor([1.0])}})
    save_checkpoint(tmp_path, 2, {"h.0": {"h.0.w": torch.tensor([2.0])}})
    with monkeypatch.context() as m:  # crash after the old step-2 moved aside, before the new one lands
        fail_on(m, "rename", "step-00000002")
        with pytest.raises(OSError, match="simulated crash"):
            save_checkpoint(tmp_path, 2, {"h.0": {"h.0.w": torch.tensor([-2.0])}})
    assert latest_step(tmp_path) == 1
    assert open_checkpoint(tmp_path).read_layer("h.0")["h.0.w"].tolist() == [1.0]
    save_checkpoint(tmp_path, 2, {"h.0": {"h.0.w": torch.tensor([-2.0])}})  # the retry succeeds
    assert open_checkpoint(tmp_path).read_layer("h.0")["h.0.w"].tolist() == [-2.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001", "step-00000002"]


def test_an_interrupted_replace_of_the_only_checkpoint_refuses_loudly_and_names_the_copy(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 4, {"h.0": {"h.0.w": torch.tensor([4.0])}})
    with monkeypatch.context() as m:
        fail_on(m, "rename", "step-00000004")
        with pytest.raises(OSError, match="simulated crash"):
            save_checkpoint(tmp_path, 4, {"h.0": {"h.0.w": torch.tensor([5.0])}})
    with pytest.raises(CheckpointError) as e:
        latest_step(tmp_path)  # not None: a resume script must not silently start from scratch
    one_line_error(e, "latest names step-00000004 which does not exist", ".tmp-replaced-step-00000004")
    (tmp_path / ".tmp-replaced-step-00000004").rename(tmp_path / "step-00000004")  # the hinted fix
    assert open_checkpoint(tmp_path).read_layer("h.0")["h.0.w"].tolist() == [4.0]


def test_keep_retains_exactly_the_newest(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"h.0": {"h.0.w": torch.tensor([float(step)])}}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000004", "step-00000005"]
    # Rewinding to an older step keeps the one latest names even when it is not among the newest.
    save_checkpoint(tmp_path, 3, {"h.0": {"h.0.w": torch.tensor([3.0])}}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003", "step-00000005"]
    assert latest_step(tmp_path) == 3
    for step in (6, 7, 8):
        save_checkpoint(tmp_path / "all", step, {}, keep=None)
    assert len(list((tmp_path / "all").glob("step-*"))) == 3
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path, 9, {}, keep=0)
    one_line_error(e, "keep must be an integer >= 1")


def test_roots_without_a_committed_checkpoint(tmp_path):
    assert latest_step(tmp_path / "nowhere") is None and latest_step(tmp_path) is None
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(tmp_path)
    one_line_error(e, "not a checkpoint directory", "no latest file")
    (tmp_path / "latest").write_text("step-00000012\n")
    for call in (lambda: open_checkpoint(tmp_path), lambda: latest_step(tmp_path)):
        with pytest.raises(CheckpointError) as e:
            call()
        one_line_error(e, "latest names step-00000012 which does not exist")
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(tmp_path)
    one_line_error(e, "not a step-XXXXXXXX directory name")


def test_multi_rank_protocol_from_separate_writers(tmp_path):
    """Rank 0 creates, every rank writes its own layers and RNG, rank 0 commits."""
    tmp0 = begin(tmp_path, 5, create=True)
    tmp1 = begin(tmp_path, 5, create=False)
    assert tmp0 == tmp1 == tmp_path / ".tmp-step-00000005"
    write_layer_shard(tmp0, "h.0", {"h.0.w": torch.ones(2)})     # rank 0's stage
    write_layer_shard(tmp1, "h.1", {"h.1.w": torch.zeros(2)})    # rank 1's stage
    with pytest.raises(CheckpointError) as e:
        write_layer_shard(begin(tmp_path, 6, create=False), "h.1", {"h.1.w": torch.zeros(2)})
    one_line_error(e, "begin(root, step)")
    final = commit(tmp_path, 5, tmp0, {"world_size": 2})
    ck = open_checkpoint(tmp_path)
    assert ck.layer_names == ("h.0", "h.1") and ck.manifest == {"world_size": 2} and ck.path == final
    assert ck.read_layer("h.1")["h.1.w"].tolist() == [0.0, 0.0]
