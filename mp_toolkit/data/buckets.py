"""Micro-batches cut to length buckets (``mpt train --length-buckets 32,64,128``, issue 21 item 3).

By default every micro-batch is ``--seq-len`` tokens long (packed causal-LM chunks, BERT pairs
padded to ``--seq-len``). With buckets, each micro-batch is cut to one bucket's length, so a run
trains on several sequence lengths and the pipeline agrees each new shape once
(`mp_toolkit.engine.shapes`). ``--seq-len`` is always the largest bucket (added when not given);
every bucket is at most ``--seq-len``. Which bucket:

* **padded data** (BERT's sentence pairs, any micro-batch with an attention mask): the smallest
  bucket that holds the micro-batch's longest pair; only padding is cut, no token is lost;
* **packed data** (causal LM): a bucket drawn uniformly from ``numpy.random.default_rng([seed,
  epoch, first row of the micro-batch, BUCKET_STREAM])``; the tokens past it are dropped (each
  row keeps its first L + 1 tokens: L inputs and their L next-token labels).

Both depend on the data only (not on the layout), so every rank of a replica, every layout and a
resumed run cut each micro-batch alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mp_toolkit.flag_values import BucketError, parse_buckets, with_seq_len

__all__ = ["BUCKET_STREAM", "BucketError", "cut", "drawn_bucket", "fitting_bucket", "parse_buckets", "with_seq_len"]

BUCKET_STREAM = 0x6C656E  # keeps the bucket draws apart from any other use of the same seed


def drawn_bucket(buckets: Sequence[int], seed: int, epoch: int, first_row: int) -> int:
    """Packed data: the bucket of the micro-batch whose first dataset row is ``first_row``."""
    rng = np.random.default_rng([seed, epoch, first_row, BUCKET_STREAM])
    return int(buckets[int(rng.integers(len(buckets)))])


def fitting_bucket(buckets: Sequence[int], attention_mask: torch.Tensor) -> int:
    """Padded data: the smallest bucket holding every row's tokens (mask 1), else the largest."""
    longest = int(attention_mask.sum(dim=1).max())
    return next((b for b in buckets if b >= longest), int(buckets[-1]))


def cut(batch, length: int):
    """``batch`` (nested tuples of tensors) with every (B, T) tensor cut to its first ``length``
    positions (contiguous, as p2p sends them); (B,) tensors (NSP labels) stay as they are."""
    if isinstance(batch, (tuple, list)):
        return type(batch)(cut(t, length) for t in batch)
    return batch[:, :length].contiguous() if batch.dim() == 2 else batch
