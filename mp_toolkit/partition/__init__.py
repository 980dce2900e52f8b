"""Partition an ordered layer list into contiguous pipeline stages (boundaries as data)."""
from .solvers import (
    METHODS,
    PartitionError,
    by_parameters,
    explicit,
    min_max,
    partition,
    stage_sums,
    uniform,
)

__all__ = [
    "METHODS",
    "PartitionError",
    "by_parameters",
    "explicit",
    "min_max",
    "partition",
    "stage_sums",
    "uniform",
]
