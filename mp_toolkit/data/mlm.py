"""BERT's pre-training vocabulary and masking: the special tokens, their ids, and `mask_tokens`.

The sentence pairs themselves are drawn from a prepared, sentence-split corpus
(`mp_toolkit.data.pairs.PairSamples`, ``mpt data prepare --split-sentences``). A trained tokenizer is our
byte-level BPE with ``[PAD] [CLS] [SEP] [MASK]`` appended as its last four ids (`mp_toolkit.data.prepare`);
a given one (an HF BERT directory's WordPiece) brings its own.

Masking is dynamic (RoBERTa) but reproducible: example i in epoch e is masked by a generator seeded
with (seed, e, i), so a resumed run, or another data-parallel layout, sees the same tokens. 15% of
the non-special tokens are chosen (rounded stochastically, at least one); of those 80% become
[MASK], 10% a random non-special token, 10% stay; labels are -100 elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mp_toolkit.data.tokens import SPECIAL_TOKENS

__all__ = ["IGNORE_INDEX", "IS_NEXT", "NOT_NEXT", "SPECIAL_TOKENS", "SpecialIds", "mask_tokens"]

IS_NEXT, NOT_NEXT = 0, 1  # NSP labels, as HF's BertForPreTraining reads them
IGNORE_INDEX = -100


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the BERT special tokens in a corpus's vocabulary."""

    pad: int
    cls: int
    sep: int
    mask: int


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
