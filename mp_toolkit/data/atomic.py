"""Files that appear whole or not at all: written under a temporary name beside their own, fsynced, renamed
(or linked) into place, then the directory fsynced; an error or a kill leaves no file and no temporary.

Ranks that race to write the same deterministic cache each write their own temporary and the last rename
wins, so a reader never sees a partial file. The temporary is ``.NAME.RANDOM.tmp``: hidden, in the target's
directory (a rename across file systems would not be atomic).

    write_file(cache / "tokenizer-ab12.json", tokenizer.save)              # 0600: a cache of the corpus
    write_bytes(out / "manifest.json", data, private=False)                # the umask's mode: data to share
    write_bytes(out / "prepare.json", data, private=False, replace=False)  # False: one was there first
    save_array(cache / "e0-shuffle.npy", order); order = load_array(cache / "e0-shuffle.npy")
    with int64_memmap(cache / "segments.npy", (n, 4)) as segments:         # filled in place, then renamed
        segments[:] = ...

``private`` (the default) makes the file 0600, as `tempfile.mkstemp` would: caches hold what the corpus
says, readable by their owner only. ``private=False`` leaves the umask's mode (a prepared corpus).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from tokenize import TokenError

import numpy as np

TRIES = 100  # fresh random names tried for a temporary before giving up (a clash is 1 in 2**32)


def write_file(path: Path, write: Callable[[str], object], *, private: bool = True, replace: bool = True) -> bool:
    """``write(name)`` fills a new temporary file, which becomes ``path`` (module docstring); True.
    ``replace=False``: only when ``path`` does not exist (linked, not renamed), False when it does."""
    with _temporary(path, private) as tmp:
        write(tmp)
        return _commit(tmp, path, replace)


def write_bytes(path: Path, data: bytes, *, private: bool = True, replace: bool = True) -> bool:
    """``data`` as ``path`` (`write_file`)."""
    return write_file(path, lambda tmp: Path(tmp).write_bytes(data), private=private, replace=replace)


def save_array(path: Path, array: np.ndarray) -> None:
    """``array`` as the ``.npy`` file ``path`` (`write_file`, 0600)."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object, so np.save does not append ".npy" to the name
            np.save(f, array, allow_pickle=False)

    write_file(path, write)


def load_array(path: Path, length: int | None = None, columns: int | None = None) -> np.ndarray | None:
    """The int64 array in ``path``, memory-mapped: 1-d of ``length`` (any when None), or (rows, ``columns``)
    when ``columns`` is given; None when missing or damaged (truncated, another dtype or shape): rebuild it."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError, SyntaxError, TokenError, RecursionError):  # numpy parses the header
        return None  # as Python source: a damaged one fails in its tokenizer or parser too
    shape_ok = array.ndim == 1 if columns is None else (array.ndim == 2 and array.shape[1] == columns)
    if array.dtype != np.int64 or not shape_ok or (length is not None and len(array) != length):
        return None
    return array


@contextmanager
def int64_memmap(path: Path, shape: tuple[int, ...]) -> Iterator[np.memmap]:
    """An int64 ``.npy`` memory map of ``shape`` under a temporary name, for the block to fill; it becomes
    ``path`` when the block ends without an error (0600)."""
    with _temporary(path, private=True) as tmp:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int64, shape=shape)
        yield out
        out.flush()
        _commit(tmp, path, replace=True)


@contextmanager
def _temporary(path: Path, private: bool) -> Iterator[str]:
    """The name of a new empty file beside ``path`` (0600 when ``private``, else the umask's mode), removed
    when the block ends unless `_commit` renamed it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = 0o600 if private else 0o666  # O_CREAT applies the umask to the latter
    for _ in range(TRIES):
        tmp = str(path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp"))
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary name for {path} after {TRIES} tries")
    try:
        yield tmp
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _commit(tmp: str, path: Path, replace: bool) -> bool:
    """fsync ``tmp``, rename it to ``path`` (``replace=False``: link it, False when ``path`` exists), fsync the
    directory so the new name survives a crash."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    if replace:
        os.replace(tmp, path)
    else:
        try:
            os.link(tmp, path)  # fails when path exists, where a rename would overwrite it
        except FileExistsError:
            return False
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return True
