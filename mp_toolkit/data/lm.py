"""Packed causal-LM data: corpus -> byte-level BPE -> fixed-length chunks -> micro-batches.

Every rank of a pipeline calls ``build_lm_dataset`` with the same arguments and gets a
bit-identical dataset (the first stage feeds ``input_ids``, the last stage scores ``labels``),
then iterates ``MicroBatches`` with its own data-parallel rank. Nothing here touches the
network: corpora are local files (by default this interpreter's standard library).

    ds = build_lm_dataset("stdlib", vocab_size=4096, seq_len=128, seed=0, cache_dir=".cache/mpt")
    batches = MicroBatches(ds, micro_batch_size=8, dp_rank=0, dp_size=1, seed=0)
    input_ids, labels = next(batches)  # (8, 128) int64 each; labels[:, t] == input_ids[:, t + 1]
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterable, Optional

import datasets
import numpy as np
import torch
import torch.distributed as dist
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mp_toolkit.data.buckets import cut, drawn_bucket
from mp_toolkit.progress import progress

EOS_TOKEN = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".py", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
STDLIB_MAX_BYTES = 12 * 1024 * 1024
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
SYNTHETIC_SEQUENCES = 4096
ENCODE_CHUNK = 64  # documents per encode_batch call while encoding a corpus (one progress step)


class DataError(ValueError):
    """A corpus or data argument the user can fix; the message is one line naming the value."""


def stdlib_files() -> list[Path]:
    """This interpreter's standard-library ``.py`` files, sorted, capped at ~12 MB in total.

    Test suites, idlelib and installed packages are skipped to bound the size; the order (and so
    the cut at 12 MB) is deterministic for a given interpreter.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).parts
        # Prune while walking: site-packages alone can be larger than the whole stdlib.
        dirnames[:] = [
            d for d in dirnames
            if d not in _STDLIB_SKIP_DIRS and not (rel == ("lib2to3",) and d == "tests")
        ]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    files, total = [], 0
    for path in sorted(found, key=lambda p: p.relative_to(root).parts):
        size = path.stat().st_size
        if total + size > STDLIB_MAX_BYTES:
            break
        files.append(path)
        total += size
    return files


def _expand(path: Path) -> list[Path]:
    """A user path -> the corpus files it names (a directory is searched recursively)."""
    if path.is_dir():
        found = sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + JSON_SUFFIXES
        )
        if not found:
            raise DataError(
                f"corpus directory {path} has no {'/'.join(TEXT_SUFFIXES + JSON_SUFFIXES)} files"
            )
        return found
    if not path.is_file():
        raise DataError(f"corpus path {path} does not exist or is not a file or directory")
    if path.suffix not in TEXT_SUFFIXES + JSON_SUFFIXES:
        raise DataError(
            f"corpus file {path} has suffix {path.suffix!r}: use one of "
            f"{', '.join(TEXT_SUFFIXES + JSON_SUFFIXES)}"
        )
    return [path]


def _json_texts(path: Path, content: str) -> list[str]:
    """The "text" field of every JSON line (blank lines are skipped)."""
    texts = []
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno} is not a JSON line ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{path}:{lineno} has no string "text" field')
        texts.append(record["text"])
    return texts


def read_texts(paths: Iterable[str | os.PathLike]) -> tuple[list[str], list[Path]]:
    """Read documents from files or directories; returns (texts, files skipped as non-UTF-8).

    ``.txt``/``.py``/``.md`` files are one document each; ``.jsonl``/``.json`` files are JSON
    lines whose "text" fields are documents. Files that do not decode as strict UTF-8 are skipped
    deliberately (a few stdlib files are latin-1) rather than decoded with replacement characters.
    """
    texts: list[str] = []
    skipped: list[Path] = []
    for given in paths:
        for path in _expand(Path(given)):
            try:
                raw = path.read_bytes()
            except OSError as e:
                raise DataError(f"cannot read corpus file {path}: {e.strerror}") from None
            try:
                content = raw.decode("utf-8")
            except UnicodeDecodeError:
                skipped.append(path)
                continue
            if path.suffix in JSON_SUFFIXES:
                texts.extend(_json_texts(path, content))
            elif content:
                texts.append(content)
    return texts, skipped


def _texts_digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))  # length prefix: ["ab", "c"] != ["a", "bc"]
        h.update(data)
    return h.hexdigest()


def cache_key(texts: list[str], vocab_size: int) -> str:
    """The key of the tokenizer trained on ``texts`` with ``vocab_size``: its cache file is
    ``tokenizer-<key>.json`` (an export finds a run's tokenizer by it, `mp_toolkit.hf.run_tokenizer`)."""
    return hashlib.sha256(f"{_texts_digest(texts)}:{vocab_size}".encode()).hexdigest()[:16]


def train_tokenizer(texts: list[str], vocab_size: int, cache_dir: str | os.PathLike) -> Tokenizer:
    """Byte-level BPE with ``<|endoftext|>``, trained once per (corpus, vocab_size) and cached.

    The cache file is ``cache_dir/tokenizer-<key>.json``; it is written atomically, so ranks that
    race to train the same (deterministic) tokenizer all end up reading one complete file.
    """
    if vocab_size < 257:
        raise DataError(
            f"vocab_size={vocab_size} is too small for byte-level BPE: use at least 257 "
            f"(256 bytes + {EOS_TOKEN})"
        )
    cached = Path(cache_dir) / f"tokenizer-{cache_key(texts, vocab_size)}.json"
    if cached.is_file():
        try:
            tokenizer = Tokenizer.from_file(str(cached))
            if tokenizer.get_vocab_size() == vocab_size and tokenizer.token_to_id(EOS_TOKEN) == 0:
                return tokenizer
        except Exception:  # noqa: BLE001 -- tokenizers raises a bare Exception on a damaged file
            pass  # damaged (truncated, edited): trained again below and replaced

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    # the bar counts documents read; the merges that follow are the tokenizer's own (quick) pass
    tokenizer.train_from_iterator(progress(texts, "training tokenizer", len(texts), progress_bars_on(), "doc"),
                                  trainer=trainer, length=len(texts))

    _atomic_save(cached, tokenizer.save)
    return tokenizer


def _synthetic_dataset(vocab_size: int, seq_len: int, seed: int, tokens: int) -> datasets.Dataset:
    n = tokens // (seq_len + 1)
    if n == 0:
        raise DataError(f"synthetic_tokens={tokens} is less than one sequence of {seq_len + 1} tokens")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n, seq_len + 1), generator=g, dtype=torch.int64)
    return datasets.Dataset.from_dict({"input_ids": ids.numpy()})


def progress_bars_on() -> bool:
    """Progress bars follow `datasets`' switch, which ``mpt train --no-progress`` turns off."""
    return not datasets.are_progress_bars_disabled()


def _atomic_save(path: Path, write) -> None:
    """Write through a temporary file, fsync it and rename it, so racing ranks never read a partial
    file and a crash never leaves one. The file stays 0600 (as mkstemp makes it): a cache holds
    what the corpus says, readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if os.name == "posix":
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cached_stream(cache_file: Path, vocab_size: int) -> np.ndarray | None:
    """The cached token stream when it is intact: a 1-d int32 array whose ids are all below
    ``vocab_size``; None when missing or damaged (truncated, another dtype, out-of-range ids),
    so the caller encodes the corpus again and replaces it."""
    if not cache_file.is_file():
        return None
    try:
        stream = np.load(cache_file, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if not isinstance(stream, np.ndarray) or stream.dtype != np.int32 or stream.ndim != 1:
        return None
    if len(stream) and (int(stream.min()) < 0 or int(stream.max()) >= vocab_size):
        return None
    return stream


def _token_stream(texts: list[str], tokenizer: Tokenizer, cache_dir: Path, key: str, eos: int | None = None) -> np.ndarray:
    """All documents' ids, each followed by ``eos`` (default: the tokenizer's <|endoftext|>; none when
    it has none), as one int32 array, cached as ``tokens-<key>-<tokenizer digest>.npy`` (encoding is
    slow): the name changes with the tokenizer, and a damaged cache is encoded again (`_cached_stream`)."""
    digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]
    cache_file = cache_dir / f"tokens-{key}-{digest}.npy"
    vocab = max(tokenizer.get_vocab_size(), (eos + 1) if eos is not None else 0)
    cached = _cached_stream(cache_file, vocab)
    if cached is not None:
        return cached
    eos = tokenizer.token_to_id(EOS_TOKEN) if eos is None else eos
    end = [eos] if eos is not None else []
    chunks = range(0, len(texts), ENCODE_CHUNK)  # encode_batch per chunk: the same ids, with a bar
    docs = [enc.ids + end for i in progress(chunks, "encoding corpus", len(chunks), progress_bars_on(), "chunk")
            for enc in tokenizer.encode_batch(texts[i : i + ENCODE_CHUNK])]
    stream = np.fromiter((t for doc in docs for t in doc), dtype=np.int32)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object, so np.save does not append ".npy"
            np.save(f, stream, allow_pickle=False)

    _atomic_save(cache_file, write)
    return stream


def load_tokenizer_file(path: str | os.PathLike) -> tuple[Tokenizer, str]:
    """(a tokenizers ``tokenizer.json``, as HF's ``save_pretrained`` writes it, its content digest)."""
    try:
        raw = Path(path).read_bytes()
        return Tokenizer.from_str(raw.decode("utf-8")), hashlib.sha256(raw).hexdigest()
    except Exception as e:  # OSError, bad UTF-8, or the plain Exception tokenizers raises on a bad file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"cannot read tokenizer {path}: {reason}") from None


def tokenized_stream(texts: list[str], tokenizer_file: str | os.PathLike, vocab_size: int,
                     cache_dir: str | os.PathLike, eos: int | None = None) -> np.ndarray:
    """The token stream of ``texts`` under a given tokenizer.json (HF's special tokens as its
    post-processor adds them, then ``eos``), cached by (corpus, tokenizer file, eos); every id must be
    below the model's ``vocab_size``."""
    tokenizer, digest = load_tokenizer_file(tokenizer_file)
    key = hashlib.sha256(f"{_texts_digest(texts)}:{digest}:{eos}".encode()).hexdigest()[:16]
    stream = _token_stream(texts, tokenizer, Path(cache_dir), key, eos=eos)
    top = int(stream.max()) if len(stream) else -1
    if top >= vocab_size:
        raise DataError(f"tokenizer {tokenizer_file} gives token id {top}, but the model's vocab_size is {vocab_size}: "
                        "use the tokenizer the model was built for (ids must be below vocab_size)")
    return stream


def _packed_dataset(stream: np.ndarray, seq_len: int) -> datasets.Dataset:
    """Cut the token stream into contiguous chunks of seq_len + 1, dropping the remainder."""
    n = len(stream) // (seq_len + 1)
    if n == 0:
        raise DataError(
            f"corpus has {len(stream)} tokens, fewer than one sequence of {seq_len + 1}: "
            f"lower seq_len or add text"
        )
    chunks = stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)  # (N, T + 1)
    return datasets.Dataset.from_dict({"input_ids": chunks})


def rank0_first(build, rank: int, agree=None):
    """Rank 0 builds first (training and caching the tokenizer); the others then load the cache.

    ``agree(error)``, when given, is the barrier: a barrier that also tells every rank whether rank 0
    failed (a DataError) and raises on every rank then, so the others do not wait for it in vain."""
    if agree is None:
        out = build() if rank == 0 else None
        if dist.is_initialized():
            dist.barrier()
        return out if out is not None else build()
    out, error = None, None
    if rank == 0:
        try:
            out = build()
        except DataError as e:
            error = e
    agree(error)
    return out if out is not None else build()


def build_lm_dataset(
    source: str | os.PathLike,
    vocab_size: int,
    seq_len: int,
    seed: int,
    cache_dir: Optional[str | os.PathLike],
    synthetic_tokens: Optional[int] = None,
    tokenizer_file: Optional[str | os.PathLike] = None,
    eos: Optional[int] = None,
) -> datasets.Dataset:
    """A shuffled, torch-formatted dataset of packed ``input_ids`` chunks of ``seq_len + 1``.

    ``source`` is "stdlib" (this interpreter's standard library), "synthetic" (uniform random ids
    from ``torch.Generator(seed)``, no tokenizer; ``synthetic_tokens`` tokens in all, default
    4096 sequences), or a file/directory path (see ``read_texts``). The tokenizer is cached under
    ``cache_dir`` (may be None only for "synthetic") beside the encoded token stream, so only the
first build pays for training and encoding. Equal arguments give bit-identical data.
    With ``tokenizer_file`` (a ``tokenizer.json``) text is encoded by that tokenizer instead of a
    trained one (``tokenized_stream``; each document ends with ``eos`` when given).
    """
    if seq_len <= 0:
        raise DataError(f"seq_len={seq_len} must be a positive integer")
    if str(source) == "synthetic":
        if vocab_size <= 0:
            raise DataError(f"vocab_size={vocab_size} must be a positive integer")
        tokens = synthetic_tokens if synthetic_tokens is not None else SYNTHETIC_SEQUENCES * (seq_len + 1)
        ds = _synthetic_dataset(vocab_size, seq_len, seed, tokens)
    else:
        if cache_dir is None:
            raise DataError(f"source {str(source)!r} needs a cache_dir for its tokenizer")
        if str(source) == "stdlib":
            texts, _ = read_texts(stdlib_files())
        else:
            texts, _ = read_texts([source])
        if not texts:
            raise DataError(f"corpus {source} has no UTF-8 text")
        if tokenizer_file is not None:
            stream = tokenized_stream(texts, tokenizer_file, vocab_size, cache_dir, eos)
        else:
            tokenizer = train_tokenizer(texts, vocab_size, cache_dir)
            key = cache_key(texts, vocab_size)  # the tokenizer's key: same corpus, same vocabulary
            stream = _token_stream(texts, tokenizer, Path(cache_dir), key)
        ds = _packed_dataset(stream, seq_len)
    return ds.shuffle(seed=seed).with_format("torch")


class MicroBatches:
    """Infinite, deterministic ``(input_ids, labels)`` micro-batches for one data-parallel rank.

    Each epoch orders the dataset (epoch 0: as given, which ``build_lm_dataset`` already
    shuffled; epoch e > 0: a permutation seeded with ``seed + e``), gives rank r the sequences
    r, r + dp_size, ... (every rank gets the same count, the remainder is dropped so ranks stay in
    step), and cuts them into micro-batches of ``micro_batch_size`` (a partial one is dropped).
    ``position`` counts micro-batches consumed over all epochs; ``state_dict()`` resumes it.

    ``holdout``: the dataset's last ``holdout`` rows are a validation split that training never
    reads (the dataset is shuffled once at build time, so they are a random sample); `held_out`
    iterates them. The split depends on the dataset and ``holdout`` only, so every (pp, tp, dp)
    layout, and a resumed run, holds out the same sequences.

    ``length_buckets`` (`mp_toolkit.data.buckets`, the dataset's sequence length among them): each
    micro-batch is cut to one bucket's length, drawn from (seed, epoch, its first row); () keeps
    every micro-batch whole.
    """

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 holdout: int = 0, length_buckets: tuple[int, ...] = ()):
        if micro_batch_size <= 0:
            raise DataError(f"micro_batch_size={micro_batch_size} must be a positive integer")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if not 0 <= holdout < len(dataset):
            raise DataError(f"dataset of {len(dataset)} sequences cannot hold out {holdout} for validation: "
                            "lower --eval-batches (or the global batch) or use more data")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.holdout = holdout
        self.length_buckets = tuple(length_buckets)
        self.train_rows = len(dataset) - holdout  # rows [0, train_rows) train, the rest validate
        self.batches_per_epoch = (self.train_rows // dp_size) // micro_batch_size
        if self.batches_per_epoch == 0:
            held = f" after holding out {holdout} for validation" if holdout else ""
            raise DataError(
                f"dataset of {len(dataset)} sequences{held} is too small for dp_size={dp_size} x "
                f"micro_batch_size={micro_batch_size}: lower either or use more data"
            )
        self.epoch = 0
        self.position = 0
        self._shard = self._shard_for(0)

    def _shard_for(self, epoch: int) -> torch.Tensor:
        n = self.train_rows
        if epoch == 0:
            order = torch.arange(n)
        else:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
        per_rank = self.batches_per_epoch * self.micro_batch_size
        return order[self.dp_rank :: self.dp_size][:per_rank]

    def __iter__(self) -> "MicroBatches":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        offset = self.position - self.epoch * self.batches_per_epoch
        if offset == self.batches_per_epoch:
            self.epoch += 1
            self._shard = self._shard_for(self.epoch)
            offset = 0
        idx = self._shard[offset * self.micro_batch_size : (offset + 1) * self.micro_batch_size]
        self.position += 1
        return self.read(idx.tolist(), self.epoch)

    def read(self, rows: list[int], epoch: int):
        """The micro-batch of dataset ``rows``, cut to its length bucket when there are buckets."""
        out = self.batch(rows, epoch)
        return cut(out, self.bucket_length(rows, epoch, out[0])) if self.length_buckets else out

    def bucket_length(self, rows: list[int], epoch: int, inputs) -> int:
        """Packed sequences: a bucket drawn from (seed, epoch, first row) (`mp_toolkit.data.buckets`)."""
        return drawn_bucket(self.length_buckets, self.seed, epoch, rows[0])

    def batch(self, rows: list[int], epoch: int):
        """The micro-batch of dataset ``rows`` (read in ``epoch``)."""
        chunk = torch.as_tensor(self.dataset[rows]["input_ids"], dtype=torch.int64)
        # (mbs, T + 1) -> inputs (mbs, T) and next-token labels (mbs, T); contiguous for p2p sends
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def held_out(self):
        """This replica's micro-batches of the validation rows, from the first, once through: replica r
        takes held-out rows r, r + dp_size, ... (as training shards), each micro-batch read as in epoch 0."""
        rows = list(range(self.train_rows, len(self.dataset)))[self.dp_rank :: self.dp_size]
        for k in range(len(rows) // self.micro_batch_size):
            yield self.read(rows[k * self.micro_batch_size : (k + 1) * self.micro_batch_size], 0)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        offset = position - epoch * self.batches_per_epoch
        if not 0 <= offset <= self.batches_per_epoch:
            raise DataError(
                f"data state epoch={epoch} position={position} does not fit "
                f"{self.batches_per_epoch} micro-batches per epoch: was it saved with another "
                f"dataset, micro_batch_size or dp_size?"
            )
        self.epoch, self.position = epoch, position
        self._shard = self._shard_for(epoch)
