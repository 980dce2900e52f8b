"""The cut for a V placement (`mp_toolkit.schedule.vshape`: rank ``r`` holds stages ``r`` and ``2p-1-r``):
balance the ranks, each the sum of its two stages, where `solvers.min_max` balances stages.

Apart from `solvers` because it computes with numpy, which ``mpt --help`` does not import.
"""
from __future__ import annotations

import functools
import math
from numbers import Real
from typing import Sequence

import numpy as np

from .solvers import check_num_stages, exact_weights, min_max

__all__ = ["min_max_v", "balanced"]


def balanced(weights: Sequence[Real], num_stages: int, v: bool) -> list[int]:
    """The min-max cut of ``weights`` into ``num_stages`` stages: of the stages (`solvers.min_max`), or with
    ``v`` (a V schedule's placement) of the ranks, each two stages (`min_max_v`). The planner's balancing
    methods, the search's floors and `mpt train`'s cut all cut through here."""
    return min_max_v(weights, num_stages // 2) if v else min_max(weights, num_stages)


def min_max_v(weights: Sequence[Real], num_ranks: int) -> list[int]:
    """The cut into ``2 p`` stages for the V placement (rank ``r`` holds stages ``r`` and ``2p-1-r``,
    `mp_toolkit.schedule.vshape`) whose busiest rank is lightest; among those, the one whose heaviest
    stage is lightest; among those, the one whose ranks are most even (least sum of squared rank sums).
    The stage min-max cut balances stages, so a rank of two heavy stages (the middle of a GPT, while its
    ends hold a light embedding and a heavy LM head) sets the step; the second criterion keeps a
    micro-batch's way through the stages even (a V schedule passes each micro-batch through every stage
    in turn); the third spreads what is left when one layer (a large LM head) decides both.

    The first two are exact for weights whose sums float64 holds exactly (integers below 2^53, such as
    FLOPs and parameter counts; measured times to their rounding). Three passes of one dynamic
    programme (`_v_pass`); kept per weights (scaled to their common divisor) and p, as the planner asks
    again for every micro-batch size.

    >>> min_max_v([1, 4, 4, 4, 4, 1, 6], 2)  # rank 0: [1, 4] + [1, 6] = 12, rank 1: [4] + [4, 4] = 12
    [0, 2, 3, 5, 7]
    """
    check_num_stages(len(weights), 2 * num_ranks)
    w = exact_weights(weights)
    g = math.gcd(*w) or 1
    return list(_min_max_v(tuple(x // g for x in w), num_ranks))


@functools.lru_cache(maxsize=256)
def _min_max_v(w: tuple[int, ...], p: int) -> tuple[int, ...]:
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(w, dtype=np.float64))])
    inf = np.inf
    busiest, _ = _v_pass(prefix, p, np.maximum, lambda a, b: a + b, lambda mid, half: mid)
    heaviest, _ = _v_pass(prefix, p, np.maximum, lambda a, b: np.where(a + b <= busiest, np.maximum(a, b), inf),
                          lambda mid, half: np.where(mid <= busiest, half, inf))

    def even(a, b):
        return np.where((a + b <= busiest) & (a <= heaviest) & (b <= heaviest), np.square(a + b), inf)

    return _v_pass(prefix, p, np.add, even,
                   lambda mid, half: np.where((mid <= busiest) & (half <= heaviest), np.square(mid), inf))[1]


def _v_pass(prefix: np.ndarray, p: int, combine, outer, inner) -> tuple[float, tuple[int, ...]]:
    """(the optimum, its boundaries) of ``combine`` (max or add) over the ranks of a V of ``p`` ranks:
    ``outer(left, right)`` values an outer rank by the sums of its two stages, ``inner(middle, half)``
    the innermost by its sum and its heavier stage when cut where the two balance.

    After ranks ``0..r-1`` the layers ``[0, i)`` and ``[j, n)`` are taken and ``best[i, j]`` is the best
    value so far; rank ``r`` takes ``[i0, i)`` and ``[j, j0)`` from the state ``(i0, j0)`` before it.
    O(p n^4) comparisons, done by numpy in O(p n^2) steps."""
    n = len(prefix) - 1
    best = np.full((n + 1, n + 1), np.inf)
    best[0, n] = 0.0
    came: list[dict[tuple[int, int], tuple[int, int]]] = []
    # right[j, j0]: the right stage [j, j0), where j0 > j
    right = np.where(np.arange(n + 1)[None, :] > np.arange(n + 1)[:, None], prefix[None, :] - prefix[:, None], np.inf)
    for r in range(p - 1):  # the outer ranks, each a stage on either side
        new = np.full((n + 1, n + 1), np.inf)
        back: dict[tuple[int, int], tuple[int, int]] = {}
        room = 2 * (p - r - 1)  # the ranks inside need a layer per stage
        for i in range(r + 1, n - room - r):
            js = np.arange(i + room, n - r)
            left = (prefix[i] - prefix[:i])[None, :, None]  # (1, i, 1): the left stage [i0, i)
            # (j, i0, j0): every right stage [j, j0) with every state (i0, j0) the rank leaves
            cand = combine(best[None, :i, :], outer(left, right[js][:, None, :]))
            cand = np.where(np.isfinite(right[js])[:, None, :], cand, np.inf)
            flat = cand.reshape(len(js), -1)
            k = flat.argmin(axis=1)
            for j, kk, value in zip(js.tolist(), k.tolist(), flat[np.arange(len(js)), k].tolist()):
                if value < np.inf:
                    new[i, j] = value
                    back[(i, j)] = divmod(kk, n + 1)
        best = new
        came.append(back)
    i_idx, j_idx = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    middle = prefix[j_idx] - prefix[i_idx]
    mid = np.searchsorted(prefix, (prefix[i_idx] + prefix[j_idx]) / 2)  # the layer where the middle crosses half
    half = np.full((n + 1, n + 1), np.inf)
    for k in (mid - 1, mid):
        k = np.minimum(np.clip(k, i_idx + 1, np.maximum(j_idx - 1, i_idx + 1)), n)  # j - i < 2: masked below
        half = np.minimum(half, np.maximum(prefix[k] - prefix[i_idx], prefix[j_idx] - prefix[k]))
    total = np.where(j_idx - i_idx >= 2, combine(best, inner(middle, half)), np.inf)
    i, j = divmod(int(total.argmin()), n + 1)
    value = float(total[i, j])
    k = min(range(i + 1, j), key=lambda k: max(prefix[k] - prefix[i], prefix[j] - prefix[k]))
    lefts, rights = [i, k], [j]
    for back in reversed(came):
        i, j = back[(i, j)]
        lefts.insert(0, i)
        rights.append(j)
    return value, tuple(lefts + rights)
