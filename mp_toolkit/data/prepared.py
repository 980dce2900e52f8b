"""A prepared corpus: what ``mpt data prepare`` writes and ``mpt train --data DIR`` memory-maps.

    DIR/manifest.json          written last, atomically: its presence means DIR is complete
    DIR/tokenizer.json         the tokenizer every shard was encoded with (HF tokenizers format)
    DIR/train/<shard>.bin/.idx Megatron indexed datasets (`mp_toolkit.data.indexed`), one per chunk of input
    DIR/val/<shard>.bin/.idx   the held-out documents of the same chunks (chosen by document)

The manifest (``FORMAT``)::

    {"format": "mp_toolkit.prepared", "version": 1,
     "tokenizer": {"file": "tokenizer.json", "sha256": ..., "vocab_size": N, "eod_id": id | null},
     "dtype": "uint16" | "int32", "split_sentences": bool, "append_eod": bool, "json_keys": ["text"],
     "val_fraction": f, "seed": s,
     "splits": {"train": [SHARD, ...], "val": [SHARD, ...]},
     "totals": {"train": {"documents", "sequences", "tokens"}, "val": {...}},
     "inputs": [{"path": ..., "bytes": ...}, ...], "command": "mpt data prepare ...", "created": ISO time}
    SHARD = {"prefix": "train/f00000-c00000", "documents", "sequences", "tokens", "bin_bytes", "idx_bytes",
             "bin_sha256", "idx_sha256"}   (what `IndexedWriter.finalize` returns, and the prefix)

`PreparedCorpus.open` reads the manifest and checks it against its files in O(shards): each shard's
sizes and its index header (`IndexedDataset`), and the tokenizer's digest; ``mpt data verify`` also
hashes every file. A Megatron prefix (``PATH`` with ``PATH.bin`` + ``PATH.idx``, as Megatron-LM's
``preprocess_data.py`` writes them) opens as a corpus of one training shard with no tokenizer and no
validation split. ``digest`` names the data a checkpoint was trained on.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mp_toolkit.data.indexed import IndexedDataset, bin_path, idx_path, is_complete
from mp_toolkit.errors import DataError
from mp_toolkit.user_files import parse_json

FORMAT = "mp_toolkit.prepared"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class PreparedCorpus:
    """An opened prepared directory (or Megatron prefix): its shards memory-mapped, nothing else read."""

    path: Path
    manifest: dict
    train: tuple[IndexedDataset, ...]
    val: tuple[IndexedDataset, ...]
    digest: str
    """sha256 of the manifest (Megatron prefix: of its .idx header and both files' sizes)."""

    @property
    def tokenizer_file(self) -> Path | None:
        tok = self.manifest.get("tokenizer")
        return self.path / tok["file"] if tok else None

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary (ids are below it); None when unknown (a bare Megatron prefix)."""
        tok = self.manifest.get("tokenizer")
        return int(tok["vocab_size"]) if tok else None

    @property
    def eod_id(self) -> int | None:
        tok = self.manifest.get("tokenizer")
        return tok.get("eod_id") if tok else None

    @property
    def split_sentences(self) -> bool:
        return bool(self.manifest.get("split_sentences", False))

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.manifest["dtype"])

    def tokens(self, split: str = "train") -> int:
        return sum(ds.num_tokens for ds in (self.train if split == "train" else self.val))

    @classmethod
    def open(cls, path: str | os.PathLike) -> PreparedCorpus:
        """DIR with a manifest, or a Megatron prefix; a `DataError` naming the file for anything amiss."""
        path = Path(path)
        if path.is_dir():
            return _open_dir(path)
        if is_complete(path):
            return _open_prefix(path)
        raise DataError(f"{path} is neither a prepared directory (with {MANIFEST}) nor a Megatron prefix "
                        f"({bin_path(path).name} + {idx_path(path).name}): run `mpt data prepare --output {path}`")


def is_prepared(path: str | os.PathLike) -> bool:
    """``path`` is something `PreparedCorpus.open` reads (a complete directory or a Megatron prefix)."""
    path = Path(path)
    return (path / MANIFEST).is_file() or (not path.is_dir() and is_complete(path))


def read_manifest(directory: Path) -> tuple[dict, bytes]:
    """(the manifest of ``directory``, its bytes); DataError when missing, unreadable or not ours."""
    file = directory / MANIFEST
    if not file.is_file():
        partial = any(directory.glob("*/*.idx")) or (directory / ".lock").exists()
        raise DataError(f"{directory} has no {MANIFEST}: "
                        + ("its preparation did not finish (run the same `mpt data prepare` again to complete it)"
                           if partial else "prepare it with `mpt data prepare --output DIR`"))
    try:
        raw = file.read_bytes()
        doc = parse_json(raw)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {file}: {getattr(e, 'strerror', None) or str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise DataError(f"{file} is not a {FORMAT} manifest")
    if doc.get("version") != VERSION:
        raise DataError(f"{file} has version {doc.get('version')}; this mp_toolkit reads version {VERSION}")
    return doc, raw


def _open_dir(directory: Path) -> PreparedCorpus:
    doc, raw = read_manifest(directory)
    file = directory / MANIFEST
    try:
        splits = {split: tuple(_open_shard(directory, shard, file) for shard in doc["splits"].get(split, []))
                  for split in SPLITS}
        dtype = np.dtype(doc["dtype"])
        tok = doc.get("tokenizer")
    except (KeyError, TypeError) as e:
        raise DataError(f"{file} lacks {e} (edited or from another tool)") from None
    if not splits["train"]:
        raise DataError(f"{file} lists no training shards")
    for ds in splits["train"] + splits["val"]:
        if ds.dtype != dtype:
            raise DataError(f"{idx_path(ds.prefix)} holds {ds.dtype} tokens, {file} says {dtype}")
    if tok:
        tfile = directory / tok["file"]
        try:
            digest = hashlib.sha256(tfile.read_bytes()).hexdigest()
        except OSError as e:
            raise DataError(f"cannot read {tfile}: {e.strerror}") from None
        if digest != tok["sha256"]:
            raise DataError(f"{tfile} does not match {file} (sha256 {digest[:12]}..., manifest "
                            f"{str(tok['sha256'])[:12]}...): the tokenizer was replaced after preparing")
    return PreparedCorpus(directory, doc, splits["train"], splits["val"], hashlib.sha256(raw).hexdigest())


def _open_shard(directory: Path, shard: dict, manifest: Path) -> IndexedDataset:
    prefix = directory / shard["prefix"]
    for path, key in ((bin_path(prefix), "bin_bytes"), (idx_path(prefix), "idx_bytes")):
        if not path.is_file():
            raise DataError(f"{path}, listed in {manifest}, does not exist")
        size = path.stat().st_size
        if size != shard[key]:
            raise DataError(f"{path} is {size} bytes, {manifest} says {shard[key]}: changed after preparing")
    ds = IndexedDataset(prefix)
    if (len(ds), ds.num_documents, ds.num_tokens) != (shard["sequences"], shard["documents"], shard["tokens"]):
        raise DataError(f"{idx_path(prefix)} holds {ds.num_documents} documents / {len(ds)} sequences / "
                        f"{ds.num_tokens} tokens, {manifest} says {shard['documents']} / {shard['sequences']} / "
                        f"{shard['tokens']}")
    return ds


def _open_prefix(prefix: Path) -> PreparedCorpus:
    ds = IndexedDataset(prefix)
    with open(idx_path(prefix), "rb") as f:
        head = f.read(64)
    digest = hashlib.sha256(head + f"{ds.bin_bytes}:{idx_path(prefix).stat().st_size}".encode()).hexdigest()
    manifest = {"format": FORMAT, "version": VERSION, "tokenizer": None, "dtype": str(ds.dtype),
                "split_sentences": len(ds) != ds.num_documents, "megatron_prefix": str(prefix)}
    return PreparedCorpus(prefix, manifest, (ds,), (), digest)
