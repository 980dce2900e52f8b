"""Crafted checkpoint directories (issue 22 item 7): links, fifos, absurd sizes and deep JSON are
refused with the one-line checkpoint error, never followed, never a hang or an uncaught error."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mp_toolkit.checkpoint import CheckpointError, latest_step, open_checkpoint, save_checkpoint
from tests.checkpoint_helpers import one_line_error, reseal, sample_layers
from tests.cli_helpers import assert_one_line_exit_2

torch.set_num_threads(1)


@pytest.fixture
def saved(tmp_path):
    save_checkpoint(tmp_path / "run", 3, sample_layers(), manifest={"a": 1})
    return tmp_path / "run" / "step-00000003"


def _refused(call, *needles):
    with pytest.raises(CheckpointError) as e:
        call()
    return one_line_error(e, *needles)


def test_a_symlinked_shard_is_refused(saved, tmp_path):
    shard = saved / "layers" / "h.0.safetensors"
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.copy(shard, elsewhere)  # the very same bytes: only the link is wrong
    shard.unlink()
    shard.symlink_to(elsewhere)
    ck = open_checkpoint(saved)
    _refused(lambda: ck.read_layer("h.0"), "layers/h.0.safetensors", "symbolic link")
    _refused(ck.verify, "layers/h.0.safetensors", "symbolic link")


def test_a_symlinked_folder_inside_a_checkpoint_is_refused(saved, tmp_path):
    shutil.move(saved / "layers", tmp_path / "layers")
    (saved / "layers").symlink_to(tmp_path / "layers")
    _refused(lambda: open_checkpoint(saved).read_layer("h.0"), "symbolic link")


def test_a_symlinked_step_directory_is_refused(saved, tmp_path):
    root = saved.parent
    shutil.move(saved, tmp_path / "real-step")
    saved.symlink_to(tmp_path / "real-step")
    _refused(lambda: open_checkpoint(root), "step-00000003", "symbolic link")
    _refused(lambda: latest_step(root), "symbolic link")


def test_a_symlinked_manifest_or_latest_is_refused(saved, tmp_path):
    manifest = saved / "manifest.json"
    shutil.move(manifest, tmp_path / "manifest.json")
    manifest.symlink_to(tmp_path / "manifest.json")
    _refused(lambda: open_checkpoint(saved), "manifest.json", "symbolic link")
    latest = saved.parent / "latest"
    shutil.move(latest, tmp_path / "latest")
    latest.symlink_to(tmp_path / "latest")
    _refused(lambda: latest_step(saved.parent), "latest", "symbolic link")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no fifos here")
def test_a_fifo_as_latest_or_manifest_is_refused_without_waiting(saved):
    """A plain open() of a fifo without a writer blocks forever; these return at once."""
    root = saved.parent
    (root / "latest").unlink()
    os.mkfifo(root / "latest")
    _refused(lambda: latest_step(root), "latest", "not a regular file")
    _refused(lambda: open_checkpoint(root), "latest", "not a regular file")
    (saved / "manifest.json").unlink()
    os.mkfifo(saved / "manifest.json")
    _refused(lambda: open_checkpoint(saved), "manifest.json", "not a regular file")


def test_absurd_byte_counts_are_refused_before_reading(saved):
    manifest = json.loads((saved / "manifest.json").read_text())
    for size in (10**30, 2**63, 2**40):
        manifest["files"]["layers/h.0.safetensors"]["bytes"] = size
        (saved / "manifest.json").write_text(json.dumps(manifest))
        ck = open_checkpoint(saved)
        _refused(lambda ck=ck: ck.read_layer("h.0"), "layers/h.0.safetensors", f"says {size}")
        _refused(ck.verify, "layers/h.0.safetensors", f"says {size}")


@pytest.mark.parametrize("text", ["[" * 200_000 + "]" * 200_000, '{"a":' * 100_000 + "1" + "}" * 100_000,
                                  '{"format": 1' + "0" * 5000 + "}"])
def test_deep_or_huge_json_is_refused_in_one_line(saved, text):
    (saved / "manifest.json").write_text(text)
    _refused(lambda: open_checkpoint(saved), "manifest.json", "not valid JSON")


def test_a_crafted_checkpoint_given_to_mpt_is_one_line_exit_2(saved, tmp_path, capsys):
    root = saved.parent
    (root / "latest").unlink()
    os.mkfifo(root / "latest")
    base = ["train", "--model", "gpt-tiny", "--pp", "1", "--data", "synthetic", "--seq-len", "16", "--steps", "1",
            "--micro-batch", "1", "--microbatches", "1", "--threads", "1", "--no-progress"]
    assert_one_line_exit_2(capsys, base + ["--save-dir", root, "--resume", "auto"], mentions="not a regular file")
    assert_one_line_exit_2(capsys, ["export", "--checkpoint", root, "--out", tmp_path / "hf"],
                           mentions="not a regular file")


def test_every_dtype_reads_back_bitwise_into_tensors_of_their_own(tmp_path):
    """`read_shard` reads each tensor's bytes straight into it (no copy of the file beside the tensors):
    every safetensors dtype comes back bitwise, contiguous, each tensor with storage of its own."""
    g = torch.Generator().manual_seed(0)
    dtypes = (torch.bool, torch.uint8, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn, torch.int16, torch.uint16,
              torch.float16, torch.bfloat16, torch.int32, torch.uint32, torch.float32, torch.int64, torch.uint64,
              torch.float64)
    tensors = {}
    for dt in dtypes:  # random bytes (NaN payloads and all), viewed as the dtype; a bool is 0 or 1
        size = torch.empty(0, dtype=dt).element_size()
        raw = torch.randint(0, 2 if dt == torch.bool else 256, (3, 5 * size), generator=g, dtype=torch.uint8)
        tensors[f"h.0.{str(dt)[6:]}"] = raw.view(dt)
    tensors["h.0.empty"] = torch.zeros(0, 4)
    save_checkpoint(tmp_path / "run", 1, {"h.0": tensors})
    back = open_checkpoint(tmp_path / "run").read_layer("h.0")
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and back[name].is_contiguous()
        assert back[name].view(-1).view(torch.uint8).tolist() == t.contiguous().view(-1).view(torch.uint8).tolist()
    pointers = {t.untyped_storage().data_ptr() for t in back.values() if t.numel()}
    assert len(pointers) == sum(1 for t in back.values() if t.numel())


def test_a_header_whose_tensors_leave_a_gap_is_refused(saved):
    rel = "layers/h.0.safetensors"
    raw = json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}).encode()
    (saved / rel).write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 8)
    reseal(saved, rel)
    _refused(lambda: open_checkpoint(saved).read_layer("h.0"), "leaves a gap")


def test_the_read_benchmark_reports_both_ways_and_ours_holds_the_shard_once():
    """`tools.bench_checkpoint_read` at 64 MiB: both ways reported; ours adds about the shard, the whole-file
    read about twice it (memory, not time: no timed assertion)."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "tools.bench_checkpoint_read", "--mib", "64", "--repeats", "1"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout[:done.stdout.rindex("}") + 1])
    ours, theirs = result["ours"]["peak_added_mib"], result["whole file + safetensors"]["peak_added_mib"]
    assert ours < 1.5 * 64 < theirs, result
