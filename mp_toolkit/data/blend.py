"""Weighted blends of corpora (``--data 0.7:DIR_A,0.3:DIR_B``) as one samples object.

Blend sample g comes from corpus c = `assignment`'s choice and is that corpus's k-th sample, k
counting over its epochs (sample k of a corpus of n samples per epoch is row ``order(k // n)[k % n]``
of epoch ``k // n``: an exhausted corpus starts its next epoch, reshuffled). The assignment is
Megatron's rule for blends in closed form: corpus c's j-th sample is due at time ``(j + 1/2) / w_c``
(weights normalised), and the blend takes samples in the order they fall due (ties by corpus order).
So in any window of consecutive samples each corpus's count is within one or two of its weight's
share (1% of any 10,000), and the first G samples are the same whatever total the run asks for:
resuming with more steps continues the same stream. The assignment for the run's samples is computed
once (O(total log total)), cached as memory-mapped ``.npy`` files and read by every rank.

    blend = BlendedSamples([(0.7, owt), (0.3, books)], total=steps * global_batch, cache_dir=cache)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from mp_toolkit.data.atomic import load_array, save_array
from mp_toolkit.errors import DataError


def parse_blend(text: str) -> list[tuple[float, str]]:
    """``--data`` -> [(weight, path)]: one path (weight 1), or ``W:PATH,W:PATH,...`` with positive weights."""
    items = [t.strip() for t in str(text).split(",")]
    head = items[0].split(":", 1)
    if len(items) == 1 and not (len(head) == 2 and _number(head[0]) is not None):
        return [(1.0, items[0])]
    out = []
    for item in items:
        weight, sep, path = item.partition(":")
        w = _number(weight)
        if not sep or not path:
            raise DataError(f"--data {text}: {item!r} is not WEIGHT:PATH (a blend is 0.7:DIR_A,0.3:DIR_B)")
        if w is None or not (w > 0 and math.isfinite(w)):
            raise DataError(f"--data {text}: blend weight {weight!r} is not a positive number")
        out.append((w, path))
    return out


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def assignment(weights: Sequence[float], total: int) -> tuple[np.ndarray, np.ndarray]:
    """(corpus of each blend sample, its number within that corpus), each (total,) int64 (module docstring)."""
    w = np.asarray(weights, dtype=np.float64) / math.fsum(weights)
    counts = [int(math.ceil(wc * total)) + 1 for wc in w]  # enough due times per corpus to fill `total`
    due = np.concatenate([(np.arange(n, dtype=np.float64) + 0.5) / wc for n, wc in zip(counts, w)])
    corpus = np.concatenate([np.full(n, c, np.int64) for c, n in enumerate(counts)])
    number = np.concatenate([np.arange(n, dtype=np.int64) for n in counts])
    first = np.lexsort((corpus, due))[:total]  # by due time, ties by corpus
    return corpus[first], number[first]


class BlendedSamples:
    """The samples protocol (`mp_toolkit.data.lm`) over weighted corpora: one "epoch" of ``total``
    samples in blend order (epoch e > 0 continues the stream at e x total). ``log``: say once per corpus
    when it starts another epoch."""

    def __init__(self, parts: Sequence[tuple[float, object]], total: int, cache_dir, names: Sequence[str] = (),
                 log=None):
        if total <= 0:
            raise DataError(f"a blend of {total} samples: at least one")
        self.parts = [p for _, p in parts]
        self.weights = [float(w) for w, _ in parts]
        self.total, self.names, self.log = total, list(names) or [f"corpus {i}" for i in range(len(parts))], log
        key = hashlib.sha256(repr((self.weights, [len(p) for p in self.parts], total,
                                   [getattr(p, "cache", "") for p in self.parts])).encode()).hexdigest()[:16]
        self.cache = Path(cache_dir) / "blend" / key
        self._said: set[int] = set()
        self._corpus, self._number = self._index()
        self._per_stream: np.ndarray | None = None  # each corpus's samples in one whole stream, when needed

    def _index(self) -> tuple[np.ndarray, np.ndarray]:
        files = [self.cache / "corpus.npy", self.cache / "number.npy"]
        arrays = [load_array(f, self.total) for f in files]
        if any(a is None for a in arrays):
            for f, a in zip(files, assignment(self.weights, self.total)):
                save_array(f, a)
            arrays = [load_array(f, self.total) for f in files]
        return arrays[0], arrays[1]

    def __len__(self) -> int:
        return self.total

    def order(self, epoch: int) -> range:
        """Blend order is the stream itself (each corpus is shuffled within its own epochs)."""
        return range(self.total)

    def shares(self, start: int, count: int) -> np.ndarray:
        """Each corpus's fraction of blend samples ``[start, start + count)``."""
        picked = np.asarray(self._corpus[start : start + count])
        return np.bincount(picked, minlength=len(self.parts)) / max(1, len(picked))

    def locate(self, row: int, epoch: int) -> tuple[int, int, int]:
        """(corpus, its epoch, its row) of blend sample ``row`` of blend epoch ``epoch``."""
        g = epoch * self.total + row
        if g >= self.total:  # past the cached stream: continue it by whole blend epochs
            c, k = int(self._corpus[g % self.total]), int(self._number[g % self.total])
            if self._per_stream is None:
                self._per_stream = np.bincount(np.asarray(self._corpus), minlength=len(self.parts))
            k += (g // self.total) * int(self._per_stream[c])
        else:
            c, k = int(self._corpus[g]), int(self._number[g])
        n = len(self.parts[c])
        e = k // n
        if e > 0 and c not in self._said and self.log is not None:
            self._said.add(c)
            self.log(f"data: {self.names[c]} is exhausted after {n} samples; it starts epoch {e} (reshuffled)")
        return c, e, int(self.parts[c].order(e)[k % n])

    def read(self, rows: Sequence[int], epoch: int):
        """Each row from its corpus, stacked in row order (nested tuples of tensors, as the corpora give)."""
        return _stack([self.parts[c].read([r], e) for c, e, r in (self.locate(int(row), epoch) for row in rows)])

    def bucket_length(self, rows: Sequence[int], epoch: int, inputs, buckets: Sequence[int]) -> int:
        c, e, r = self.locate(int(rows[0]), epoch)
        return self.parts[c].bucket_length([r], e, inputs, buckets)


def _stack(batches: list):
    """Micro-batches of one row each (nested tuples of (1, ...) tensors) -> one micro-batch."""
    first = batches[0]
    if isinstance(first, (tuple, list)):
        return type(first)(_stack([b[i] for b in batches]) for i in range(len(first)))
    return torch.cat(batches, dim=0)
