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
