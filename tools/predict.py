"""The one place a tool asks what ``mpt plan`` predicts for a run: the run as a `TrainConfig` (the
fields of ``mpt train``'s flags), then `mp_toolkit.run.predict.plan_request` -- the request ``mpt train``
itself plans with --, or `resolve_run` for everything ``mpt train`` decides before its ranks start
(schedule and chunks when none is named, the cut, the prediction).

    cfg = train_config("gpt-small-cpu", pp=2, microbatches=8, optimizer="adamw")
    plan = predict(cfg, method="flops")           # the cut and each stage's bytes and time
    rank_bytes(plan, cfg.parallel.pp)             # predicted bytes of each rank
    resolve_run(cfg, schedule_named=False).boundaries   # the cut mpt train would run

Not imported by the library.
"""
from __future__ import annotations

import json
from pathlib import Path

from mp_toolkit.partition.planner import Plan, make_plan
from mp_toolkit.run.config import TrainConfig
from mp_toolkit.run.plan import resolve_run
from mp_toolkit.run.predict import plan_request
from tools.peers import Workload

__all__ = ["model_file", "predict", "rank_bytes", "resolve_run", "train_config", "workload_config"]


def train_config(model: str, **fields) -> TrainConfig:
    """The ``mpt train`` run of ``model`` (a preset or a config.json) with ``fields`` (TrainConfig's flat names)."""
    return TrainConfig.of(model=model, **fields)


def workload_config(w: Workload, folder: Path, **fields) -> TrainConfig:
    """The ``mpt train`` run of the benchmark workload ``w`` (`tools.peers`: synthetic tokens, no
    clipping), its GPT written to ``folder/config.json``; ``fields`` add to it (``schedule``, ``chunks``, ...)."""
    return train_config(model_file(w.gpt_config().to_dict(), folder), pp=w.pp, microbatches=w.microbatches,
                        micro_batch=w.micro_batch, seq_len=w.seq_len, precision=w.precision, threads=w.threads,
                        optimizer="adamw", lr=w.lr, weight_decay=w.weight_decay, clip_grad=None, seed=w.seed,
                        data="synthetic", **fields)


def predict(cfg: TrainConfig, **fields) -> Plan:
    """``mpt plan``'s plan of ``cfg``'s run; ``fields`` override the request (`PlanRequest`'s names:
    ``method``, ``tflops`` -- None times a GEMM here --, ``measure``, ``load``, ``recompute``, ...)."""
    return make_plan(plan_request(cfg, **fields))


def rank_bytes(plan: Plan, pp: int, tp: int = 1) -> list[int]:
    """Predicted bytes of each global rank (pipeline rank major, as the grid orders ranks): the sum of
    its stages (placed by the plan's schedule), shared by its tp ranks (each stage's ``memory_bytes`` is
    already one tp rank's)."""
    stage = [0] * pp
    to_rank = plan.timeline.schedule.stage_to_rank
    for s in plan.stages:
        stage[to_rank[s.index]] += s.memory_bytes
    return [stage[r // tp] for r in range(pp * tp)]


def model_file(config: dict, folder: Path, name: str = "config.json") -> str:
    """``config`` written as ``folder/name`` (a model ``mpt plan`` and ``mpt train`` read); its path."""
    path = Path(folder, name)
    path.write_text(json.dumps(config))
    return str(path)
