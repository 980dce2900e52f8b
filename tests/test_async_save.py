"""Issue 39, item 2: ``--async-save`` writes checkpoints in the background (`mp_toolkit.run.async_save`).

Real ranks on gpt-tiny (two pipeline stages, fp32) for what crosses processes -- the same
checkpoints as synchronous saves, a failed background write on another rank, a rank killed while
its writer runs -- and, in this process (one rank), every write-side call of a run's saves failed in
turn, as tests/test_storage_faults.py does for synchronous saves.
"""

import os
import threading

import pytest

from mp_toolkit.checkpoint import latest_step, open_checkpoint
from mp_toolkit.cli import main
from tests.fault_workers import differing, mpt_job, rows, tensors
from tests.test_fault_tolerance import finish
from tests.test_storage_faults import ERRORS, FailingDisk, full_disk_at_step_2
from tests.test_storage_faults import TRAIN as ONE_RANK

SAVED = ("--save-every", "2")
STRIDE = 4
"""Of the writers' ~150 calls, every 4th is failed (each run takes half a second); the calls repeat one
pattern per file, and `tools.reliability async-faults` fails writes across real ranks."""


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory):
    """The same run saved synchronously: (its checkpoint root, its metrics rows)."""
    tmp = tmp_path_factory.mktemp("sync")
    job = mpt_job(tmp, *SAVED, "--save-dir", str(tmp / "ck"), "--metrics", str(tmp / "m.jsonl"), "--keep", "0")
    assert finish(job, 240) == 0, job.stderr
    return tmp / "ck", rows(tmp / "m.jsonl")


def scratch(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))


def test_background_saves_write_the_synchronous_checkpoints(tmp_path, synchronous):
    """Every checkpoint (steps 2, 4, 6, 8) is bitwise the synchronous run's, and so are the losses."""
    root = tmp_path / "ck"
    job = mpt_job(tmp_path, *SAVED, "--async-save", "--save-dir", str(root), "--metrics", str(tmp_path / "m.jsonl"),
                  "--keep", "0")
    assert finish(job, 240) == 0, job.stderr
    assert "--async-save: a save's host copy holds up to " in job.stdout
    ref_root, ref_rows = synchronous
    assert [r["loss"] for r in rows(tmp_path / "m.jsonl")] == [r["loss"] for r in ref_rows]
    for step in (2, 4, 6, 8):
        assert differing(tensors(root, step), tensors(ref_root, step)) == [], step
    assert scratch(root) == []


def test_a_failed_background_write_on_another_rank_stops_the_run_at_the_next_save(tmp_path):
    """Rank 1's writer fails its second file of step 4's save with ENOSPC: the run stops at the next save
    (step 6) in one line naming step 4, exit 2; latest names step 2 and verifies; nothing is left."""
    root = tmp_path / "ck"
    job = mpt_job(tmp_path, *SAVED, "--async-save", "--save-dir", str(root),
                  faults={"save_error": {"rank": 1, "step": 4, "file": 1}})
    assert finish(job, 240) == 2, job.stderr
    errors = [line for line in job.stderr.splitlines() if line.startswith("mpt train")]
    assert len(errors) == 1 and "Traceback" not in job.stderr, job.stderr
    assert errors[0].startswith("mpt train: error: saving step 4 failed: ") and "No space left on device" in errors[0]
    assert errors[0].endswith("latest still names step-00000002"), errors
    assert latest_step(root) == 2
    open_checkpoint(root).verify()
    assert scratch(root) == []


def test_a_rank_killed_during_its_background_write_resumes_from_the_previous_checkpoint(tmp_path, synchronous):
    """Rank 1 SIGKILLs itself in its writer once its files of step 4 are written: latest stays on step 2,
    --restarts 1 resumes from it and the run ends bitwise as the synchronous one."""
    root = tmp_path / "ck"
    job = mpt_job(tmp_path, *SAVED, "--async-save", "--save-dir", str(root), "--restarts", "1",
                  "--metrics", str(tmp_path / "m.jsonl"), faults={"kill": {"rank": 1, "step": 4, "in": "save"}})
    assert finish(job, 240) == 0, job.stderr
    assert "restart 1 of 1: resuming from step-00000002" in job.stderr, job.stderr
    ref_root, ref_rows = synchronous
    assert [r["loss"] for r in rows(tmp_path / "m.jsonl")] == [r["loss"] for r in ref_rows]
    assert differing(tensors(root), tensors(ref_root)) == []


class WriterDisk(FailingDisk):
    """`FailingDisk` counting (and failing) only the calls of the background writers."""

    def _wrap(self, real, data):
        failing = super()._wrap(real, data)
        return lambda *a, **k: (failing if threading.current_thread().name.startswith("mpt async save")
                                else real)(*a, **k)


def _run_one_rank(root, capsys) -> tuple[int, str]:
    code = main([str(a) for a in [*ONE_RANK, "--async-save", "--save-dir", root]])
    return code, capsys.readouterr().err


def test_failing_writes_of_background_saves_leave_a_complete_latest(tmp_path, monkeypatch, capsys):
    """Every `STRIDE`-th write-side call of the background writers of a two-step run saving after both steps
    (about 150 calls), failed once in turn (ENOSPC, EIO, EROFS): the run ends in one line (exit 2) or
    succeeds (a failure past the commit point), ``latest``
    names a complete checkpoint (or none yet), no step directory is partial."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # see FailingDisk
    with monkeypatch.context() as m:
        disk = WriterDisk(m)
        code, err = _run_one_rank(tmp_path / "count", capsys)
        assert code == 0, err
    assert disk.calls >= 10, disk.calls
    failed, tried = 0, range(1, disk.calls + 1, STRIDE)
    for n in tried:
        root = tmp_path / f"n{n}"
        with monkeypatch.context() as m:
            WriterDisk(m, fail_at=n, code=ERRORS[n % len(ERRORS)])
            code, err = _run_one_rank(root, capsys)
        lines = err.strip().splitlines()
        assert code in (0, 2) and "Traceback" not in err, (n, code, err)
        if code == 2:
            failed += 1
            assert len(lines) == 1 and lines[0].startswith("mpt train: error: "), (n, err)
        if root.is_dir() and latest_step(root) is not None:
            open_checkpoint(root).verify()
            for d in root.glob("step-*"):
                open_checkpoint(d).verify()
    assert failed >= len(tried) // 2, (failed, len(tried))


def test_a_full_disk_in_the_background_stops_in_one_line_and_keeps_latest(tmp_path, monkeypatch, capsys):
    """The last save (step 2) fails in its writer: the run's end waits for it and says so in one line."""
    full_disk_at_step_2(monkeypatch)
    code, err = _run_one_rank(tmp_path / "run", capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "saving step 2 failed" in lines[0] and "No space left on device" in lines[0]
    assert lines[0].endswith("latest still names step-00000001")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["latest", "step-00000001"]


def test_background_saves_gather_tp_shards_and_zero_pieces_as_synchronous_ones(tmp_path):
    """pp 1 x tp 2 x dp 2 with ZeRO-1: the gathers run in the training thread (the buffers' after step 1,
    each save's), the files equal a synchronous save's bit for bit."""
    layout = ("--pp", "1", "--tp", "2", "--dp", "2", "--zero", "1", "--steps", "4")
    roots = {}
    for mode in ("sync", "async"):
        roots[mode] = tmp_path / mode / "ck"
        (tmp_path / mode).mkdir()
        job = mpt_job(tmp_path / mode, *layout, *SAVED, "--save-dir", str(roots[mode]),
                      *(("--async-save",) if mode == "async" else ()))
        assert finish(job, 240) == 0, job.stderr
    for step in (2, 4):
        assert differing(tensors(roots["async"], step), tensors(roots["sync"], step)) == [], step
