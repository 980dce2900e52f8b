"""The values of `mpt`'s list-valued flags, parsed and checked: ``--length-buckets`` (`parse_buckets`,
`with_seq_len`) and ``--recompute-layers`` (`parse_layer_counts`), each fault one line for the user.

Imports nothing, so the parser (`mp_toolkit.cli_args`) and `TrainConfig` need no torch; `data.buckets`
and `mp_toolkit.recompute` use them and re-export them.
"""

from __future__ import annotations

from collections.abc import Sequence


class BucketError(ValueError):
    """A ``--length-buckets`` value the user can fix (one line)."""


def parse_buckets(text: str) -> tuple[int, ...]:
    """``"32,64,128"`` -> (32, 64, 128): positive lengths, sorted, without repeats."""
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BucketError(f"--length-buckets {text!r} is not a list of lengths like 32,64,128") from None
    if not lengths or min(lengths) < 1:
        raise BucketError(f"--length-buckets {text!r}: give positive lengths like 32,64,128")
    return tuple(sorted(set(lengths)))


def with_seq_len(buckets: Sequence[int], seq_len: int) -> tuple[int, ...]:
    """The buckets a run uses: those given, each at most ``seq_len``, and ``seq_len`` itself."""
    too_long = [b for b in buckets if b > seq_len]
    if too_long:
        raise BucketError(f"--length-buckets {','.join(map(str, buckets))} has {too_long[0]} > --seq-len {seq_len}: "
                          "every bucket must fit the sequences the data holds (raise --seq-len or drop it)")
    return tuple(sorted(set(buckets) | {seq_len})) if buckets else ()


class RecomputeError(ValueError):
    """A recomputation request that cannot be honoured (one line for the user)."""


def parse_layer_counts(text: str) -> tuple[int, ...]:
    """``"2"`` -> (2,) (every stage), ``"2,0,1"`` -> one count per stage."""
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise RecomputeError(f"--recompute-layers {text!r} must be a count such as 2, or one count per stage "
                             f"such as 2,0") from None
    if any(c < 0 for c in counts):
        raise RecomputeError(f"--recompute-layers {text!r}: counts must be >= 0")
    return counts


class SpikeRewindError(ValueError):
    """A ``--spike-rewind`` value the user can fix (one line)."""


SPIKE_REWINDS = 3
"""Rewinds a run may take when ``--spike-rewind Z,K`` names no R."""


def parse_spike_rewind(text: str) -> tuple[float, int, int] | None:
    """``"4,20"`` -> (4.0, 20, 3); ``"4,20,5"`` -> (4.0, 20, 5); ``"off"`` -> None: Z standard deviations
    (positive, finite), K global batches skipped (>= 1) and at most R rewinds (>= 1)."""
    if text.strip().lower() in ("off", "none"):
        return None
    parts = [x.strip() for x in text.split(",")]
    form = f"--spike-rewind {text!r}: give Z,K or Z,K,R (Z standard deviations > 0, K >= 1 global batches to " \
           f"skip, R >= 1 rewinds, default {SPIKE_REWINDS}), e.g. 4,20"
    try:
        z, k, r = float(parts[0]), int(parts[1]), int(parts[2]) if len(parts) == 3 else SPIKE_REWINDS
    except (ValueError, IndexError):
        raise SpikeRewindError(form) from None
    if len(parts) > 3 or not (0 < z < float("inf")) or not 1 <= k <= 10**9 or not 1 <= r <= 10**6:
        raise SpikeRewindError(form)
    return z, k, r


class ElasticError(ValueError):
    """An ``--elastic`` value the user can fix (one line)."""


def parse_elastic(text: str) -> tuple[int, int]:
    """``"1:4"`` -> (1, 4); ``"2"`` -> (2, 2): the data-parallel replicas a run may have, MIN <= MAX."""
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise ElasticError(f"--elastic {text!r}: give MIN:MAX data-parallel replicas, e.g. 1:2") from None
    if not 1 <= bounds[0] <= bounds[1] <= 65536:
        raise ElasticError(f"--elastic {text!r}: give 1 <= MIN <= MAX data-parallel replicas, e.g. 1:2")
    return bounds
