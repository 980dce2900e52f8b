"""Cut an ordered layer list into contiguous pipeline stages.

A partition is a list of boundaries ``[0, b1, ..., num_layers]`` of length ``num_stages+1``;
stage ``i`` is ``layers[b[i]:b[i+1]]`` and is never empty. Solvers take per-layer weights
(parameter counts, FLOPs, measured times, ...) and return boundaries; they know nothing
about models.
"""
from __future__ import annotations

import bisect
import math
from fractions import Fraction
from numbers import Integral, Real
from typing import Sequence

from mp_toolkit.errors import PartitionError

__all__ = [
    "PartitionError",
    "uniform",
    "min_max",
    "by_parameters",
    "explicit",
    "partition",
    "stage_sums",
    "METHODS",
]


def check_num_stages(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise PartitionError(
            f"cannot split into {num_stages} pipeline stages: --pp must be at least 1"
        )
    if num_stages > num_layers:
        raise PartitionError(
            f"cannot split {num_layers} layers into {num_stages} pipeline stages: "
            f"--pp must be at most {num_layers}"
        )


def uniform(num_layers: int, num_stages: int) -> list[int]:
    """Equal layer counts; the first ``num_layers % num_stages`` stages get one layer more.

    >>> uniform(10, 4)
    [0, 3, 6, 8, 10]
    """
    check_num_stages(num_layers, num_stages)
    size, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for stage in range(num_stages):
        bounds.append(bounds[-1] + size + (1 if stage < extra else 0))
    return bounds


def exact_weights(weights: Sequence[Real]) -> list[int]:
    """Weights as integers scaled by one common factor, so sums compare exactly.

    Every float is a dyadic rational, so ``Fraction(w)`` is exact; scaling by the largest
    denominator (a power of two) makes every weight an integer.
    """
    fracs = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, Real):
            raise PartitionError(f"layer {i} has weight {w!r}; weights must be real numbers")
        if not math.isfinite(w) or w < 0:
            raise PartitionError(f"layer {i} has weight {w!r}; weights must be finite and >= 0")
        fracs.append(Fraction(int(w)) if isinstance(w, Integral) else Fraction(float(w)))
    scale = math.lcm(*(f.denominator for f in fracs)) if fracs else 1
    return [int(f * scale) for f in fracs]


def _min_bottleneck(prefix: list[int], num_stages: int) -> int:
    """Smallest T such that the layers split into ``num_stages`` parts each summing to <= T.

    Binary search over the candidate values (all segment sums) with a greedy feasibility
    test; greedy is exact because weights are non-negative.
    """
    n = len(prefix) - 1
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})

    def feasible(limit: int) -> bool:
        parts, start = 1, 0
        for i in range(1, n + 1):
            if prefix[i] - prefix[i - 1] > limit:
                return False
            if prefix[i] - prefix[start] > limit:
                parts, start = parts + 1, i - 1
        # At most num_stages parts; splitting a part further never raises the maximum.
        return parts <= num_stages

    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def min_max(weights: Sequence[Real], num_stages: int) -> list[int]:
    """The contiguous cut minimising the largest stage sum (exact), balanced on ties.

    Among all cuts with the optimal largest stage sum, this returns the one whose stage
    sums, sorted in descending order, are lexicographically smallest ("leximax": minimise
    the largest, then the second largest, ...). Cuts still tied (zero-weight layers) resolve
    to the lexicographically smallest boundary list, i.e. cuts as early as possible.
    Sums are compared exactly: floats are converted to integers with a common scale.

    Dynamic programme over (stages used, layers covered), restricted to segments no heavier
    than the optimal bottleneck; leximax order is preserved by adding the same stage sum
    to both sides, so the best prefix cut extends to the best full cut.

    >>> min_max([4, 1, 1, 1, 1, 4], 3)
    [0, 1, 5, 6]
    """
    n = len(weights)
    check_num_stages(n, num_stages)
    w = exact_weights(weights)
    prefix = [0]
    for x in w:
        prefix.append(prefix[-1] + x)
    limit = _min_bottleneck(prefix, num_stages)

    return leximax_cut(prefix, num_stages, limit)


def leximax_cut(prefix: list[int], num_stages: int, limit: int, fits=None) -> list[int]:
    """The cut of integer prefix sums whose sorted-descending stage sums are lexicographically
    smallest among cuts with every stage sum <= ``limit`` (and ``fits(stage, a, b)`` when given);
    ties to the lexicographically smallest boundaries.

    DP over (stages used, layers covered): best[i] for the current stage count j is the best
    (sorted sums, boundaries) covering layers[:i]; stage j ends at i in j..n-(p-j).
    """
    n = len(prefix) - 1
    best: list[tuple[tuple[int, ...], tuple[int, ...]] | None] = [None] * (n + 1)
    best[0] = ((), (0,))
    for j in range(1, num_stages + 1):
        new: list[tuple[tuple[int, ...], tuple[int, ...]] | None] = [None] * (n + 1)
        for i in range(j, n - (num_stages - j) + 1):
            first_k = max(j - 1, bisect.bisect_left(prefix, prefix[i] - limit, 0, i))
            for k in range(first_k, i):
                prev = best[k]
                if prev is None or (fits is not None and not fits(j - 1, k, i)):
                    continue
                seg = prefix[i] - prefix[k]
                cand = (tuple(sorted(prev[0] + (seg,), reverse=True)), prev[1] + (i,))
                if new[i] is None or cand < new[i]:
                    new[i] = cand
        best = new
    assert best[n] is not None, "bottleneck search and DP disagree"
    return list(best[n][1])


def by_parameters(param_counts: Sequence[int], num_stages: int) -> list[int]:
    """Balance parameter counts: :func:`min_max` on the per-layer counts.

    The memory (and, for dense layers, the time) of the pipeline is set by its heaviest
    stage, so the objective is the largest stage sum. DeepSpeed's
    ``runtime.utils.partition_balanced`` optimises a different quantity (its DP keeps, per
    cell, the split with the smallest max-minus-min spread), which can leave a heavier
    bottleneck than necessary.
    """
    return min_max(param_counts, num_stages)


def explicit(boundaries: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Validate user-given boundaries and return them as a list of ints."""
    check_num_stages(num_layers, num_stages)
    bounds = list(boundaries)
    shown = "[" + ", ".join(str(b) for b in bounds) + "]"
    if len(bounds) != num_stages + 1:
        raise PartitionError(
            f"partition boundaries {shown} have {len(bounds)} entries; {num_stages} pipeline "
            f"stages need {num_stages + 1} (from 0 to {num_layers})"
        )
    if any(isinstance(b, bool) or not isinstance(b, Integral) for b in bounds):
        raise PartitionError(f"partition boundaries {shown} must be integers")
    if bounds[0] != 0:
        raise PartitionError(f"partition boundaries {shown} must start at 0")
    if bounds[-1] != num_layers:
        raise PartitionError(
            f"partition boundaries {shown} must end at {num_layers}, the number of layers"
        )
    for stage, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b <= a:
            raise PartitionError(
                f"partition boundaries {shown} must be strictly increasing: stage {stage} "
                f"({a} to {b}) would be empty"
            )
    return [int(b) for b in bounds]


def stage_sums(weights: Sequence[Real], boundaries: Sequence[int]) -> list[Real]:
    """Sum of the weights in each stage: ints for int weights, else correctly rounded floats."""
    exact_ints = all(isinstance(x, Integral) for x in weights)
    add = sum if exact_ints else math.fsum
    return [add(weights[a:b]) for a, b in zip(boundaries, boundaries[1:])]


METHODS = ("uniform", "parameters", "min_max", "explicit")


def partition(
    method: str,
    weights_or_num_layers: Sequence[Real] | int,
    num_stages: int,
    boundaries: Sequence[int] | None = None,
) -> list[int]:
    """Dispatch by name.

    * ``"uniform"``: equal layer counts; takes a layer count or any per-layer sequence;
    * ``"parameters"``: :func:`by_parameters` on per-layer parameter counts;
    * ``"min_max"``: :func:`min_max` on any per-layer cost (FLOPs, measured time);
    * ``"explicit"``: ``boundaries`` checked against the layer count.
    """
    if isinstance(weights_or_num_layers, Integral):
        num_layers, weights = int(weights_or_num_layers), None
    else:
        weights = list(weights_or_num_layers)
        num_layers = len(weights)
    if method != "explicit" and boundaries is not None:
        raise PartitionError(
            f"partition boundaries are only used with method 'explicit', not {method!r}"
        )
    if method == "uniform":
        return uniform(num_layers, num_stages)
    if method == "explicit":
        if boundaries is None:
            raise PartitionError("partition method 'explicit' needs boundaries, e.g. [0, 4, 8]")
        return explicit(boundaries, num_layers, num_stages)
    if method in ("parameters", "min_max"):
        if weights is None:
            raise PartitionError(
                f"partition method {method!r} needs one weight per layer, not a layer count"
            )
        solver = by_parameters if method == "parameters" else min_max
        return solver(weights, num_stages)
    raise PartitionError(
        f"unknown partition method {method!r}: choose one of {', '.join(METHODS)}"
    )
