"""Partition solvers against brute force, and their user-facing errors."""
import itertools
import random
from fractions import Fraction

import pytest

from mp_toolkit.partition import (
    PartitionError,
    by_parameters,
    explicit,
    min_max,
    partition,
    stage_sums,
    uniform,
)


def exact_sums(weights, bounds):
    return [sum(Fraction(w) for w in weights[a:b]) for a, b in zip(bounds, bounds[1:])]


def brute_force(weights, num_stages):
    """Every cut, ranked by (leximax stage sums, boundaries): the documented tie rule."""
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = [0, *cuts, n]
        key = (sorted(exact_sums(weights, bounds), reverse=True), bounds)
        if best is None or key < best:
            best = key
    return best


def random_instance(rng):
    n = rng.randint(1, 9)
    p = rng.randint(1, n)
    style = rng.choice(["small_int", "int", "float", "decimal"])
    if style == "small_int":  # many ties
        weights = [rng.randint(0, 3) for _ in range(n)]
    elif style == "int":
        weights = [rng.choice([0, rng.randint(1, 10**6)]) for _ in range(n)]
    elif style == "float":
        weights = [rng.choice([0.0, rng.random() * 10]) for _ in range(n)]
    else:  # decimal fractions whose float sums round (0.1 + 0.2 != 0.3)
        weights = [rng.choice([0.0, 0.1, 0.2, 0.3, 0.7]) for _ in range(n)]
    return weights, p


def test_min_max_matches_brute_force():
    rng = random.Random(1234)
    for _ in range(300):
        weights, p = random_instance(rng)
        got = min_max(weights, p)
        want_sums, want_bounds = brute_force(weights, p)
        assert len(got) == p + 1 and got[0] == 0 and got[-1] == len(weights)
        assert all(a < b for a, b in zip(got, got[1:])), (weights, p, got)
        got_sums = sorted(exact_sums(weights, got), reverse=True)
        assert got_sums[0] == want_sums[0], (weights, p, got)  # optimal bottleneck
        assert got_sums == want_sums, (weights, p, got)  # leximax tie-break
        assert got == want_bounds, (weights, p, got)  # earliest cuts on remaining ties


def test_min_max_known_values():
    assert min_max([4, 1, 1, 1, 1, 4], 3) == [0, 1, 5, 6]
    assert min_max([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [0, 5, 7, 9]  # sums 15, 13, 17
    # (1, 2, 2), (2, 1, 2) and (2, 2, 1) tie under leximax: the earliest cuts win.
    assert min_max([1, 1, 1, 1, 1], 3) == [0, 1, 3, 5]
    # Zero-weight layers: earliest cuts, so trailing zeros go to the last stage.
    assert min_max([1, 0, 1, 0], 2) == [0, 1, 4]
    assert min_max([0, 0, 0], 3) == [0, 1, 2, 3]
    assert min_max([5.0], 1) == [0, 1]


def test_min_max_balances_beyond_the_bottleneck():
    # Bottleneck 10 is forced by the first layer; the rest should still be balanced.
    weights = [10, 1, 1, 1, 1, 1, 1]
    bounds = min_max(weights, 3)
    assert stage_sums(weights, bounds) == [10, 3, 3]


def test_min_max_rejects_bad_weights():
    for bad in ([1, -1], [1, float("nan")], [float("inf"), 1], ["3", 1]):
        with pytest.raises(PartitionError, match="layer"):
            min_max(bad, 1)


def test_by_parameters_is_min_max():
    counts = [1_000, 50_000, 50_000, 50_000, 50_000, 2_000_000]
    assert by_parameters(counts, 3) == min_max(counts, 3) == [0, 3, 5, 6]


def test_uniform_counts():
    assert uniform(10, 4) == [0, 3, 6, 8, 10]
    assert uniform(8, 4) == [0, 2, 4, 6, 8]
    assert uniform(5, 5) == [0, 1, 2, 3, 4, 5]
    assert uniform(7, 1) == [0, 7]
    for n in range(1, 20):
        for p in range(1, n + 1):
            sizes = [b - a for a, b in zip(uniform(n, p), uniform(n, p)[1:])]
            assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)  # the extra layers go first


def test_too_many_stages_message():
    with pytest.raises(PartitionError) as err:
        partition("uniform", 4, 6)
    assert str(err.value) == (
        "cannot split 4 layers into 6 pipeline stages: --pp must be at most 4"
    )
    with pytest.raises(PartitionError, match="cannot split 3 layers into 4 pipeline stages"):
        partition("parameters", [1, 2, 3], 4)
    with pytest.raises(PartitionError, match="--pp must be at least 1"):
        uniform(3, 0)


def test_explicit_validation():
    assert explicit([0, 2, 5], 5, 2) == [0, 2, 5]
    cases = [  # (boundaries, num_stages, message)
        ([0, 2, 5, 6], 2, "have 4 entries; 2 pipeline stages need 3"),
        ([1, 3, 5], 2, "must start at 0"),
        ([0, 3, 4], 2, "must end at 5"),
        ([0, 3, 3, 5], 3, r"strictly increasing: stage 1 \(3 to 3\) would be empty"),
        ([0, 4, 2, 5], 3, "strictly increasing: stage 1"),
        ([0, 2.5, 5], 2, "must be integers"),
    ]
    for bounds, num_stages, message in cases:
        with pytest.raises(PartitionError, match=message):
            explicit(bounds, 5, num_stages)


def test_partition_dispatch():
    weights = [3, 1, 1, 1, 2, 2]
    assert partition("uniform", weights, 3) == [0, 2, 4, 6]
    assert partition("uniform", 6, 3) == [0, 2, 4, 6]
    assert partition("parameters", weights, 2) == [0, 3, 6]
    assert partition("min_max", [0.5, 0.5, 1.0], 2) == [0, 2, 3]
    assert partition("explicit", 6, 2, boundaries=[0, 1, 6]) == [0, 1, 6]
    with pytest.raises(PartitionError, match="needs boundaries"):
        partition("explicit", 6, 2)
    with pytest.raises(PartitionError, match="only used with method 'explicit'"):
        partition("uniform", 6, 2, boundaries=[0, 3, 6])
    with pytest.raises(PartitionError, match="needs one weight per layer"):
        partition("parameters", 6, 2)
    with pytest.raises(PartitionError, match="unknown partition method 'flops': choose one of"):
        partition("flops", weights, 2)


def test_stage_sums():
    assert stage_sums([1, 2, 3, 4], [0, 1, 4]) == [1, 9]
    assert stage_sums([0.1, 0.2, 0.3], [0, 3]) == [0.6]  # correctly rounded, not 0.6000000000000001
