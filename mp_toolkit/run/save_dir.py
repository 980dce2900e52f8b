"""The checkpoint root of a run (``--save-dir``): one run at a time, its own checkpoints only, room to save.

Before the first step rank 0:

1. **locks** the root for the run's life: ``fcntl.flock`` on ``<root>/.lock`` (holding the pid of
   the rank that took it). A second run on the same root is refused in one line naming that pid;
   the kernel drops the lock when the process ends, however it ends, so a crashed run never
   blocks the next. The lock is advisory and local: on a network file system without working
   ``flock`` two hosts are not kept apart (RELIABILITY.md).
2. removes the scratch of crashed saves (``.tmp-*``): holding the lock, no other save is in flight.
3. checks the file system has room for one checkpoint: fp32 weights and optimizer state of every
   parameter (`checkpoint_bytes`), against ``statvfs``'s blocks free to this user.
4. picks the run's id: a fresh run draws one, a resumed run keeps the id its checkpoint records
   (``meta.run``). `commit` prunes (``--keep``) only checkpoints of this id.

A fresh run (no ``--resume``) into a root whose ``latest`` names a checkpoint is refused before
any rank starts (`check_fresh`, from `mp_toolkit.run.checks.validate`) unless ``--overwrite``:
its saves would replace those steps and move ``latest`` back.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from mp_toolkit.checkpoint import CheckpointError, clear_scratch, latest_step
from mp_toolkit.partition.cost import OPTIMIZER_STATE_BYTES
from mp_toolkit.run.config import ConfigError, TrainConfig
from mp_toolkit.user_files import link_note, special_kind

try:
    import fcntl
except ImportError:  # not POSIX: no lock, the other checks still run
    fcntl = None

LOCK = ".lock"


def check_fresh(cfg: TrainConfig) -> None:
    """Refuse a ``--save-dir`` that is not a directory (a file, a FIFO, a device), and a fresh run into a root
    that holds a committed checkpoint, unless ``--overwrite``."""
    ck = cfg.checkpoint
    if ck.save_dir is not None:
        kind = special_kind(ck.save_dir) or ("a file" if ck.save_dir.exists() else None)
        if kind not in (None, "a directory"):
            raise ConfigError(f"--save-dir {ck.save_dir}{link_note(ck.save_dir)} is {kind}: give a directory for "
                              "the run's checkpoints")
    if ck.save_dir is None or ck.resume is not None or ck.overwrite:
        return
    try:
        step = latest_step(ck.save_dir)
    except CheckpointError as e:
        raise ConfigError(f"--save-dir {ck.save_dir}: {e}") from None
    if step is not None:
        raise ConfigError(f"--save-dir {ck.save_dir} holds checkpoints (latest: step {step}): resume them with "
                          "--resume auto, pick another --save-dir, or pass --overwrite to save this new run there "
                          "(its steps replace those of the same number; the others stay)")


def checkpoint_bytes(n_params: int, optimizer: str) -> int:
    """What one checkpoint of ``n_params`` parameters takes: fp32 masters plus fp32 optimizer state
    (`OPTIMIZER_STATE_BYTES`); headers, the manifest and RNG states are small beside them."""
    return n_params * (4 + OPTIMIZER_STATE_BYTES.get(optimizer, 8))


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still put on the file system of ``path`` (or of its nearest
    existing parent, when it does not exist yet)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class SaveDirLock:
    """The lock on a checkpoint root, held from `acquire` to `release` (rank 0 only)."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.path: Path | None = None

    def acquire(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        path = root / LOCK
        if fcntl is None:
            return
        while True:
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(path, flags, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise ConfigError(f"--save-dir {root} is in use by another run (pid {holder} holds {path}): "
                                  "wait for it to end or pick another --save-dir") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:  # not a file the previous holder unlinked while we waited for it
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still locked: the next run makes a new one
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def prepare(cfg: TrainConfig, lock: SaveDirLock, n_params: int) -> None:
    """Rank 0, before the first step: lock ``--save-dir``, clear its scratch, check there is room
    for one checkpoint. Raises ConfigError (a refused value: exit 2) or CheckpointError."""
    root = cfg.checkpoint.save_dir
    try:
        lock.acquire(root)
        clear_scratch(root)
        free = free_bytes(root)
    except OSError as e:
        where = f" at {e.filename}" if e.filename and Path(e.filename).parent != root else ""
        raise CheckpointError(f"--save-dir {root} cannot hold a run's checkpoints ({e.strerror or e}{where}): "
                              "pick a directory you can write") from None
    need = checkpoint_bytes(n_params, cfg.optim.optimizer)
    if free < need:
        raise ConfigError(f"--save-dir {root}: {free / 2**20:.1f} MiB free on its file system, one checkpoint "
                          f"of this model needs about {need / 2**20:.1f} MiB ({n_params:,} parameters, fp32 "
                          f"weights and {cfg.optim.optimizer} state): free space or pick another --save-dir")


def new_run_id() -> str:
    return secrets.token_hex(8)
