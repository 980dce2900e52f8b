"""Reading a few entries of a large on-disk array without mapping it: `pread`, and `FileRows`.

A memory map of a multi-GB index or token file is cheap to open, but every page a random read touches
stays mapped into the process, and this kernel maps the page cache in large folios (2 MiB), so a
training rank that reads a few random samples per step ends up with tens of MiB of the files counted
in its resident memory, growing with the corpus. Reading with ``pread`` copies exactly the bytes asked
for: the page cache still holds the file (shared, reclaimable), the process holds nothing of it.

    rows = FileRows.npy("cache/e0-shuffle.npy")     # a 1-d .npy file, nothing read yet
    shard = rows[1::2][:1000]                        # still nothing read: a view (start, step, count)
    first = [int(r) for r in shard[:8]]              # reads the bytes of those 8 entries only
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mp_toolkit.errors import DataError


def pread(path: str | os.PathLike, offset: int, size: int) -> bytes:
    """``size`` bytes of ``path`` from ``offset``; a `DataError` when the file is shorter."""
    return preads(path, [(offset, size)])[0]


def preads(path: str | os.PathLike, spans: list[tuple[int, int]]) -> list[bytes]:
    """The bytes of each (offset, size) of ``path``, the file opened once."""
    out = []
    with open(path, "rb", buffering=0) as f:
        for offset, size in spans:
            data = os.pread(f.fileno(), size, offset)
            if len(data) != size:
                raise DataError(f"{path} ends before byte {offset + size}: truncated since it was opened")
            out.append(data)
    return out


class FileRows:
    """Entries ``start, start + step, ...`` (``count`` of them) of a 1-d array of ``dtype`` stored in
    ``path`` from byte ``offset``: sliced lazily, read by `pread` when indexed by an int or iterated."""

    def __init__(self, path: str | os.PathLike, dtype, offset: int, count: int, start: int = 0, step: int = 1):
        self.path, self.dtype, self.offset = Path(path), np.dtype(dtype), offset
        self.count, self.start, self.step = count, start, step

    @classmethod
    def npy(cls, path: str | os.PathLike) -> FileRows:
        """The 1-d array of a ``.npy`` file (its header read; the data not)."""
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = header(f)
            offset = f.tell()
        if len(shape) != 1:
            raise DataError(f"{path} holds a {len(shape)}-d array, not a vector")
        return cls(path, dtype, offset, shape[0])

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key):
        if isinstance(key, slice):
            first, stop, step = key.indices(self.count)
            if step < 0:
                raise ValueError("FileRows reads forward: slice it with a positive step")
            count = len(range(first, stop, step))
            return FileRows(self.path, self.dtype, self.offset, count, self._at(first) if count else 0,
                            self.step * step)
        i = int(key)
        if i < 0:
            i += self.count
        if not 0 <= i < self.count:
            raise IndexError(f"entry {key} of {self.count} in {self.path}")
        size = self.dtype.itemsize
        return np.frombuffer(pread(self.path, self.offset + self._at(i) * size, size), self.dtype)[0]

    def _at(self, i: int) -> int:
        return self.start + i * self.step

    def read(self) -> np.ndarray:
        """Every entry of this view, as an array (one read of the bytes they span)."""
        if self.count == 0:
            return np.zeros(0, self.dtype)
        lo, hi, size = self._at(0), self._at(self.count - 1), self.dtype.itemsize
        span = np.frombuffer(pread(self.path, self.offset + lo * size, (hi - lo + 1) * size), self.dtype)
        return span[:: self.step]

    def __iter__(self):
        return iter(self.read())

    def __array__(self, dtype=None, copy=None):
        out = self.read()
        return out if dtype is None else out.astype(dtype)

    def tolist(self) -> list:
        return self.read().tolist()
