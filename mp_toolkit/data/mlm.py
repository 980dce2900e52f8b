"""BERT pre-training data: documents -> sentence pairs (NSP) -> [CLS] A [SEP] B [SEP] -> MLM batches.

Every rank builds the same corpus (bit-identical, like ``build_lm_dataset``) and iterates
``MLMMicroBatches`` with its own data-parallel rank. Nothing touches the network.

    corpus = build_mlm_corpus("stdlib", vocab_size=4096, seq_len=128, seed=0, cache_dir=".cache/mpt")
    batches = MLMMicroBatches(corpus, micro_batch_size=8, dp_rank=0, dp_size=1, seed=0)
    (input_ids, token_type_ids, attention_mask), (mlm_labels, nsp_labels) = next(batches)
    # each (8, 128) int64, nsp_labels (8,); model: BertConfig(vocab_size=corpus.vocab_size,
    #                                                         pad_token_id=corpus.special.pad, ...)

Tokenizer: ``mp_toolkit.data.tokens.train_tokenizer``'s byte-level BPE (cached, no unknown tokens) with
``[PAD] [CLS] [SEP] [MASK]`` appended as the last four ids. Text is encoded with the plain BPE, so
a literal "[SEP]" in a source file stays ordinary text and never becomes a separator.

Pairs (Devlin et al. 2019, section 3.1): a document's non-empty lines are its sentences; A is a
run of consecutive sentences filling about half of the seq_len - 3 budget, B the run that
follows (label 0, "is next"), or with probability ``nsp_probability`` a run starting at a random
sentence of a different document (label 1, "random"; the true B's sentences are then reused for
the next A, as Google's create_pretraining_data does). Pairs are fixed at build time from ``seed``.

Masking is dynamic (RoBERTa) but reproducible: example i in epoch e is masked by a generator
seeded with (seed, e, i), so a resumed run, or another data-parallel layout, sees the same
tokens. 15% of the non-special tokens are chosen (rounded stochastically, at least one); of
those 80% become [MASK], 10% a random non-special token, 10% stay; labels are -100 elsewhere.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import datasets
import numpy as np
import torch
from tokenizers import Tokenizer

from mp_toolkit.data.buckets import fitting_bucket
from mp_toolkit.data.corpus import read_texts, stdlib_files
from mp_toolkit.data.lm import MicroBatches
from mp_toolkit.data.tokens import MIN_VOCAB, train_tokenizer
from mp_toolkit.errors import DataError

SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")
IS_NEXT, NOT_NEXT = 0, 1  # NSP labels, as HF's BertForPreTraining reads them
IGNORE_INDEX = -100


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the BERT special tokens in a corpus's vocabulary."""

    pad: int
    cls: int
    sep: int
    mask: int


@dataclass(frozen=True)
class MLMCorpus:
    """Sentence pairs packed to ``seq_len``, unmasked, with the vocabulary they use.

    ``dataset`` rows (shuffled with the build seed): ``input_ids``, ``token_type_ids``,
    ``attention_mask`` (each seq_len), ``next_sentence_label``, and where the pair came from:
    ``doc_a``/``a_start``/``a_end`` and ``doc_b``/``b_start``/``b_end`` (document index into the
    corpus texts, half-open sentence range before truncation).
    """

    dataset: datasets.Dataset
    tokenizer: Tokenizer
    """BPE plus the four special tokens (decodes every id)."""
    special: SpecialIds
    vocab_size: int
    """Rows the model's embedding needs (BPE + special tokens)."""
    seq_len: int
    never_mask: tuple[int, ...]
    """Ids that are never chosen for masking: the special tokens, and the BPE's own <|endoftext|>."""


def bert_tokenizer(texts: list[str], vocab_size: int,
                   cache_dir: str | os.PathLike) -> tuple[Tokenizer, Tokenizer, SpecialIds]:
    """(plain BPE for encoding, BPE + special tokens for decoding, their ids).

    ``vocab_size`` counts both: the BPE is trained with ``vocab_size - 4`` (cached by
    ``train_tokenizer``); on a small corpus it may come out smaller, and the specials follow it.
    """
    n_special = len(SPECIAL_TOKENS)
    if vocab_size < MIN_VOCAB + n_special:
        raise DataError(f"vocab_size={vocab_size} is too small for byte-level BPE plus {n_special} BERT "
                        f"special tokens: use at least {MIN_VOCAB + n_special}")
    base = train_tokenizer(texts, vocab_size - n_special, cache_dir)
    full = Tokenizer.from_str(base.to_str())
    first = full.get_vocab_size()
    full.add_special_tokens(list(SPECIAL_TOKENS))
    ids = [full.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != list(range(first, first + n_special)):  # the packing below relies on appended ids
        raise DataError(f"special tokens got ids {ids}, expected {first}..{first + n_special - 1}")
    return base, full, SpecialIds(*ids)


def _document_sentences(texts: list[str], tokenizer: Tokenizer) -> list[list[list[int]]]:
    """Per document, the BPE ids of each non-empty (stripped) line, through a datasets map."""

    def encode(batch):
        out = []
        for text in batch["text"]:
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            out.append([enc.ids for enc in tokenizer.encode_batch(lines)] if lines else [])
        return {"sentences": out}

    docs = datasets.Dataset.from_dict({"text": texts})
    docs = docs.map(encode, batched=True, batch_size=64, remove_columns=["text"], keep_in_memory=True,
                    # an in-memory dataset has no cache files, so this name is never looked up;
                    # giving one skips hashing the tokenizer inside ``encode``
                    new_fingerprint=f"bert-sentences-{len(texts)}")
    return docs.to_dict()["sentences"]  # plain lists: the pairing below slices them


def _take(sentences: list[list[int]], start: int, min_tokens: int) -> int:
    """End (exclusive) of the shortest run from ``start`` holding >= min_tokens (at least one sentence)."""
    end, n = start, 0
    while end < len(sentences) and (end == start or n < min_tokens):
        n += len(sentences[end])
        end += 1
    return end


def _truncate(la: int, lb: int, budget: int) -> tuple[int, int]:
    """Trim the longer side one token at a time until A + B fit (A loses its front, B its end)."""
    while la + lb > budget:
        if la > lb:
            la -= 1
        else:
            lb -= 1
    return la, lb


def _pairs(docs: list[list[list[int]]], seq_len: int, nsp_probability: float, seed: int) -> dict[str, list]:
    """All sentence pairs of the corpus: provenance columns plus the (truncated) A and B token lists."""
    rng = np.random.default_rng(seed)
    budget = seq_len - 3  # [CLS] A [SEP] B [SEP]
    nonempty = [d for d, s in enumerate(docs) if s]
    if len(nonempty) < 2:
        raise DataError(f"corpus has {len(nonempty)} document(s) with text; next-sentence pairs need at "
                        f"least 2 (a random B comes from a different document)")
    where = {d: i for i, d in enumerate(nonempty)}
    rows: dict[str, list] = {k: [] for k in ("doc_a", "a_start", "a_end", "doc_b", "b_start", "b_end",
                                             "next_sentence_label", "a", "b")}
    for d in nonempty:
        sents, i = docs[d], 0
        while i < len(sents):
            a_end = _take(sents, i, budget // 2)
            if a_end == len(sents):
                break  # no sentence left for B; the document's tail is not used as an A
            la = sum(len(s) for s in sents[i:a_end])
            if rng.random() < nsp_probability:
                j = int(rng.integers(len(nonempty) - 1))
                doc_b = nonempty[j + (j >= where[d])]  # any other document, uniformly
                b_start = int(rng.integers(len(docs[doc_b])))
                label, nxt = NOT_NEXT, a_end  # the true B's sentences start the next A
            else:
                doc_b, b_start, label = d, a_end, IS_NEXT
            b_end = _take(docs[doc_b], b_start, budget - la)
            if label == IS_NEXT:
                nxt = b_end
            a = [t for s in sents[i:a_end] for t in s]
            b = [t for s in docs[doc_b][b_start:b_end] for t in s]
            na, nb = _truncate(len(a), len(b), budget)
            for key, value in (("doc_a", d), ("a_start", i), ("a_end", a_end), ("doc_b", doc_b),
                               ("b_start", b_start), ("b_end", b_end), ("next_sentence_label", label),
                               ("a", a[len(a) - na:]), ("b", b[:nb])):
                rows[key].append(value)
            i = nxt
    if not rows["a"]:
        raise DataError("corpus gives no sentence pairs: documents need at least two non-empty lines")
    return rows


def _pack(a: list[list[int]], b: list[list[int]], special: SpecialIds, seq_len: int) -> dict[str, np.ndarray]:
    """[CLS] A [SEP] B [SEP] [PAD]...: ids, token types (0 through the first [SEP], 1 for B and its
    [SEP], 0 on padding) and the attention mask (1 on tokens, 0 on padding); each (N, seq_len)."""
    n = len(a)
    ids = np.full((n, seq_len), special.pad, dtype=np.int32)
    types = np.zeros((n, seq_len), dtype=np.int8)
    mask = np.zeros((n, seq_len), dtype=np.int8)
    for r, (ta, tb) in enumerate(zip(a, b)):
        row = [special.cls, *ta, special.sep, *tb, special.sep]
        ids[r, : len(row)] = row
        types[r, len(ta) + 2 : len(row)] = 1
        mask[r, : len(row)] = 1
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}


def build_mlm_corpus(source: str | os.PathLike | Sequence[str], vocab_size: int, seq_len: int, seed: int,
                     cache_dir: str | os.PathLike, nsp_probability: float = 0.5) -> MLMCorpus:
    """Sentence pairs from "stdlib", a file/directory path (see ``read_texts``), or a list of documents.

    The tokenizer is trained once per (corpus, vocab_size) and cached under ``cache_dir``; equal
    arguments give a bit-identical corpus on every rank.
    """
    if seq_len < 5:
        raise DataError(f"seq_len={seq_len} cannot hold [CLS] A [SEP] B [SEP]: use at least 5")
    if not 0.0 <= nsp_probability <= 1.0:
        raise DataError(f"nsp_probability={nsp_probability} must be in [0, 1]")
    if isinstance(source, (str, os.PathLike)):
        texts, _ = read_texts(stdlib_files() if str(source) == "stdlib" else [source])
    else:
        texts = list(source)
        if not all(isinstance(t, str) for t in texts):
            raise DataError("a corpus given as a list must hold strings (one document each)")
    if not texts:
        raise DataError(f"corpus {source if isinstance(source, (str, os.PathLike)) else '(list)'} has no text")
    base, full, special = bert_tokenizer(texts, vocab_size, cache_dir)
    rows = _pairs(_document_sentences(texts, base), seq_len, nsp_probability, seed)
    packed = _pack(rows.pop("a"), rows.pop("b"), special, seq_len)
    columns = {**packed, **{k: np.asarray(v, dtype=np.int64) for k, v in rows.items()}}
    ds = datasets.Dataset.from_dict(columns).shuffle(seed=seed).with_format("numpy")
    never = sorted(set(full.get_added_tokens_decoder()) | set(dataclasses.astuple(special)))
    return MLMCorpus(ds, full, special, full.get_vocab_size(), seq_len, tuple(never))


def tokenized_mlm_corpus(source, tokenizer: Tokenizer, special_ids: Sequence[int], vocab_size: int, seq_len: int,
                         seed: int) -> MLMCorpus:
    """`build_mlm_corpus`'s pairing and packing over a given tokenizer's ids (an HF directory's, whose
    [PAD] [CLS] [SEP] [MASK] are ``special_ids``): lines are encoded without its post-processor (the
    packing adds [CLS] / [SEP] itself). ``source``: documents, "stdlib" or a file or folder."""
    if isinstance(source, list):
        texts = source
    else:
        texts, _ = read_texts(stdlib_files() if source == "stdlib" else [source])
    doc = json.loads(tokenizer.to_str())
    doc["post_processor"] = None
    plain = Tokenizer.from_str(json.dumps(doc))
    special = SpecialIds(*special_ids)
    rows = _pairs(_document_sentences(texts, plain), seq_len, 0.5, seed)
    packed = _pack(rows.pop("a"), rows.pop("b"), special, seq_len)
    top = int(packed["input_ids"].max())
    if top >= vocab_size:
        raise DataError(f"tokenizer gives token id {top}, but the model's vocab_size is {vocab_size}: use the "
                        "tokenizer the model was built for (ids must be below vocab_size)")
    columns = {**packed, **{k: np.asarray(v, dtype=np.int64) for k, v in rows.items()}}
    ds = datasets.Dataset.from_dict(columns).shuffle(seed=seed).with_format("numpy")
    never = sorted(set(tokenizer.get_added_tokens_decoder()) | set(dataclasses.astuple(special)))
    return MLMCorpus(ds, tokenizer, special, min(tokenizer.get_vocab_size(), vocab_size), seq_len, tuple(never))


def mask_tokens(ids: np.ndarray, rng: np.random.Generator, mask_id: int, never_mask: np.ndarray,
                random_ids: np.ndarray, mlm_probability: float = 0.15) -> tuple[np.ndarray, np.ndarray]:
    """BERT's masking of one sequence (T,): returns (masked ids, labels with -100 where not chosen).

    ``never_mask``: ids never chosen (padding, [CLS], [SEP], ...); ``random_ids``: the ids a
    "random token" replacement draws from, uniformly.
    """
    candidates = np.flatnonzero(~np.isin(ids, never_mask))
    labels = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
    out = ids.astype(np.int64)
    if len(candidates) == 0:
        return out, labels
    # Round p * n stochastically: the expected count is exactly p * n (plain rounding is biased
    # when most sequences have the same length), the spread at most one token; at least one.
    expected = mlm_probability * len(candidates)
    k = max(1, int(expected) + int(rng.random() < expected - int(expected)))
    chosen = rng.choice(candidates, size=k, replace=False)
    labels[chosen] = out[chosen]
    u = rng.random(k)  # < 0.8: [MASK]; [0.8, 0.9): random token; >= 0.9: unchanged
    out[chosen[u < 0.8]] = mask_id
    randomized = chosen[(u >= 0.8) & (u < 0.9)]
    out[randomized] = random_ids[rng.integers(len(random_ids), size=len(randomized))]
    return out, labels


class MLMMicroBatches(MicroBatches):
    """Infinite ``((input_ids, token_type_ids, attention_mask), (mlm_labels, nsp_labels))`` micro-batches.

    Sharding, per-epoch order and ``state_dict`` are ``MicroBatches``'s (rank r takes examples
    r, r + dp_size, ... of the epoch's order); each example is masked from (seed, epoch, index).
    ``hf_order``: the inputs in HF BERT's order, ``(input_ids, attention_mask, token_type_ids)``
    (`mp_toolkit.hf.bert`'s first layer); `model_zoo.bert` takes the token types second.
    """

    def __init__(self, corpus: MLMCorpus, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, mlm_probability: float = 0.15, hf_order: bool = False, holdout: int = 0,
                 length_buckets: tuple[int, ...] = ()):
        if not 0.0 < mlm_probability < 1.0:
            raise DataError(f"mlm_probability={mlm_probability} must be in (0, 1)")
        super().__init__(corpus.dataset, micro_batch_size, dp_rank, dp_size, seed, holdout, length_buckets)
        self.corpus, self.mlm_probability, self.hf_order = corpus, mlm_probability, hf_order
        self._never = np.asarray(corpus.never_mask, dtype=np.int64)
        self._random_ids = np.setdiff1d(np.arange(corpus.vocab_size), self._never)  # regular tokens

    def indices(self, epoch: int) -> list[int]:
        """The dataset rows this rank reads in ``epoch``, in order."""
        return self._shard_for(epoch).tolist()

    def bucket_length(self, rows: list[int], epoch: int, inputs) -> int:
        """Padded pairs: the smallest bucket holding the longest pair; only padding is cut."""
        return fitting_bucket(self.length_buckets, inputs[1 if self.hf_order else 2])

    def batch(self, idx: list[int], epoch: int):
        """The masked micro-batch of dataset rows ``idx`` in ``epoch`` (`MicroBatches` picks the rows)."""
        rows = self.dataset[idx]
        masked = [mask_tokens(ids, np.random.default_rng([self.seed, epoch, i]), self.corpus.special.mask,
                              self._never, self._random_ids, self.mlm_probability)
                  for ids, i in zip(rows["input_ids"], idx)]
        as_long = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
        ids, types, mask = (as_long([m[0] for m in masked]), as_long(rows["token_type_ids"]),
                            as_long(rows["attention_mask"]))  # (mbs, T) each
        inputs = (ids, mask, types) if self.hf_order else (ids, types, mask)
        labels = (as_long([m[1] for m in masked]), as_long(rows["next_sentence_label"]))  # (mbs, T), (mbs,)
        return inputs, labels
