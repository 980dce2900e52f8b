"""Failing storage during a checkpoint save: a full disk, an I/O error, a read-only folder (issue 22 item 3).

Every write-side call a save makes (mkdir, each safetensors file, each text file, fsync, rename,
replace) is failed in turn, once or from that call on, with ENOSPC / EIO / EROFS. After each
failure: ``latest`` names the checkpoint it named before, which verifies; every ``step-*``
directory is complete; no scratch is left; the next save succeeds. RELIABILITY.md records the count.
"""

import errno
import os
import pathlib
import shutil

import pytest
import safetensors
import safetensors.torch
import torch

from mp_toolkit.checkpoint import CheckpointError, latest_step, open_checkpoint, save_checkpoint
from tests.cli_helpers import assert_one_line_exit_2

torch.set_num_threads(1)

ERRORS = (errno.ENOSPC, errno.EIO, errno.EROFS)


class FailingDisk:
    """Counts a save's write-side calls; fails call number ``fail_at`` (and, ``persistent``, every
    later write of data as a full disk does) with ``code``. Safetensors reports an I/O error the
    way the real library does (a SafetensorError naming the os error)."""

    def __init__(self, monkeypatch, fail_at=None, persistent=False, code=errno.ENOSPC):
        self.calls, self.fail_at, self.persistent, self.code = 0, fail_at, persistent, code
        for name in ("mkdir", "replace", "rename"):
            monkeypatch.setattr(os, name, self._wrap(getattr(os, name), data=name == "mkdir"))
        # (the test makes fsync a no-op: durability is not what it checks, and each real one costs
        # milliseconds on a shared disk; it is still counted and failed here)
        monkeypatch.setattr(os, "fsync", self._wrap(os.fsync, data=True))
        monkeypatch.setattr(pathlib.Path, "write_text", self._wrap(pathlib.Path.write_text, data=True))
        real_save = safetensors.torch.save_file

        def save_file(*args, **kwargs):
            try:
                return self._wrap(real_save, data=True)(*args, **kwargs)
            except OSError as e:
                raise safetensors.SafetensorError(f"Error while serializing: I/O error: {e.strerror} "
                                                  f"(os error {e.errno})") from None
        monkeypatch.setattr(safetensors.torch, "save_file", save_file)

    def _wrap(self, real, data):
        def call(*args, **kwargs):
            self.calls += 1
            if self.fail_at is not None and (self.calls == self.fail_at
                                             or (self.persistent and data and self.calls > self.fail_at)):
                raise OSError(self.code, os.strerror(self.code), str(args[0]) if args else None)
            return real(*args, **kwargs)
        return call


def layers(value: float) -> dict:
    return {f"h.{i}": {f"h.{i}.w": torch.full((3,), value + i)} for i in range(2)}


SCENARIOS = {  # name: (steps saved before, step saved under failure, keep)
    "new step": ((1,), 2, 3),
    "replace the latest step": ((1, 2), 2, 3),
    "prune after commit": ((1, 2, 3), 4, 2),
}


def _prepare(root, before, keep):
    for step in before:
        save_checkpoint(root, step, layers(float(step)), keep=keep)


def _injections(tmp_path, monkeypatch, name, persistent):
    before, step, keep = SCENARIOS[name]
    with monkeypatch.context() as m:  # how many write-side calls the save makes
        _prepare(tmp_path / "count", before, keep)
        disk = FailingDisk(m)
        save_checkpoint(tmp_path / "count", step, layers(-1.0), keep=keep)
    template = tmp_path / "template"
    _prepare(template, before, keep)
    results = []
    for n in range(1, disk.calls + 1):
        root = tmp_path / f"{name}-{persistent}-{n}".replace(" ", "_")
        shutil.copytree(template, root, symlinks=True)
        previous = latest_step(root)
        code = ERRORS[n % len(ERRORS)]
        with monkeypatch.context() as m:
            FailingDisk(m, fail_at=n, persistent=persistent, code=code)
            try:
                save_checkpoint(root, step, layers(-1.0), keep=keep)
                failed = None
            except (OSError, CheckpointError) as e:
                failed = e
        if failed is not None:
            assert os.strerror(code) in str(failed), failed
            # A disk that keeps failing may also refuse putting `latest` back: after the commit's own
            # replace went through (only its folder's fsync failed), or after `latest` stepped to an
            # older complete checkpoint while the latest one was being replaced. Either way it names a
            # complete checkpoint, which is what counts as not corrupted.
            assert latest_step(root) == previous or (persistent and latest_step(root) in (*before, step)), (n, failed)
            open_checkpoint(root).verify()
        else:  # only a failure after the commit point (pruning) lets the save succeed
            assert latest_step(root) == step
        for d in root.glob("step-*"):
            open_checkpoint(d).verify()  # no partial directory
        assert not [p.name for p in root.iterdir() if p.name.startswith(".tmp-")
                    and not p.name.startswith(".tmp-delete-")], (n, sorted(p.name for p in root.iterdir()))
        save_checkpoint(root, step, layers(7.0), keep=keep)  # the disk is back: the retry succeeds
        assert open_checkpoint(root).read_layer("h.0")["h.0.w"].tolist() == [7.0] * 3
        results.append(failed is not None)
        shutil.rmtree(root)
    shutil.rmtree(template)
    shutil.rmtree(tmp_path / "count")
    return results


def test_every_failing_write_of_a_save_leaves_latest_on_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # see FailingDisk
    injected = 0
    for name in SCENARIOS:
        for persistent in (False, True):
            injected += len(_injections(tmp_path, monkeypatch, name, persistent))
    assert injected >= 50
    with capsys.disabled():
        print(f"\n{injected} injected write failures, 0 checkpoints corrupted")


TRAIN = ["train", "--model", "gpt-tiny", "--pp", "1", "--data", "synthetic", "--seq-len", "16", "--micro-batch", "2",
         "--microbatches", "1", "--threads", "1", "--no-progress", "--steps", "2", "--save-every", "1"]


def full_disk_at_step_2(monkeypatch) -> None:
    """Every safetensors file of step 2's save fails as safetensors reports ENOSPC."""
    real = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        if "step-00000002" in str(filename):
            raise safetensors.SafetensorError("Error while serializing: I/O error: "
                                              "No space left on device (os error 28)")
        return real(tensors, filename, metadata=metadata)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def test_a_full_disk_during_a_run_stops_it_in_one_line_and_keeps_latest(tmp_path, monkeypatch, capsys):
    root = tmp_path / "run"
    full_disk_at_step_2(monkeypatch)
    line = assert_one_line_exit_2(capsys, TRAIN + ["--save-dir", root])
    assert ("saving step 2 failed" in line and "No space left on device" in line
            and "latest still names step-00000001" in line)
    assert str(root) in line
    assert latest_step(root) == 1
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001"]  # no partial directory, no lock left


def test_a_read_only_save_dir_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    root = tmp_path / "ro"
    real = os.mkdir

    def mkdir(path, *args, **kwargs):
        if str(path).startswith(str(root)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(os, "mkdir", mkdir)
    line = assert_one_line_exit_2(capsys, TRAIN + ["--save-dir", root])
    assert "Read-only file system" in line and str(root) in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a chmod 0555 folder")
def test_a_chmod_read_only_save_dir_is_refused_in_one_line(tmp_path, capsys):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o555)
    try:
        line = assert_one_line_exit_2(capsys, TRAIN + ["--save-dir", root])
    finally:
        root.chmod(0o755)
    assert "Permission denied" in line


def test_a_save_dir_without_room_for_one_checkpoint_is_refused_before_the_first_step(tmp_path, monkeypatch, capsys):
    real = os.statvfs

    def statvfs(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 1, 1, *tuple(st)[5:]))
    monkeypatch.setattr(os, "statvfs", statvfs)
    line = assert_one_line_exit_2(capsys, TRAIN + ["--save-dir", tmp_path / "full", "--metrics", tmp_path / "m.jsonl"])
    assert "MiB free on its file system" in line and "needs about" in line
    assert not (tmp_path / "m.jsonl").exists() or not (tmp_path / "m.jsonl").read_text()  # no step ran
