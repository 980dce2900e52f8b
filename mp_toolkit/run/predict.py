"""What ``mpt plan`` predicts for the run being trained: the request of an `mpt train` config, and
each rank's predicted bytes for its own cut, printed beside the measured peak (DESIGN.md: memory is
a first-class result)."""
from __future__ import annotations

from mp_toolkit.partition import PartitionError
from mp_toolkit.partition.cost import ACT_BYTES, CostModelError
from mp_toolkit.partition.planner import PlanRequest, make_plan
from mp_toolkit.partition.report import format_plan
from mp_toolkit.run.config import TrainConfig

PLAN_TFLOPS = 1.0
"""The rate turning FLOPs into seconds when `mpt train` plans (no layer is timed; memory and the
ratios of times do not depend on it)."""


def plan_request(cfg: TrainConfig, **fields) -> PlanRequest:
    """The ``mpt plan`` request describing ``cfg``'s run (``fields`` override it): its grid and schedule, batch,
    recomputation, precision and optimizer, read from their sections."""
    par, batch, rec, precision = cfg.parallel, cfg.batch, cfg.recomputation, cfg.numerics.precision
    base = dict(model=cfg.hf or cfg.model, pp=par.pp, tp=par.tp, dp=par.dp, zero=par.zero, schedule=par.schedule,
                chunks=par.chunks, micro_batch=batch.micro_batch, microbatches=batch.microbatches,
                seq_len=batch.seq_len,
                memory_gb=rec.memory_gb, recompute=rec.recompute, recompute_layers=rec.recompute_layers,
                precision=precision if precision in ACT_BYTES else "fp32", optimizer=cfg.optim.optimizer,
                momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay,
                tflops=PLAN_TFLOPS, load=False, hf=cfg.hf is not None)
    return PlanRequest(**{**base, **fields})


def run_plan(cfg: TrainConfig, boundaries: list[int]):
    """``mpt plan``'s plan of ``cfg``'s run for its own cut (``boundaries``) and recomputation; None
    where the cost model does not describe the model (or the run's optimizer)."""
    fields = {"method": "memory"} if cfg.recomputation.recompute == "auto" else {"boundaries": tuple(boundaries)}
    try:
        plan = make_plan(plan_request(cfg, **fields))
    except (PartitionError, CostModelError, ValueError):
        return None
    return plan if plan.boundaries == list(boundaries) else None


def dry_run_report(cfg: TrainConfig, boundaries: list[int], plan, launcher: str) -> str:
    """What ``mpt train --dry-run`` prints: the run every check accepted (``cfg`` with its choices
    resolved, its cut ``boundaries``), and ``plan``, ``mpt plan``'s prediction for that cut (per stage:
    layers, parameters, time, peak memory; None where the cost model cannot describe it), nothing started."""
    data = "synthetic tokens" if cfg.dataset.data == "synthetic" else f"data {cfg.dataset.data}"
    par = cfg.parallel
    head = (f"dry run: every check passed; {par.world_size} rank(s) (pp {par.pp} x tp {par.tp} x dp {par.dp}) "
            f"would be started by {launcher}, {cfg.steps} steps of {cfg.tokens_per_step:,} tokens on {data}, "
            f"precision {cfg.numerics.precision}, schedule {par.schedule}, cut {','.join(map(str, boundaries))}")
    if plan is None:
        return f"{head}\n(no memory plan: the cost model does not describe this model or optimizer)"
    return f"{head}\n{format_plan(plan)}"


__all__ = ["PLAN_TFLOPS", "dry_run_report", "plan_request", "run_plan"]
