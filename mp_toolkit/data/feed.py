"""What a run trains on: ``--data`` -> prepared corpora -> the samples one replica's micro-batches read.

``--data`` is a prepared directory (``mpt data prepare``), a Megatron prefix, a blend of those
(``0.7:DIR_A,0.3:DIR_B``), or something not yet prepared: a file or folder of text / JSON lines, or
``stdlib`` (this interpreter's standard library). An unprepared source runs the same prepare
(`mp_toolkit.data.prepare`) into ``<cache_dir>/prepared/<key>`` first, once: the key names the source
files by path, size and modification time (never by reading them), the tokenizer and the kind of
corpus, so a later start finds it; it holds out `AUTO_VAL_FRACTION` of the documents for validation.
Then every source is a `PreparedCorpus`, memory-mapped, and the samples are
`mp_toolkit.data.packed.PackedSamples` (GPT) or `mp_toolkit.data.pairs.PairSamples` (BERT), blended by
weight (`mp_toolkit.data.blend`) when there are several. Their index arrays are cached beside the data
(``DIR/cache``) or, when DIR is not writable, under ``<cache_dir>/index``.

The tokenizer: a prepared corpus brings its own (DIR/tokenizer.json); ``tokenizer`` (``--tokenizer``, a
HF directory or tokenizer.json) encodes an unprepared source, else a byte-level BPE is trained on it with
the model's vocabulary. Every id must be below the model's vocab_size: a tokenizer with more tokens
than the embedding has rows is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from mp_toolkit.data.blend import BlendedSamples, parse_blend
from mp_toolkit.data.corpus import stdlib_files
from mp_toolkit.data.mlm import SPECIAL_TOKENS, SpecialIds
from mp_toolkit.data.packed import PackedSamples
from mp_toolkit.data.pairs import PairSamples
from mp_toolkit.data.prepared import TOKENIZER, PreparedCorpus, is_prepared
from mp_toolkit.data.synthetic import synthetic_documents
from mp_toolkit.data.tokens import load_tokenizer_file
from mp_toolkit.errors import DataError

AUTO_VAL_FRACTION = 0.05
"""Documents an automatically prepared source holds out for validation (chosen by document)..."""
AUTO_VAL_MIN_DOCS = {False: 1, True: 2}
"""... and at least this many (a source of a few documents still has a validation split; BERT's random B
comes from another document, so pairs need two)."""


@dataclass(frozen=True)
class Wanted:
    """What the model needs of its data: the kind of samples and the vocabulary."""

    vocab_size: int
    """The embedding's rows: every id must be below it."""
    seq_len: int
    seed: int
    pairs: bool = False
    """BERT sentence pairs (a sentence-split corpus) instead of packed causal-LM samples."""
    hf_order: bool = False
    """BERT inputs in HF's order (input_ids, attention_mask, token_type_ids)."""
    tokenizer: Path | None = None
    """A tokenizer.json (or HF directory holding one) to prepare unprepared sources with; None: train one."""


@dataclass(frozen=True)
class Fed:
    """The run's samples: training, validation (None when the data has no held-out split), their digest."""

    train: object
    validation: object | None
    digest: str
    corpora: tuple[PreparedCorpus, ...]
    special: SpecialIds | None = None

    @property
    def tokenizer_digest(self) -> str | None:
        """The sha256 of the (first) corpus's tokenizer.json: how `mpt export` finds it again."""
        tok = self.corpora[0].manifest.get("tokenizer")
        return tok.get("sha256") if tok else None


def tokenizer_file(path: str | os.PathLike) -> Path:
    """``--tokenizer``: a tokenizer.json, or a directory holding one."""
    path = Path(path)
    file = path / TOKENIZER if path.is_dir() else path
    if not file.is_file():
        raise DataError(f"--tokenizer {path}: no {TOKENIZER} there (give a HF tokenizer directory or its "
                        f"{TOKENIZER})")
    return file


def source_key(source: str, wanted: Wanted, tokenizer_digest: str | None) -> str:
    """The cache key of an unprepared source (module docstring): its files' paths, sizes and times."""
    files = stdlib_files() if source == "stdlib" else _files(Path(source))
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    h.update(json.dumps([tokenizer_digest, None if tokenizer_digest else wanted.vocab_size, wanted.pairs,
                         AUTO_VAL_FRACTION, AUTO_VAL_MIN_DOCS[wanted.pairs]]).encode())
    return h.hexdigest()[:20]


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    if not path.exists():
        raise DataError(f"--data {path}: no such file or directory")
    return [path]


def open_source(source: str, wanted: Wanted, cache_dir: Path, log=None) -> PreparedCorpus:
    """``source`` as a prepared corpus, preparing it into the cache first when it is not one."""
    if source != "stdlib" and is_prepared(source):
        corpus = PreparedCorpus.open(source)
        if wanted.tokenizer is not None and corpus.tokenizer_file is not None:
            given = hashlib.sha256(tokenizer_file(wanted.tokenizer).read_bytes()).hexdigest()
            if given != corpus.manifest["tokenizer"]["sha256"]:
                raise DataError(f"the run's tokenizer {tokenizer_file(wanted.tokenizer)} is not the one {source} was "
                                f"prepared with ({corpus.tokenizer_file}): prepare the data with the run's tokenizer")
        return corpus
    tok = tokenizer_file(wanted.tokenizer) if wanted.tokenizer is not None else None
    if tok is not None:  # before preparing anything with it
        check_tokenizer(wanted.tokenizer, wanted.vocab_size)
    digest = hashlib.sha256(tok.read_bytes()).hexdigest() if tok is not None else None
    out = Path(cache_dir) / "prepared" / source_key(source, wanted, digest)
    if not is_prepared(out):
        if log is not None:
            log(f"data: preparing {source} into {out} (once; `mpt data prepare` does this ahead of time)")
        run_prepare([source], out, tok, None if tok else wanted.vocab_size, wanted.pairs)
    return PreparedCorpus.open(out)


def run_prepare(inputs: list[str], out: Path, tokenizer: Path | None, vocab_size: int | None, pairs: bool) -> None:
    """``mpt data prepare`` in a process of its own: the same code path as the command, and the training
    rank's memory stays its own (a tokenizer's training sample and its merges are freed with the process)."""
    argv = [sys.executable, "-m", "mp_toolkit.cli", "data", "prepare", "--input", *inputs, "--output", str(out),
            *(["--tokenizer", str(tokenizer)] if tokenizer is not None else ["--vocab-size", str(vocab_size)]),
            *(["--split-sentences"] if pairs else []), "--val-fraction", str(AUTO_VAL_FRACTION), "--val-min-docs",
            str(AUTO_VAL_MIN_DOCS[pairs]), "--seed", "0",
            "--workers", "1", "--no-progress"]
    root = str(Path(__file__).resolve().parents[2])  # this mp_toolkit, pip-installed or a checkout on sys.path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit code {done.returncode}"]
        raise DataError(lines[-1].removeprefix("mpt data: error: "))


def synthetic_source(seed: int, cache_dir: Path) -> str:
    """BERT's ``--data synthetic``: `synthetic_documents` written once as JSON lines under the cache."""
    path = Path(cache_dir) / "synthetic" / f"bert-documents-{seed}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.partial")
        tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in synthetic_documents(seed)))
        os.replace(tmp, path)
    return str(path)


def index_dir(corpus: PreparedCorpus, cache_dir: Path) -> Path:
    """Where a corpus's sample indices are cached: beside it when writable, else under the cache."""
    home = corpus.path if corpus.path.is_dir() else corpus.path.parent
    if os.access(home, os.W_OK):
        return home / "cache"
    return Path(cache_dir) / "index" / corpus.digest[:20]


def check_tokenizer(tokenizer: str | os.PathLike, vocab_size: int) -> None:
    """``--tokenizer``'s vocabulary fits the model's embedding."""
    size = load_tokenizer_file(tokenizer_file(tokenizer))[0].get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise DataError(f"--tokenizer {tokenizer} has {size} tokens but the model's vocab_size is {vocab_size} (ids "
                        f"must be below it): use a model with at least {size} or the tokenizer the model was built for")


def check_fits(data: str, tokenizer: str | os.PathLike | None, vocab_size: int) -> None:
    """Before any rank starts: ``--tokenizer`` and every prepared ``--data`` corpus fit the model's
    vocabulary (reads manifests and the tokenizer only)."""
    if tokenizer is not None:
        check_tokenizer(tokenizer, vocab_size)
    prepared = [(source, PreparedCorpus.open(source)) for _, source in parse_blend(data)
                if source not in ("stdlib", "synthetic") and is_prepared(source)]
    for source, corpus in prepared:
        check_vocab(corpus, source, vocab_size)
    check_one_tokenizer(data, [corpus for _, corpus in prepared])


def check_vocab(corpus: PreparedCorpus, source: str, vocab_size: int) -> None:
    """Every id the corpus's tokenizer can give must be below the model's vocab_size."""
    if corpus.vocab_size is not None and corpus.vocab_size > vocab_size:
        raise DataError(f"--data {source}: its tokenizer has {corpus.vocab_size} tokens but the model's vocab_size is "
                        f"{vocab_size} (ids must be below it): use a model with at least {corpus.vocab_size} or the "
                        "tokenizer the model was built for")


def special_ids(corpus: PreparedCorpus, source: str) -> tuple[SpecialIds, tuple[int, ...]]:
    """BERT's [PAD] [CLS] [SEP] [MASK] ids in the corpus's tokenizer, and the ids never masked."""
    if corpus.tokenizer_file is None:
        raise DataError(f"--data {source} has no tokenizer (a bare Megatron prefix): BERT pairs need its [PAD] [CLS] "
                        "[SEP] [MASK] ids; prepare it with `mpt data prepare --tokenizer ...`")
    tokenizer, _ = load_tokenizer_file(corpus.tokenizer_file)
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    if None in ids:
        missing = ", ".join(t for t, i in zip(SPECIAL_TOKENS, ids) if i is None)
        raise DataError(f"--data {source}: its tokenizer lacks {missing}, which BERT pairs need")
    special = SpecialIds(*ids)
    return special, tuple(sorted(set(_added(tokenizer)) | set(ids)))


def _added(tokenizer: Tokenizer) -> list[int]:
    return list(tokenizer.get_added_tokens_decoder())


def feed(data: str, wanted: Wanted, cache_dir: Path, total: int, nsp_probability: float = 0.5,
         mlm_probability: float = 0.15, log=None) -> Fed:
    """The samples of ``--data`` for a run of ``total`` training samples (the blend's length)."""
    parts = parse_blend(data)
    sources = [synthetic_source(wanted.seed, cache_dir) if s == "synthetic" and wanted.pairs else s for _, s in parts]
    corpora = tuple(open_source(source, wanted, Path(cache_dir), log) for source in sources)
    check_one_tokenizer(data, corpora)
    opened = [_samples(corpus, source, wanted, Path(cache_dir), nsp_probability, mlm_probability)
              for corpus, source in zip(corpora, sources)]
    special = opened[0][2]
    digest = hashlib.sha256(":".join(f"{w}={c.digest}" for (w, _), c in zip(parts, corpora)).encode()).hexdigest()
    if len(parts) == 1:
        return Fed(opened[0][0], opened[0][1], digest, corpora, special)
    names = [s for _, s in parts]
    train = BlendedSamples([(w, part[0]) for (w, _), part in zip(parts, opened)], total, cache_dir, names, log)
    val = None
    if all(part[1] is not None for part in opened):
        val = BlendedSamples([(w, part[1]) for (w, _), part in zip(parts, opened)],
                             sum(len(part[1]) for part in opened), cache_dir, names)
    return Fed(train, val, digest, corpora, special)


def check_one_tokenizer(data: str, corpora) -> None:
    """Blended corpora share one tokenizer: the same id means the same text in each."""
    tokenizers = {c.manifest["tokenizer"]["sha256"] for c in corpora if c.manifest.get("tokenizer")}
    if len(tokenizers) > 1:
        raise DataError(f"--data {data}: the blended corpora were prepared with different tokenizers (their ids mean "
                        "different text): prepare them with one --tokenizer")


def _samples(corpus: PreparedCorpus, source: str, wanted: Wanted, cache_dir: Path, nsp_probability: float,
             mlm_probability: float) -> tuple:
    """(training samples, validation samples or None, BERT's special ids or None) of one corpus."""
    check_vocab(corpus, source, wanted.vocab_size)
    cache = index_dir(corpus, cache_dir)
    if not wanted.pairs:
        unchecked = wanted.vocab_size if corpus.vocab_size is None else None  # no tokenizer said it fits
        return (PackedSamples(corpus.train, wanted.seq_len, wanted.seed, cache, vocab_size=unchecked),
                _validation(corpus, wanted, cache), None)
    if not corpus.split_sentences:
        raise DataError(f"--data {source} was prepared without --split-sentences: BERT pairs need sentences "
                        "(prepare it again with --split-sentences)")
    special, never = special_ids(corpus, source)

    def pairs(shards, name):
        return PairSamples(shards, special, wanted.vocab_size, never, wanted.seq_len, wanted.seed, cache / name,
                           nsp_probability=nsp_probability, mlm_probability=mlm_probability, hf_order=wanted.hf_order)

    train = pairs(corpus.train, "train")
    try:  # a validation split too small for pairs (one document) only matters to a run that evaluates
        val = pairs(corpus.val, "val") if sum(len(ds) for ds in corpus.val) else None
    except DataError:
        val = None
    return train, val, special


def _validation(corpus: PreparedCorpus, wanted: Wanted, cache: Path) -> PackedSamples | None:
    """GPT's held-out samples: the validation split packed in order; None when it has too few tokens."""
    if sum(ds.num_tokens for ds in corpus.val) <= wanted.seq_len:
        return None
    return PackedSamples(corpus.val, wanted.seq_len, wanted.seed, cache, shuffle=False, name="val")
