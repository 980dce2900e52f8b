"""What ``mpt plan`` predicts for the run being trained: the request of an `mpt train` config, and
each rank's predicted bytes for its own cut, printed beside the measured peak (DESIGN.md: memory is
a first-class result)."""
from __future__ import annotations


from mp_toolkit.partition import PartitionError
from mp_toolkit.partition.cost import ACT_BYTES, CostModelError
from mp_toolkit.partition.planner import PlanRequest, make_plan
from mp_toolkit.run.config import TrainConfig
from mp_toolkit.schedule import get_schedule

PLAN_TFLOPS = 1.0
"""The rate turning FLOPs into seconds when `mpt train` plans (no layer is timed; memory and the
ratios of times do not depend on it)."""


def plan_request(cfg: TrainConfig, **fields) -> PlanRequest:
    """The ``mpt plan`` request describing ``cfg``'s run (``fields`` override it)."""
    base = dict(model=cfg.hf or cfg.model, pp=cfg.pp, tp=cfg.tp, dp=cfg.dp, micro_batch=cfg.micro_batch,
                microbatches=cfg.microbatches, seq_len=cfg.seq_len, memory_gb=cfg.memory_gb,
                dtype=cfg.precision if cfg.precision in ACT_BYTES else "fp32", optimizer=cfg.optimizer,
                schedule=cfg.schedule, chunks=cfg.chunks, tflops=PLAN_TFLOPS, load=False, hf=cfg.hf is not None,
                recompute=cfg.recompute, recompute_layers=cfg.recompute_layers, zero=cfg.zero)
    return PlanRequest(**{**base, **fields})


def predicted_rank_bytes(cfg: TrainConfig, boundaries: list[int], pp_rank: int) -> int | None:
    """The bytes ``mpt plan`` predicts this pipeline rank's steps hold above the post-import
    baseline, for the run's own cut (``boundaries``) and recomputation; None where the cost model
    does not describe the model (or the run's optimizer)."""
    fields = {"method": "memory"} if cfg.recompute == "auto" else {"boundaries": tuple(boundaries)}
    try:
        plan = make_plan(plan_request(cfg, **fields))
    except (PartitionError, CostModelError, ValueError):
        return None
    if plan.boundaries != list(boundaries):
        return None
    mine = get_schedule(cfg.schedule, cfg.pp, cfg.microbatches, num_chunks=cfg.chunks).stages_of(pp_rank)
    return sum(plan.stages[s].memory_bytes for s in mine)


__all__ = ["PLAN_TFLOPS", "plan_request", "predicted_rank_bytes"]
