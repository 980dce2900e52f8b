"""Megatron's indexed-dataset format (`mp_toolkit.data.indexed`): round trips against megatron-core's own
reader and builder, a `DataError` for every kind of damaged file, writers that fail part way, and a
fuzzed index and ``.bin`` that may only ever give a `DataError` or the original tokens."""
import hashlib
import itertools
import os
import struct
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mp_toolkit.data import indexed
from mp_toolkit.data.indexed import (
    HEADER_BYTES,
    MAGIC,
    IndexedDataset,
    IndexedWriter,
    bin_path,
    idx_path,
    is_complete,
    token_dtype,
)
from mp_toolkit.errors import DataError

DTYPES = (np.dtype(np.uint16), np.dtype(np.int32))


@pytest.fixture(scope="module")
def megatron():
    """megatron-core's ``indexed_dataset`` module (imported once: ~8 s), or a skip where it is absent."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Transformer Engine and Apex are not installed"
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def _documents(dtype, split: bool) -> list[list[np.ndarray]]:
    """Eight documents of ids spanning ``dtype``'s range (0 and the top id included), an empty sequence
    among them; ``split``: 0-4 sentences a document (BERT's ``--split-sentences``), one with none."""
    rng = np.random.default_rng(7)
    high = 1 << 16 if dtype == np.uint16 else 1 << 31
    docs = []
    for d in range(8):
        count = (d * 3) % 5 if split else 1  # 0, 3, 1, 4, 2, 0, 3, 1 sentences
        docs.append([rng.integers(0, high, int(rng.integers(1, 40))).astype(dtype) for _ in range(count)])
    docs[2] = [np.zeros(0, dtype)]
    docs[3][0] = np.array([0, high - 1, high - 2], dtype)
    return docs


def _sequences(docs):
    return [s for doc in docs for s in doc]


def _document_indices(docs):
    return np.cumsum([0] + [len(doc) for doc in docs])


def _write(prefix, docs, dtype) -> dict:
    with IndexedWriter(prefix, dtype) as w:
        for doc in docs:
            w.add_document(doc)
        return w.finalize()


def _megatron_write(megatron, prefix, docs, dtype) -> None:
    """As ``preprocess_data.py`` writes: ``add_document`` of the concatenated ids for a causal-LM corpus;
    ``add_item`` per sentence then ``end_document`` exercised for the split one."""
    builder = megatron.IndexedDatasetBuilder(str(bin_path(prefix)), dtype=np.dtype(dtype).type)  # a type, not a dtype
    with warnings.catch_warnings():
        # numpy 2 on torch's Tensor.__array__ (no copy= keyword) inside add_document: not ours to fix
        warnings.simplefilter("ignore", DeprecationWarning)
        for doc in docs:
            if len(doc) == 1:
                builder.add_document(torch.from_numpy(doc[0].astype(np.int64)), [len(doc[0])])
            else:
                for sentence in doc:
                    builder.add_item(torch.from_numpy(sentence.astype(np.int64)))
                builder.end_document()
    builder.finalize(str(idx_path(prefix)))


def _one_line_naming(error: Exception, *paths) -> str:
    message = str(error)
    assert message and "\n" not in message
    assert any(str(p) in message for p in paths), message
    return message


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split", [False, True], ids=["gpt", "sentences"])
def test_megatron_core_reads_what_we_write_and_writes_the_same_bytes(tmp_path, megatron, dtype, split):
    docs = _documents(dtype, split)
    seqs = _sequences(docs)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    info = _write(ours, docs, dtype)
    _megatron_write(megatron, theirs, docs, dtype)

    assert bin_path(ours).read_bytes() == bin_path(theirs).read_bytes()
    assert idx_path(ours).read_bytes() == idx_path(theirs).read_bytes()
    tokens = sum(len(s) for s in seqs)
    assert info == {"documents": 8, "sequences": len(seqs), "tokens": tokens, "bin_bytes": tokens * dtype.itemsize,
                    "idx_bytes": HEADER_BYTES + 12 * len(seqs) + 8 * 9,
                    "bin_sha256": hashlib.sha256(bin_path(ours).read_bytes()).hexdigest(),
                    "idx_sha256": hashlib.sha256(idx_path(ours).read_bytes()).hexdigest()}

    ref = megatron.IndexedDataset(str(ours))
    assert np.dtype(ref.index.dtype) == dtype and len(ref) == len(seqs)
    np.testing.assert_array_equal(ref.document_indices, _document_indices(docs))
    np.testing.assert_array_equal(ref.sequence_lengths, [len(s) for s in seqs])
    for i, s in enumerate(seqs):
        got = ref[i]
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, s)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split", [False, True], ids=["gpt", "sentences"])
def test_we_read_what_megatron_core_writes(tmp_path, megatron, dtype, split):
    docs = _documents(dtype, split)
    seqs = _sequences(docs)
    prefix = tmp_path / "theirs"
    _megatron_write(megatron, prefix, docs, dtype)
    ds, ref = IndexedDataset(prefix), megatron.IndexedDataset(str(prefix))
    ds.validate()
    assert ds.dtype == dtype and len(ds) == len(seqs) and ds.num_documents == 8
    assert ds.num_tokens == sum(len(s) for s in seqs)
    np.testing.assert_array_equal(ds.document_indices, _document_indices(docs))
    np.testing.assert_array_equal(ds.sequence_lengths, [len(s) for s in seqs])
    np.testing.assert_array_equal(ds.sequence_pointers, ref.index.sequence_pointers)
    for d, doc in enumerate(docs):
        assert [ds[i].tolist() for i in ds.document(d)] == [s.tolist() for s in doc]
    for i, s in enumerate(seqs):
        assert ds[i].dtype == dtype
        np.testing.assert_array_equal(ds[i], s)
        # slices agree with the reference's get(i, offset, length) and with the sequence itself
        n = len(s)
        for offset, length in {(0, None), (n // 2, None), (n // 3, n // 2 - n // 3), (n, 0), (0, n)}:
            expect = s[offset:] if length is None else s[offset : offset + length]
            np.testing.assert_array_equal(ds.get(i, offset, length), expect)
            np.testing.assert_array_equal(ref.get(i, offset, length), expect)


def test_an_empty_document_list_round_trips(tmp_path, megatron):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    info = _write(ours, [], np.uint16)
    _megatron_write(megatron, theirs, [], np.uint16)
    # megatron-core's reader cannot mmap its own empty .bin ("cannot mmap an empty file"): the same bytes
    # are the most it can be held to here
    assert bin_path(ours).read_bytes() == bin_path(theirs).read_bytes() == b""
    assert idx_path(ours).read_bytes() == idx_path(theirs).read_bytes() == \
        MAGIC + struct.pack("<QBQQq", 1, 8, 0, 1, 0)
    assert (info["documents"], info["sequences"], info["tokens"], info["idx_bytes"]) == (0, 0, 0, HEADER_BYTES + 8)
    for prefix in (ours, theirs):
        ds = IndexedDataset(prefix)
        ds.validate()
        assert (len(ds), ds.num_documents, ds.num_tokens, ds.dtype) == (0, 0, 0, np.dtype(np.uint16))
        assert ds.document_indices.tolist() == [0]
        with pytest.raises(IndexError):
            ds.get(0)


def test_get_refuses_ranges_outside_the_sequence(tmp_path):
    prefix = tmp_path / "p"
    _write(prefix, [[np.arange(5)], [np.arange(10, 13)]], np.uint16)
    ds = IndexedDataset(prefix)
    assert ds.get(1, 1).tolist() == [11, 12] and ds.get(0, 4, 1).tolist() == [4] and ds.get(0, 5).tolist() == []
    for i, offset, length in [(2, 0, None), (-1, 0, None), (0, 6, None), (0, -1, 2), (0, 3, 3), (0, 0, -1)]:
        with pytest.raises(IndexError):
            ds.get(i, offset, length)
    with pytest.raises(IndexError):
        ds.document(2)
    with pytest.raises(IndexError):
        ds.document(-1)


def test_token_dtype_is_the_narrowest_megatron_has():
    assert token_dtype(50257) == np.uint16 and token_dtype(1 << 16) == np.uint16
    assert token_dtype((1 << 16) + 1) == np.int32 and token_dtype(250_000) == np.int32


# ---- damaged files -------------------------------------------------------------------------------------

DOCS = [[np.arange(5)], [np.arange(100, 103), np.arange(7)], [np.arange(50, 54)]]  # 4 sequences, 3 documents
S, D1 = 4, 4  # sequences, document entries
LENGTHS, POINTERS, DOCIDX = HEADER_BYTES, HEADER_BYTES + 4 * S, HEADER_BYTES + 12 * S  # where each array starts


def _poke(path, offset, fmt, value):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


def _resize(path, size):
    data = path.read_bytes()
    path.write_bytes(data[:size] + b"\x07" * max(0, size - len(data)))


OPEN_DAMAGE = {  # what is done to a uint16 prefix of DOCS -> the file the message names, a word it says
    "missing bin": (lambda p: bin_path(p).unlink(), "bin", "does not exist"),
    "missing idx": (lambda p: idx_path(p).unlink(), "idx", "does not exist"),
    "wrong magic": (lambda p: _poke(idx_path(p), 0, "<B", ord("X")), "idx", "MMIDIDX"),
    "short header": (lambda p: _resize(idx_path(p), 20), "idx", "MMIDIDX"),
    "wrong version": (lambda p: _poke(idx_path(p), 9, "<Q", 2), "idx", "version 2"),
    "unknown dtype": (lambda p: _poke(idx_path(p), 17, "<B", 9), "idx", "dtype code 9"),
    "truncated idx": (lambda p: _resize(idx_path(p), DOCIDX + 8 * D1 - 3), "idx", "truncated"),
    "idx extra bytes": (lambda p: _resize(idx_path(p), DOCIDX + 8 * D1 + 8), "idx", "truncated or edited"),
    "sequence count": (lambda p: _poke(idx_path(p), 18, "<Q", 1 << 62), "idx", "truncated or edited"),
    "no document entries": (lambda p: (_poke(idx_path(p), 26, "<Q", 0), _resize(idx_path(p), DOCIDX)),
                            "idx", "no document indices"),
    "bin truncated": (lambda p: _resize(bin_path(p), 2 * 18), "bin", "past the end"),
    "bin half a token": (lambda p: _resize(bin_path(p), 2 * 19 + 1), "bin", "whole number"),
    "documents from 1": (lambda p: _poke(idx_path(p), DOCIDX, "<q", 1), "idx", "not 0..4"),
    "documents end early": (lambda p: _poke(idx_path(p), DOCIDX + 8 * 3, "<q", 3), "idx", "not 0..4"),
    "last pointer past the end": (lambda p: _poke(idx_path(p), POINTERS + 8 * 3, "<q", 2 * 19), "bin",
                                  "past the end"),
}


@pytest.mark.parametrize("damage", OPEN_DAMAGE, ids=str)
def test_a_damaged_prefix_does_not_open(tmp_path, damage):
    prefix = tmp_path / "p"
    _write(prefix, DOCS, np.uint16)
    IndexedDataset(prefix).validate()
    harm, names, says = OPEN_DAMAGE[damage]
    harm(prefix)
    with pytest.raises(DataError) as e:
        IndexedDataset(prefix)
    assert says in _one_line_naming(e.value, (bin_path if names == "bin" else idx_path)(prefix))


READ_DAMAGE = {  # a sequence's entry edited (it still opens) -> the sequence get() refuses, or None
    "pointer past the end": (POINTERS + 8, "<q", 2 * 19, 1),
    "pointer negative": (POINTERS + 8, "<q", -2, 1),
    "pointer half a token": (POINTERS + 8, "<q", 11, 1),
    "pointer + length overflows int64": (POINTERS + 8, "<q", (1 << 63) - 2, 1),
    "length negative": (LENGTHS + 4, "<i", -1, 1),
    "length past the end": (LENGTHS + 8, "<i", (1 << 31) - 1, 2),
    "length one longer": (LENGTHS + 4, "<i", 4, None),  # reads into the next sequence: only validate() can tell
    "length one shorter": (LENGTHS + 4, "<i", 2, None),
    "pointer one token on": (POINTERS + 16, "<q", 2 * 9, None),
    "documents decrease": (DOCIDX + 16, "<q", 0, None),
}


@pytest.fixture(params=[indexed.CHECK_CHUNK, 1, 3], ids=lambda n: f"chunk{n}")
def check_chunk(request, monkeypatch):
    """`validate` in its real chunk size and in chunks of 1 and 3 entries (a corpus of millions, in small)."""
    monkeypatch.setattr(indexed, "CHECK_CHUNK", request.param)
    return request.param


@pytest.mark.parametrize("damage", READ_DAMAGE, ids=str)
def test_a_damaged_entry_fails_its_read_and_validate(tmp_path, damage, check_chunk):
    prefix = tmp_path / "p"
    _write(prefix, DOCS, np.uint16)
    IndexedDataset(prefix).validate()
    offset, fmt, value, refused = READ_DAMAGE[damage]
    _poke(idx_path(prefix), offset, fmt, value)
    ds = IndexedDataset(prefix)
    seqs = _sequences(DOCS)
    for i in range(S):
        if i == refused:
            with pytest.raises(DataError) as e:
                ds.get(i)
            assert f"sequence {i}" in _one_line_naming(e.value, idx_path(prefix))
        elif offset >= DOCIDX or (i != 1 and i != 2):  # entries left alone read their own tokens
            assert ds[i].tolist() == seqs[i].tolist()
    with pytest.raises(DataError) as e:
        ds.validate()
    _one_line_naming(e.value, idx_path(prefix))


def test_validate_catches_a_bin_with_tokens_no_sequence_owns(tmp_path, check_chunk):
    prefix = tmp_path / "p"
    _write(prefix, DOCS, np.uint16)
    _resize(bin_path(prefix), 2 * 20)
    ds = IndexedDataset(prefix)  # every sequence still lies inside: it opens and reads
    assert [ds[i].tolist() for i in range(S)] == [s.tolist() for s in _sequences(DOCS)]
    with pytest.raises(DataError) as e:
        ds.validate()
    assert "38 bytes" in _one_line_naming(e.value, bin_path(prefix))


# ---- writers ---------------------------------------------------------------------------------------------


def test_a_writer_that_raises_leaves_nothing_and_the_prefix_can_be_written_again(tmp_path):
    prefix = tmp_path / "out" / "shard"
    with pytest.raises(RuntimeError, match="tokenizer died"):
        with IndexedWriter(prefix, np.uint16) as w:
            w.add_document([np.arange(10)])
            assert os.listdir(prefix.parent) == ["shard.bin.partial"]
            raise RuntimeError("tokenizer died")
    assert os.listdir(prefix.parent) == [] and not is_complete(prefix)
    with pytest.raises(DataError):
        IndexedDataset(prefix)
    _write(prefix, DOCS, np.uint16)
    assert sorted(os.listdir(prefix.parent)) == ["shard.bin", "shard.idx"] and is_complete(prefix)
    assert IndexedDataset(prefix)[3].tolist() == list(range(50, 54))


def test_a_killed_writer_leaves_only_partial_files_that_the_next_writer_replaces(tmp_path):
    prefix = tmp_path / "shard"
    killed = ("import os, numpy as np; from mp_toolkit.data.indexed import IndexedWriter; "
              f"w = IndexedWriter({str(prefix)!r}, np.int32); w.add_document([np.arange(5000)]); os._exit(9)")
    assert subprocess.run([sys.executable, "-c", killed], cwd=Path(__file__).parents[1]).returncode == 9
    assert os.listdir(tmp_path) == ["shard.bin.partial"] and not is_complete(prefix)
    with pytest.raises(DataError):
        IndexedDataset(prefix)
    _write(prefix, DOCS, np.int32)
    assert sorted(os.listdir(tmp_path)) == ["shard.bin", "shard.idx"]
    assert [s.tolist() for s in map(IndexedDataset(prefix).get, range(S))] == [s.tolist() for s in _sequences(DOCS)]


def test_rewriting_a_complete_prefix_never_pairs_the_new_bin_with_the_old_idx(tmp_path, monkeypatch):
    prefix = tmp_path / "shard"
    _write(prefix, DOCS, np.uint16)
    real_replace = os.replace

    def die_before_the_idx(src, dst):  # the process dies between the two renames
        if str(dst).endswith(".idx"):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", die_before_the_idx)
    with pytest.raises(OSError), IndexedWriter(prefix, np.uint16) as w:
        w.add_document([np.arange(3000)])
        w.finalize()
    monkeypatch.undo()
    assert not is_complete(prefix)  # the old .idx with the new .bin would open and read the wrong tokens
    assert not any(name.endswith(".partial") for name in os.listdir(tmp_path))
    _write(prefix, [[np.arange(3000)]], np.uint16)
    assert IndexedDataset(prefix)[0].tolist() == list(range(3000))


@pytest.mark.parametrize("ids, says", [([0, 65536], "token id 65536 does not fit uint16"), ([-1, 5], "token id -1"),
                                       ([[1, 2], [3, 4]], "shape (2, 2)"), ([0.5], "float64, not integers")], ids=str)
def test_the_writer_refuses_ids_its_dtype_cannot_hold(tmp_path, ids, says):
    prefix = tmp_path / "shard"  # (astype would store 65536 as 0 and -1 as 65535, and flatten the 2-D one)
    with pytest.raises(DataError) as e, IndexedWriter(prefix, np.uint16) as w:
        w.add_document([np.arange(4)])
        w.add_document([ids])
    assert says in _one_line_naming(e.value, prefix)
    assert os.listdir(tmp_path) == []


def test_the_writer_refuses_a_dtype_outside_the_format_and_use_after_finalize(tmp_path):
    with pytest.raises(DataError, match="uint32"):
        IndexedWriter(tmp_path / "a", np.uint32)
    w = IndexedWriter(tmp_path / "b", np.uint16)
    w.finalize()
    with pytest.raises(ValueError, match="finalized"):
        w.add_document([[1]])
    with pytest.raises(ValueError, match="finalized"):
        w.finalize()


# ---- fuzz ------------------------------------------------------------------------------------------------

FUZZ_DOCS = [[np.arange(3)], [np.arange(40, 46), np.zeros(0, np.int64), np.arange(9, 11)], [np.arange(70, 75)]]
FUZZ_SEQS = [s for doc in FUZZ_DOCS for s in doc]
FS, FD1 = len(FUZZ_SEQS), len(FUZZ_DOCS) + 1
FUZZ_IDX_BYTES = HEADER_BYTES + 12 * FS + 8 * FD1
FUZZ_DOCIDX = HEADER_BYTES + 12 * FS
_examples = itertools.count()


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    """One valid prefix per dtype (their .idx differ only in the dtype code) and a directory for examples."""
    root = tmp_path_factory.mktemp("fuzz")
    for dtype in DTYPES:
        _write(root / dtype.name, FUZZ_DOCS, dtype)
    return root


def _read_everything(prefix, dtype) -> list[str]:
    """Open, read every sequence and document, validate; returns the `DataError` messages. Fails the test
    on any other exception, a read of the wrong length, or an untouched entry reading other tokens."""
    try:
        ds = IndexedDataset(prefix)
    except DataError as e:
        return [_one_line_naming(e, bin_path(prefix), idx_path(prefix))]
    errors = []
    for i in range(len(ds)):
        try:
            got = ds[i]
        except DataError as e:
            errors.append(_one_line_naming(e, idx_path(prefix)))
            continue
        assert len(got) == ds.sequence_lengths[i]  # never a slice numpy clipped at the end of the file
        if ds.dtype == dtype and i < FS and ds.sequence_lengths[i] == len(FUZZ_SEQS[i]) and \
                ds.sequence_pointers[i] == dtype.itemsize * sum(map(len, FUZZ_SEQS[:i])):
            assert got.tolist() == FUZZ_SEQS[i].tolist()
    for d in range(ds.num_documents):
        ds.document(d)
    try:
        ds.validate()
    except DataError as e:
        errors.append(_one_line_naming(e, bin_path(prefix), idx_path(prefix)))
    return errors


ENTRIES = st.one_of(  # (offset, struct format) of a sequence's length or pointer in the fuzz .idx
    st.integers(0, FS - 1).map(lambda i: (HEADER_BYTES + 4 * i, "<i")),
    st.integers(0, FS - 1).map(lambda i: (HEADER_BYTES + 4 * FS + 8 * i, "<q")))
FIELDS = st.one_of(  # every field: the header's, the entries, the document indices
    st.sampled_from([(9, "<Q"), (17, "<B"), (18, "<Q"), (26, "<Q")]), ENTRIES,
    st.integers(0, FD1 - 1).map(lambda i: (FUZZ_DOCIDX + 8 * i, "<q")))
EXTREMES = st.sampled_from([-1, 0, 1, 8, 1 << 31, (1 << 63) - 4, -(1 << 63)])  # signs, alignment, int64 overflow
EDITS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 8 * FUZZ_IDX_BYTES - 1)),
    st.tuples(st.just("set"), FIELDS, st.integers(-(1 << 63), (1 << 63) - 1)),
    st.tuples(st.just("set"), ENTRIES, EXTREMES),
    st.tuples(st.just("truncate"), st.integers(0, FUZZ_IDX_BYTES - 1)))


def _edit(data: bytearray, edit) -> bytearray:
    if edit[0] == "flip":
        if edit[1] // 8 < len(data):  # (after a cut, a flip past it is none)
            data[edit[1] // 8] ^= 1 << (edit[1] % 8)
    elif edit[0] == "truncate":
        del data[edit[1]:]
    else:
        (offset, fmt), value = edit[1], edit[2]
        size = struct.calcsize(fmt)
        lo, hi = (0, 1 << 8 * size) if fmt[-1].isupper() else (-(1 << 8 * size - 1), 1 << 8 * size - 1)
        value = (value - lo) % (hi - lo) + lo  # wrapped into the field's range
        if offset + size <= len(data):
            data[offset : offset + size] = struct.pack(fmt, value)
    return data


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(DTYPES), edits=st.lists(EDITS, min_size=1, max_size=4))
def test_a_fuzzed_idx_gives_a_data_error_or_the_original_tokens(fuzz_dir, dtype, edits):
    original = idx_path(fuzz_dir / dtype.name).read_bytes()
    damaged = bytearray(original)
    for edit in edits:
        damaged = _edit(damaged, edit)
    prefix = tempfile.mkdtemp(dir=fuzz_dir) + f"/x{next(_examples)}"
    idx_path(prefix).write_bytes(damaged)
    bin_path(prefix).write_bytes(bin_path(fuzz_dir / dtype.name).read_bytes())
    errors = _read_everything(prefix, dtype)
    changed = [i for i in range(len(original)) if i >= len(damaged) or damaged[i] != original[i]]
    if len(edits) == 1 and changed and (min(changed) < FUZZ_DOCIDX or len(damaged) != len(original)):
        # one edit to the header, a length or a pointer (or a cut) is always found; a document index
        # kept in order is not damage the format can see
        assert errors, edits
    if not changed:
        assert not errors


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(DTYPES), size=st.integers(0, 100), fill=st.binary(min_size=100, max_size=100))
def test_a_bin_of_another_length_always_gives_a_data_error(fuzz_dir, dtype, size, fill):
    good = bin_path(fuzz_dir / dtype.name).read_bytes()
    if size == len(good):
        size += 1
    prefix = tempfile.mkdtemp(dir=fuzz_dir) + f"/x{next(_examples)}"
    idx_path(prefix).write_bytes(idx_path(fuzz_dir / dtype.name).read_bytes())
    bin_path(prefix).write_bytes((good + fill)[:size])
    assert _read_everything(prefix, dtype)
