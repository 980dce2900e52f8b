"""Checkpoints: damaged and hostile files, crashes during a save, retention."""

import ast
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import mp_toolkit.checkpoint as ckpt_pkg
from mp_toolkit.checkpoint import (
    CheckpointError,
    begin,
    commit,
    latest_step,
    open_checkpoint,
    save_checkpoint,
    write_layer_shard,
)
from tests.checkpoint_helpers import one_line_error, reseal, sample_layers

torch.set_num_threads(1)

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


class SimulatedCrash(BaseException):
    """The process dies here: no handler runs (a failing write is an OSError, which commit undoes)."""


def fail_on(monkeypatch, func: str, target: str):
    """Make ``os.<func>`` raise when its destination is named ``target``: a crash at that point."""
    real = getattr(os, func)

    def crash(src, dst, *args, **kwargs):
        if Path(dst).name == target:
            raise SimulatedCrash(f"simulated crash before {func} onto {target}")
        return real(src, dst, *args, **kwargs)
    monkeypatch.setattr(os, func, crash)


def test_a_crash_between_the_rename_and_latest_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"h.0": {"h.0.w": torch.tensor([1.0])}})
    with monkeypatch.context() as m:
        fail_on(m, "replace", "latest")
        with pytest.raises(SimulatedCrash, match="simulated crash"):
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
        with pytest.raises(SimulatedCrash, match="simulated crash"):
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
        with pytest.raises(SimulatedCrash, match="simulated crash"):
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
