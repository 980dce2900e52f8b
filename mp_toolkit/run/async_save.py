"""``--async-save``: checkpoints written in the background while training goes on.

The save of step s starts as a synchronous one does (`run.state.save_state`): rank 0 makes the temp
directory, every rank agrees, and each rank does its gathers (tp, ZeRO-1) in the training thread. But
instead of writing each shard, it copies the tensors to host memory (on CPU: a copy in memory) and
hands the writes to a thread of its own; step s + 1 starts once the copies are made. Each rank's
writer then writes its files (fsynced, renamed into place, as always) and leaves a marker
``rank-XXXXX`` (empty, or its one-line error) in ``root/.tmp-async-step-XXXXXXXX``; rank 0's writer
waits for every rank's marker (up to --timeout), then commits -- hashes, ``manifest.json``, the
rename, ``latest``, pruning -- exactly as a synchronous save, or, when any rank failed, removes the
temp directory. No collective runs outside the training thread: the writers meet through the files.

A second save, a rewind (`run.spikes`), the end of the run and a preemption stop first wait for the
save in flight (`AsyncSaver.finish`) and agree on its outcome: a failed background write stops every
rank there with the synchronous save's line (exit 2), ``latest`` still on the previous complete
checkpoint. A rank killed during the background write leaves the temp directory (and its markers),
which loaders ignore and the next start removes, and ``latest`` where it was.

Memory: each writer holds its copy (its layers' fp32 tensors, whole across tp, and their optimizer
state) from the end of the first step to the end of the run: a thread makes the buffers after the first
step (`AsyncSaver.prepare`), and every save copies into them, so no save pays for faulting pages in.
The planner adds the copy to those ranks' prediction (`copy_bytes`) and rank 0 prints the largest
copy at the first save.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import torch

from mp_toolkit.checkpoint import CheckpointError, begin, commit, discard
from mp_toolkit.checkpoint.files import TMP_PREFIX, step_dir_name
from mp_toolkit.errors import PeerFailed
from mp_toolkit.parallel.agree import agree
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.run.metrics import gather_ints
from mp_toolkit.run.state import one_line, still_latest, write_shards

POLL_S = 0.05


def host_copy(value, into=None):
    """``value`` with every tensor in it (nested dicts and tuples) copied to host memory: into the
    tensor at the same place of ``into`` (an earlier copy) when it has the same shape and dtype, so a
    later save reuses the pages an earlier one faulted in, else into a new one."""
    if torch.is_tensor(value):
        if torch.is_tensor(into) and into.shape == value.shape and into.dtype == value.dtype:
            return into.copy_(value.detach())
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        into = into if isinstance(into, dict) else {}
        return {k: host_copy(v, into.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        into = into if isinstance(into, type(value)) and len(into) == len(value) else [None] * len(value)
        return type(value)(host_copy(v, old) for v, old in zip(value, into))
    return value


def _bytes_of(value) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_bytes_of(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_bytes_of(v) for v in value)
    return 0


def markers_dir(root: Path, step: int) -> Path:
    return root / f"{TMP_PREFIX}async-{step_dir_name(step)}"


class AsyncSaver:
    """This rank's background checkpoint writer; at most one save in flight."""

    def __init__(self, ctx: ParallelContext, timeout_s: float, log):
        self.ctx, self.timeout_s, self.log = ctx, timeout_s, log
        self.thread: threading.Thread | None = None
        self.error: CheckpointError | None = None
        self.step: int | None = None
        self.root: Path | None = None
        self.copied = False  # the copy's size said once
        self.staging: list = []  # the last save's copies, reused by the next (its writer is done by then)
        self.prefault: threading.Thread | None = None

    def prepare(self, engine, names) -> None:
        """After the first step (every rank alike: it runs the saves' gathers once): make the copy's buffers
        in a thread of their own, so the first save copies into memory already faulted in (fresh pages cost
        0.4 GB/s on the machine measured, against 13 GB/s for a copy into touched ones). The values the
        thread copies are stale and overwritten at the save. Once per run (a rewind to the first checkpoint
        brings the first step back)."""
        if self.prefault is not None or self.staging:
            return
        shapes: list = []
        write_shards(None, engine, self.ctx, names, sink=lambda write, args: shapes.append((write, args)))
        self.prefault = threading.Thread(target=self._touch, args=(shapes,), name="mpt async save buffers",
                                         daemon=True)
        self.prefault.start()

    def _touch(self, shapes: list) -> None:
        self.staging = [(write, host_copy(args)) for write, args in shapes]

    def save(self, root: Path, meta: dict | None, engine, names, step: int, keep: int | None,
             after_shards=None, fail_at: int | None = None) -> None:
        """Start saving ``step`` (every rank calls it after the same step; rank 0 passes ``meta``).
        Returns once this rank's share is copied (into the buffers `prepare` made, when it ran);
        ``after_shards`` (a test's fault hook) runs in the writer once its files are written, ``fail_at``
        fails that write (0-based, modulo the writes this rank makes) with ENOSPC."""
        self.finish()
        if self.prefault is not None:
            self.prefault.join()
            self.prefault = None
        ctx, error, tmp = self.ctx, None, None
        try:
            if ctx.rank == 0:
                tmp = begin(root, step, create=True)
                markers = markers_dir(root, step)
                discard(markers)
                markers.mkdir()
            else:
                tmp = begin(root, step, create=False)
        except (CheckpointError, OSError) as e:
            error = one_line(e, root)
        self._agree(error, root, step, tmp)  # the directories exist before anyone writes into them
        jobs: list = []

        def stage(write, args):
            old = self.staging[len(jobs)][1] if len(jobs) < len(self.staging) else None
            jobs.append((write, host_copy(args, old)))
        write_shards(tmp, engine, ctx, names, sink=stage)
        self.staging = jobs
        if not self.copied:
            self.copied = True
            largest = max(gather_ints(sum(_bytes_of(args) for _, args in jobs), ctx.device))
            self.log.note(f"--async-save: a save's host copy holds up to {largest / 2**20:.1f} MiB on one rank "
                          f"until its files are written")
        self.step, self.root, self.error = step, root, None
        self.thread = threading.Thread(target=self._write, name=f"mpt async save {step}", daemon=True,
                                       args=(root, tmp, meta, jobs, keep, after_shards, fail_at))
        self.thread.start()

    def _write(self, *args) -> None:
        try:
            self._write_and_commit(*args)
        except BaseException as e:  # noqa: BLE001 -- a bug in the writer must not pass for a committed save
            self.error = CheckpointError(f"the background writer failed: {type(e).__name__}: {e}")

    def _write_and_commit(self, root: Path, tmp: Path, meta, jobs, keep, after_shards, fail_at) -> None:
        error = None
        for i, (write, args) in enumerate(jobs):
            try:
                if fail_at is not None and i == fail_at % len(jobs):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / f"shard {i}"))
                write(*args)
            except (CheckpointError, OSError) as e:
                error = one_line(e, tmp)
                break
        if after_shards is not None and error is None:
            after_shards()
        markers = markers_dir(root, self.step)
        try:
            (markers / f"rank-{self.ctx.rank:05d}").write_text("" if error is None else str(error))
        except OSError as e:
            error = error or one_line(e, markers)
        if self.ctx.rank == 0:
            error = error or self._others_done(markers)
            if error is None:
                try:
                    commit(root, self.step, tmp, meta, keep=keep)
                except (CheckpointError, OSError) as e:
                    error = one_line(e, root)
            if error is not None:
                discard(tmp)
            discard(markers)
        self.error = error

    def _others_done(self, markers: Path) -> CheckpointError | None:
        """Rank 0's writer: wait for every rank's marker; the first failure any reported."""
        deadline = time.monotonic() + self.timeout_s
        for rank in range(1, self.ctx.world_size):
            marker = markers / f"rank-{rank:05d}"
            while not marker.is_file():
                if time.monotonic() > deadline:
                    return CheckpointError(f"rank {rank} did not finish writing its shards within --timeout "
                                           f"{self.timeout_s:g} s")
                time.sleep(POLL_S)
            text = marker.read_text()
            if text:
                return CheckpointError(text)
        return None

    def finish(self) -> None:
        """Wait for the save in flight (if any) on every rank and agree on it: a failure on any rank
        raises on every rank (its line on the lowest failing one) with the synchronous save's words."""
        if self.thread is None:
            return
        self.thread.join()
        self.thread = None
        self._agree(self.error, self.root, self.step, None)

    def _agree(self, error, root: Path, step: int, tmp: Path | None) -> None:
        try:
            agree(error, self.ctx)
        except (CheckpointError, PeerFailed) as e:
            if self.ctx.rank == 0 and tmp is not None:  # a save that failed before its writers started
                discard(tmp)
                discard(markers_dir(root, step))
            if isinstance(e, CheckpointError):
                raise CheckpointError(f"saving step {step} failed: {e}; {still_latest(root)}") from None
            raise
