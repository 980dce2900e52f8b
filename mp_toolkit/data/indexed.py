"""Megatron's indexed-dataset format: token sequences in ``PREFIX.bin``, where they lie in ``PREFIX.idx``.

The format Megatron-LM, Megatron-DeepSpeed, GPT-NeoX and NeMo write with ``preprocess_data.py``, so
a corpus prepared by any of them trains here unchanged and ours trains there (tested against
megatron-core's own ``IndexedDataset`` reader and builder, tests/test_indexed.py)::

    PREFIX.bin   every sequence's tokens, back to back, in one dtype, no header
    PREFIX.idx   b"MMIDIDX\\x00\\x00"    9 bytes, the magic
                 version             u64 little-endian, 1
                 dtype code          u8 (`DTYPE_CODES`: 1 uint8 ... 8 uint16)
                 sequence count S    u64
                 document count D+1  u64 (the length of document_indices)
                 sequence_lengths    int32[S]   tokens per sequence
                 sequence_pointers   int64[S]   byte offset of each sequence in PREFIX.bin
                 document_indices    int64[D+1] document d is sequences [di[d], di[d+1]); di[0] = 0, di[D] = S

A *sequence* is what one read returns: a whole document for a causal-LM corpus, a sentence for one
prepared with ``--split-sentences`` (BERT), whose documents are then groups of sentences.

`IndexedDataset` memory-maps both files: opening reads the 34-byte header and checks it against the
files' sizes (O(1), whatever the corpus size); every read checks its own range against ``.bin``'s
size, so a damaged index gives a `DataError` naming the file, never an out-of-range read. `validate`
checks every pointer, length and document index (in bounded chunks: ``mpt data verify``).
`IndexedWriter` writes ``.bin`` then ``.idx`` under temporary names and renames ``.idx`` last: a
prefix whose ``.idx`` exists is complete.
"""

from __future__ import annotations

import array
import hashlib
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mp_toolkit.data.rows import pread, preads
from mp_toolkit.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34
DTYPE_CODES = {1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
               5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16)}
"""Megatron's ``DType`` codes (it has no uint32: a vocabulary past uint16 is stored as int32)."""
CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}
CHECK_CHUNK = 1 << 20  # index entries per step of `validate`: bounded memory whatever the corpus


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype Megatron's format has for ids below ``vocab_size``: uint16 or int32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.idx")


def is_complete(prefix: str | os.PathLike) -> bool:
    """A prefix `IndexedWriter` finished: its ``.idx`` (renamed last) is there."""
    return idx_path(prefix).is_file() and bin_path(prefix).is_file()


class IndexedDataset:
    """A memory-mapped ``PREFIX.bin`` / ``PREFIX.idx`` pair (module docstring); opening is O(1).

    ``ds[i]`` / ``ds.get(i, offset, length)``: sequence i's tokens (a read-only view of the mapped
    ``.bin``); ``sequence_lengths``, ``sequence_pointers``, ``document_indices``: the mapped index arrays.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx, data = idx_path(prefix), bin_path(prefix)
        for path in (idx, data):
            if not path.is_file():
                raise DataError(f"{path} does not exist: is {prefix} a prepared corpus (PREFIX.bin + PREFIX.idx)?")
        size = idx.stat().st_size
        try:
            with open(idx, "rb") as f:
                head = f.read(HEADER_BYTES)
        except OSError as e:
            raise DataError(f"cannot read {idx}: {e.strerror}") from None
        if len(head) < HEADER_BYTES or head[: len(MAGIC)] != MAGIC:
            raise DataError(f"{idx} is not a Megatron indexed-dataset index (no MMIDIDX header)")
        version, code, sequences, doc_entries = struct.unpack("<QBQQ", head[len(MAGIC):])
        if version != VERSION:
            raise DataError(f"{idx} has index version {version}; only version {VERSION} is read")
        if code not in DTYPE_CODES:
            raise DataError(f"{idx} names dtype code {code}, not one of {sorted(DTYPE_CODES)}")
        self.dtype = DTYPE_CODES[code]
        if doc_entries < 1:
            raise DataError(f"{idx} has no document indices (its header counts 0); an index holds at least "
                            "the leading 0: edited or damaged")
        expected = HEADER_BYTES + sequences * (4 + 8) + doc_entries * 8
        if size != expected:
            raise DataError(f"{idx} is {size} bytes but its header ({sequences} sequences, {doc_entries} document "
                            f"entries) needs {expected}: truncated or edited")
        self.bin_bytes = data.stat().st_size
        if self.bin_bytes % self.dtype.itemsize:
            raise DataError(f"{data} is {self.bin_bytes} bytes, not a whole number of {self.dtype} tokens")
        self.num_tokens = self.bin_bytes // self.dtype.itemsize
        index = np.memmap(idx, dtype=np.uint8, mode="r") if size else None
        self.sequence_lengths = np.frombuffer(index, np.int32, sequences, HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(index, np.int64, sequences, HEADER_BYTES + 4 * sequences)
        self.document_indices = np.frombuffer(index, np.int64, doc_entries, HEADER_BYTES + 12 * sequences)
        if self.document_indices[0] != 0 or self.document_indices[-1] != sequences:
            raise DataError(f"{idx}: document indices run {int(self.document_indices[0])}.."
                            f"{int(self.document_indices[-1])}, not 0..{sequences}: edited or damaged")
        if sequences and not self._fits(sequences - 1):
            raise DataError(f"{idx}: the last sequence lies past the end of {data} ({self.bin_bytes} bytes): "
                            "the .bin is truncated or the index edited")
        self.tokens = np.memmap(data, dtype=self.dtype, mode="r") if self.bin_bytes else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def entry(self, i: int) -> tuple[int, int]:
        """(byte pointer, token count) of sequence ``i``, read from ``.idx`` (`rows.pread`: nothing mapped)."""
        length, pointer = preads(idx_path(self.prefix), [(HEADER_BYTES + 4 * i, 4),
                                                         (HEADER_BYTES + 4 * len(self) + 8 * i, 8)])
        return int(np.frombuffer(pointer, np.int64)[0]), int(np.frombuffer(length, np.int32)[0])

    def document_bounds(self, d: int) -> tuple[int, int]:
        """(first sequence, sequence after the last) of document ``d``, read from ``.idx``."""
        at = HEADER_BYTES + 12 * len(self) + 8 * d
        first, end = np.frombuffer(pread(idx_path(self.prefix), at, 16), np.int64)
        return int(first), int(end)

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` of ``.bin`` (token offsets), copied by `rows.pread`."""
        if not (0 <= start and 0 <= count and start + count <= self.num_tokens):
            raise DataError(f"{bin_path(self.prefix)}: tokens [{start}, {start + count}) lie outside its "
                            f"{self.num_tokens}: the index is damaged")
        size = self.dtype.itemsize
        return np.frombuffer(pread(bin_path(self.prefix), start * size, count * size), self.dtype)

    def _fits(self, i: int, entry: tuple[int, int] | None = None) -> bool:
        start, n = self.entry(i) if entry is None else entry
        return n >= 0 and start >= 0 and start % self.dtype.itemsize == 0 and start + n * self.dtype.itemsize <= \
            self.bin_bytes

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (to its end when length is None)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} of {len(self)} in {self.prefix}")
        pointer, n = self.entry(i)
        if not self._fits(i, (pointer, n)):
            raise DataError(f"{idx_path(self.prefix)}: sequence {i} (pointer {pointer}, {n} tokens) lies outside "
                            f"{bin_path(self.prefix)}: damaged")
        length = n - offset if length is None else length
        if not (0 <= offset and 0 <= length and offset + length <= n):
            raise IndexError(f"tokens [{offset}, {offset + length}) of a {n}-token sequence")
        return self.read(pointer // self.dtype.itemsize + offset, length)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def document(self, d: int) -> range:
        """The sequence numbers of document ``d``."""
        if not 0 <= d < self.num_documents:
            raise IndexError(f"document {d} of {self.num_documents} in {self.prefix}")
        return range(int(self.document_indices[d]), int(self.document_indices[d + 1]))

    def validate(self) -> None:
        """Every index entry against the files (chunks of `CHECK_CHUNK` entries, memory bounded): lengths
        non-negative, pointers back to back from 0 and inside ``.bin``, document indices non-decreasing."""
        idx, item = idx_path(self.prefix), self.dtype.itemsize
        expect = 0  # where the next sequence must start, in bytes
        for lo in range(0, len(self), CHECK_CHUNK):
            lengths = self.sequence_lengths[lo : lo + CHECK_CHUNK].astype(np.int64)
            pointers = self.sequence_pointers[lo : lo + CHECK_CHUNK]
            starts = expect + np.concatenate(([0], np.cumsum(lengths[:-1] * item)))
            bad = np.flatnonzero((lengths < 0) | (pointers != starts))
            if len(bad):
                i = lo + int(bad[0])
                raise DataError(f"{idx}: sequence {i} has pointer {int(self.sequence_pointers[i])} and length "
                                f"{int(self.sequence_lengths[i])}, which do not follow the sequence before it")
            expect = int(starts[-1]) + int(lengths[-1]) * item
            if expect > self.bin_bytes:  # also keeps the next chunk's int64 sums from overflowing
                raise DataError(f"{idx}: sequences 0..{lo + len(lengths) - 1} already hold {expect} bytes, more than "
                                f"the {self.bin_bytes} of {bin_path(self.prefix)}: the index is edited or damaged")
        if expect != self.bin_bytes:
            raise DataError(f"{idx}: its sequences hold {expect} bytes, {bin_path(self.prefix)} has {self.bin_bytes}")
        prev = 0
        for lo in range(0, len(self.document_indices), CHECK_CHUNK):
            chunk = self.document_indices[lo : lo + CHECK_CHUNK]
            if chunk[0] < prev or np.any(np.diff(chunk) < 0):
                raise DataError(f"{idx}: document indices decrease near entry {lo}: damaged")
            prev = int(chunk[-1])


class IndexedWriter:
    """Writes one ``PREFIX.bin`` / ``PREFIX.idx`` pair; nothing under the final names until `finalize`.

        with IndexedWriter("out/train-00000", np.uint16) as w:
            w.add_document([ids])                  # a document of one sequence
            w.add_document([sent1, sent2, sent3])  # --split-sentences: a document of sentences
            info = w.finalize()

    The ``.bin`` is written as documents arrive (memory: the index arrays, 12 bytes per sequence);
    leaving the ``with`` block without `finalize` (an error, a kill) leaves only ``*.partial`` files,
    which a later writer of the same prefix replaces.
    """

    def __init__(self, prefix: str | os.PathLike, dtype):
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise DataError(f"dtype {self.dtype} is not in Megatron's format ({', '.join(map(str, CODE_OF))})")
        self._bin_tmp = Path(f"{prefix}.bin.partial")
        self._bin_tmp.parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self._hash = hashlib.sha256()
        self._lengths = array.array("i")  # 4 bytes a sequence, 8 a document: the index, not a list of arrays
        self._docs = array.array("q", [0])
        self._sequences = 0
        self._bytes = 0

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, *exc) -> None:
        if self._bin is not None:  # not finalized
            self.discard()

    def add_document(self, sequences: Sequence) -> None:
        """One document: its sequences' tokens (each a 1-D array-like of ids that fit the dtype)."""
        self._check_open()
        arrays = [self._checked(np.asarray(s)) for s in sequences]
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
        if arrays:
            data = np.concatenate(arrays).astype(self.dtype, copy=False) if len(arrays) > 1 else \
                arrays[0].astype(self.dtype, copy=False)
            raw = data.tobytes()
            self._bin.write(raw)
            self._hash.update(raw)
            self._bytes += len(raw)
        self._lengths.extend(lengths.tolist())
        self._sequences += len(arrays)
        self._docs.append(self._sequences)

    def _check_open(self) -> None:
        if self._bin is None:
            raise ValueError(f"the IndexedWriter of {self.prefix} is already finalized or discarded")

    def _checked(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` if the dtype holds them exactly (``astype`` would wrap 65536 to 0 in uint16)."""
        if ids.ndim != 1:
            raise DataError(f"{self.prefix}: a sequence of shape {ids.shape}, not a 1-D list of token ids")
        if self.dtype.kind in "iu" and ids.size:
            if ids.dtype.kind not in "iu":
                raise DataError(f"{self.prefix}: token ids of dtype {ids.dtype}, not integers for {self.dtype}")
            info = np.iinfo(self.dtype)
            low, high = int(ids.min()), int(ids.max())
            if low < info.min or high > info.max:
                raise DataError(f"{self.prefix}: token id {low if low < info.min else high} does not fit {self.dtype} "
                                f"({info.min}..{info.max}): write with token_dtype(vocab_size)")
        return ids

    def finalize(self) -> dict:
        """Write the ``.idx`` and rename both (``.idx`` last); returns the shard's counts, sizes and digests.
        On any failure the ``*.partial`` files are removed and the prefix is left incomplete."""
        self._check_open()
        try:
            return self._finalize()
        except BaseException:
            self.discard()
            raise

    def _finalize(self) -> dict:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        self._bin = None
        lengths = np.frombuffer(self._lengths, np.int32) if len(self._lengths) else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        if len(lengths):
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        header = MAGIC + struct.pack("<QBQQ", VERSION, CODE_OF[self.dtype], len(lengths), len(self._docs))
        body = header + lengths.tobytes() + pointers.tobytes() + np.frombuffer(self._docs, np.int64).tobytes()
        idx_tmp = Path(f"{self.prefix}.idx.partial")
        with open(idx_tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        # An older shard of this prefix stops being complete before its .bin is replaced: a failure between
        # the renames must not leave the new .bin beside the old .idx, which would open and read wrong tokens.
        idx_path(self.prefix).unlink(missing_ok=True)
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(idx_tmp, idx_path(self.prefix))  # last: the prefix is complete from here
        _fsync_dir(idx_tmp.parent)
        return {"documents": len(self._docs) - 1, "sequences": int(len(lengths)),
                "tokens": self._bytes // self.dtype.itemsize, "bin_bytes": self._bytes, "idx_bytes": len(body),
                "bin_sha256": self._hash.hexdigest(), "idx_sha256": hashlib.sha256(body).hexdigest()}

    def discard(self) -> None:
        """Drop what was written (the final names are never touched)."""
        if self._bin is not None:
            self._bin.close()
            self._bin = None
        for tmp in (self._bin_tmp, Path(f"{self.prefix}.idx.partial")):
            tmp.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
