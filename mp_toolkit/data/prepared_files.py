"""The files of a prepared directory as `mp_toolkit.data.prepare` writes them: chunk shards and their
records, the manifest, the lock; `merge` joins the parts of a sharded preparation and `verify` checks
every byte.

    DIR/train/fKKKKK-cCCCCC.bin/.idx, DIR/val/...   chunk (k, c)'s shards (`ChunkWriter`)
    DIR/chunks/fKKKKK-cCCCCC.json                   its record, written last (`intact_records` rereads them)
    DIR/manifest.json, DIR/manifest.part-i-of-n.json  (`build_manifest`, `merge`)
    DIR/.lock, DIR/.lock-i-of-n                      held while a preparation runs (`locked`)

    merge("prepared/")                     # manifest.json from every manifest.part-i-of-n.json
    corpus = verify("prepared/")           # a PreparedCorpus whose every file matches its sha256
    print(shard_counts(corpus.train))      # N shards, D documents, S sequences, T tokens

Every JSON file is written atomically with the umask's mode (`mp_toolkit.data.atomic`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from mp_toolkit.data.atomic import write_bytes
from mp_toolkit.data.indexed import IndexedDataset, IndexedWriter, bin_path, idx_path, is_complete, token_dtype
from mp_toolkit.data.prepare_options import Options
from mp_toolkit.data.prepared import FORMAT, MANIFEST, SPLITS, TOKENIZER, VERSION, PreparedCorpus
from mp_toolkit.data.sources import Source
from mp_toolkit.data.survey import Survey, Vocab
from mp_toolkit.errors import DataError
from mp_toolkit.user_files import parse_json

CHUNKS = "chunks"
HASH_BYTES = 1 << 20


@contextmanager
def locked(path: Path):
    """Hold ``path`` with fcntl.flock (released when the process ends, however it ends)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise DataError(f"{path.parent} is being prepared by process {holder} (it holds {path.name}): wait "
                            "for it or use another --output") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def lock_name(i: int, n: int) -> str:
    """The lock a preparation holds while it runs: DIR's own, or part i of n's (the parts run at once)."""
    return ".lock" if n == 1 else f".lock-{i}-of-{n}"


def part_name(i: int, n: int) -> str:
    return f"manifest.part-{i}-of-{n}.json"


def chunk_name(k: int, c: int) -> str:
    return f"f{k:05d}-c{c:05d}"


def json_bytes(doc: dict) -> bytes:
    return (json.dumps(doc, indent=1) + "\n").encode()


def write_json(path: Path, doc: dict) -> None:
    """``doc`` as ``path``, whole or absent, with the umask's mode: a prepared corpus is data to share
    (unlike `tokens`' 0600 caches)."""
    write_bytes(path, json_bytes(doc), private=False)


class ChunkWriter:
    """Chunk ``name``'s train and val shards, written side by side."""

    def __init__(self, out: Path, name: str, dtype: np.dtype):
        self.name = name
        self.writers = {split: IndexedWriter(out / split / name, dtype) for split in SPLITS}
        self.documents = dict.fromkeys(SPLITS, 0)

    def add(self, val: bool, sequences: list[np.ndarray]) -> None:
        split = "val" if val else "train"
        self.writers[split].add_document(sequences)
        self.documents[split] += 1

    def finalize(self, tokenizer_sha256: str) -> dict:
        """Both shards complete (a split with no document: none, its partial files removed); the record."""
        record = {"chunk": self.name, "tokenizer_sha256": tokenizer_sha256}
        for split, writer in self.writers.items():
            if self.documents[split]:
                record[split] = {"prefix": f"{split}/{self.name}", **writer.finalize()}
            else:
                writer.discard()
                record[split] = None
        return record

    def discard(self) -> None:
        for writer in self.writers.values():
            writer.discard()


def read_json_object(file: Path, what: str) -> dict:
    """The JSON object in ``file``, one of DIR's own; a DataError naming ``what`` it should have been when it
    cannot be read, is not JSON (nested too deeply included) or holds something else."""
    try:
        doc = parse_json(file.read_bytes())
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {file}: {str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise DataError(f"{file} is not {what}")
    return doc


def intact_records(out: Path, tokenizer_sha256: str) -> Iterator[tuple[str, dict]]:
    """The chunk records that still hold: same tokenizer, every shard they name complete at its size
    (a chunk whose record fails this is encoded again)."""
    for file in sorted((out / CHUNKS).glob("f*-c*.json")):
        try:
            record = parse_json(file.read_bytes())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or record.get("tokenizer_sha256") != tokenizer_sha256:
            continue
        if all(shard_intact(out, record.get(split)) for split in SPLITS):
            yield file.stem, record


def shard_intact(out: Path, shard: dict | None) -> bool:
    if shard is None:
        return True
    prefix = out / shard["prefix"]
    return is_complete(prefix) and bin_path(prefix).stat().st_size == shard["bin_bytes"] and \
        idx_path(prefix).stat().st_size == shard["idx_bytes"]


def split_totals(splits: dict[str, list[dict]]) -> dict:
    return {split: {key: sum(s[key] for s in shards) for key in ("documents", "sequences", "tokens")}
            for split, shards in splits.items()}


def build_manifest(opts: Options, sources: list[Source], vocab: Vocab, survey: Survey | None, records: list[dict],
              command: str) -> dict:
    """The manifest (`mp_toolkit.data.prepared`'s format) of these chunk records."""
    splits = {split: [r[split] for r in records if r[split]] for split in SPLITS}
    fraction = survey.val_share if survey is not None and survey.val_share is not None else \
        (opts.val_fraction if opts.val_docs is None else 0.0)
    doc = {"format": FORMAT, "version": VERSION,
           "tokenizer": {"file": TOKENIZER, "sha256": vocab.sha256, "vocab_size": vocab.vocab_size,
                         "eod_id": vocab.eod_id},
           "dtype": token_dtype(vocab.vocab_size).name, "split_sentences": opts.split_sentences,
           "append_eod": vocab.append_eod, "json_keys": [opts.json_key], "val_fraction": fraction,
           "val_docs": opts.val_docs, "seed": opts.seed, "splits": splits, "totals": split_totals(splits),
           "inputs": [{"path": str(s.path), "bytes": s.size} for s in sources], "command": command,
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if opts.shard[1] > 1:
        doc["shard"] = list(opts.shard)
    return doc


def check_not_empty(manifest: dict, opts: Options) -> None:
    totals = manifest["totals"]
    if not totals["train"]["documents"]:
        if totals["val"]["documents"]:
            raise DataError(f"every document went to validation: lower --val-fraction {opts.val_fraction} / "
                            f"--val-docs {opts.val_docs}")
        what = "a sentence" if opts.split_sentences else "a document"
        raise DataError(f"the inputs ({', '.join(opts.inputs)}) hold no {what}")


MERGED_KEYS = ("tokenizer", "dtype", "split_sentences", "append_eod", "json_keys", "val_fraction", "val_docs", "seed",
               "inputs")
"""What every part of one sharded preparation must agree on."""


def merge(directory) -> dict:
    """Join DIR's ``manifest.part-i-of-n.json`` into DIR/manifest.json (every part there, none still
    running, one tokenizer); the manifest."""
    out = Path(directory)
    found = sorted(out.glob("manifest.part-*-of-*.json"))
    if not found:
        raise DataError(f"{out} has no manifest.part-i-of-n.json: run `mpt data prepare --shard i/n --output {out}` "
                        "for each part first")
    n = int(re.fullmatch(r"manifest\.part-\d+-of-(\d+)\.json", found[0].name)[1])
    parts = []
    for i in range(n):
        file = out / part_name(i, n)
        with locked(out / lock_name(i, n)):  # a part still running is refused here
            if not file.is_file():
                raise DataError(f"{out} lacks {file.name}: run `mpt data prepare ... --shard {i}/{n}` to finish it")
            parts.append(read_json_object(file, "a manifest part of `mpt data prepare --shard`"))
    for i, part in enumerate(parts[1:], start=1):
        for key in MERGED_KEYS:
            if part.get(key) != parts[0].get(key):
                what = "tokenizer digests" if key == "tokenizer" else key
                raise DataError(f"{out}: {part_name(i, n)} and {part_name(0, n)} differ in {what}: the parts come "
                                "from different preparations")
    splits = {split: sorted((s for p in parts for s in p["splits"][split]), key=lambda s: s["prefix"])
              for split in SPLITS}
    for shard in splits["train"] + splits["val"]:
        if not shard_intact(out, shard):
            raise DataError(f"{out / shard['prefix']}.bin/.idx, listed by a part, is missing or not the size it "
                            "records")
    manifest = {**parts[0], "splits": splits, "totals": split_totals(splits), "command": f"mpt data merge {out}",
                "parts": [p["command"] for p in parts],
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    manifest.pop("shard", None)
    if not manifest["totals"]["train"]["documents"]:
        raise DataError(f"{out}: the parts hold no training document")
    write_json(out / MANIFEST, manifest)
    return manifest


def verify(path) -> PreparedCorpus:
    """Open ``path`` (`PreparedCorpus.open`), check every shard's index against its data
    (`IndexedDataset.validate`) and every file's sha256 against the manifest; a `DataError` names the
    first that is wrong."""
    corpus = PreparedCorpus.open(path)
    for ds in corpus.train + corpus.val:
        ds.validate()
    if corpus.path.is_dir():
        for split in SPLITS:
            for shard in corpus.manifest["splits"].get(split, []):
                prefix = corpus.path / shard["prefix"]
                for file, key in ((bin_path(prefix), "bin_sha256"), (idx_path(prefix), "idx_sha256")):
                    digest = _sha256(file)
                    if digest != shard[key]:
                        raise DataError(f"{file} has sha256 {digest[:12]}..., {corpus.path / MANIFEST} says "
                                        f"{shard[key][:12]}...: changed after preparing")
    return corpus


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(HASH_BYTES):
            h.update(block)
    return h.hexdigest()


def shard_counts(shards: tuple[IndexedDataset, ...]) -> str:
    """``N shards, D documents, S sequences, T tokens`` of opened shards."""
    return (f"{len(shards)} shards, {sum(ds.num_documents for ds in shards):,} documents, "
            f"{sum(len(ds) for ds in shards):,} sequences, {sum(ds.num_tokens for ds in shards):,} tokens")
