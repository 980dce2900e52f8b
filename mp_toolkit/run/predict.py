"""What ``mpt plan`` predicts for the run being trained: the request of an `mpt train` config, and
each rank's predicted bytes for its own cut, printed beside the measured peak (DESIGN.md: memory is
a first-class result)."""
from __future__ import annotations

import os

import torch

from mp_toolkit.errors import ConfigError
from mp_toolkit.partition import PartitionError
from mp_toolkit.partition.cluster import ClusterProfile, default_profile, profile_from_dict, read_profile
from mp_toolkit.partition.cost import ACT_BYTES, CostModelError
from mp_toolkit.partition.planner import PlanRequest, make_plan
from mp_toolkit.partition.report import format_plan
from mp_toolkit.partition.search import with_devices
from mp_toolkit.run.config import TrainConfig
from mp_toolkit.user_files import parse_json, read_config_text


def run_profile(cfg: TrainConfig) -> ClusterProfile:
    """The device profile every planner decision of ``cfg``'s run takes: ``--cluster``'s, else a
    ``--layout FILE``'s own, else this device kind's default (`cluster.default_profile`: a CUDA device's
    shipped profile by name; on a CPU this machine's cores and memory), with as many nodes as the run's
    world needs."""
    par = cfg.parallel
    world = max(1, par.world_size)  # a grid the checks refuse (--tp 0) is refused there, by its own flag
    try:
        if par.cluster is not None:
            profile = read_profile(par.cluster)
        elif par.layout is not None and par.layout != "auto":
            profile = profile_from_dict(read_search(par.layout)[0].get("profile"), par.layout)
        elif torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            profile = default_profile(world, props.name, props.total_memory / 1e9)
        else:
            pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            profile = default_profile(world, cores=len(os.sched_getaffinity(0)), memory_gb=pages / 1e9)
        return with_devices(profile, world)
    except PartitionError as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def read_search(spec: str) -> tuple[dict, int]:
    """(the ``mpt plan --search --json`` document, the 1-based layout index) of ``FILE[:K]``."""
    path, _, k = spec.rpartition(":") if spec.rpartition(":")[2].isdigit() else (spec, "", "1")
    try:
        doc = parse_json(read_config_text(path, "--layout"))
    except ValueError as e:  # a ConfigError too: no such file, a FIFO, too large, not UTF-8
        raise ConfigError(f"--layout {spec}: cannot read a search output: {str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("layouts"), list):
        raise ConfigError(f"--layout {spec}: not an mpt plan --search --json output (no layouts)")
    return doc, int(k)


def plan_request(cfg: TrainConfig, **fields) -> PlanRequest:
    """The ``mpt plan`` request describing ``cfg``'s run (``fields`` override it): its grid and schedule, batch,
    recomputation, precision and optimizer, read from their sections, and its device profile (`run_profile`)."""
    par, batch, rec, precision = cfg.parallel, cfg.batch, cfg.recomputation, cfg.numerics.precision
    base = dict(model=cfg.hf or cfg.model, pp=par.pp, tp=par.tp, dp=par.dp, zero=par.zero, schedule=par.schedule,
                sequence_parallel=par.sequence_parallel, cp=par.cp, cp_attention=par.cp_attention,
                chunks=par.chunks, micro_batch=batch.micro_batch, microbatches=batch.microbatches,
                seq_len=batch.seq_len,
                memory_gb=rec.memory_gb, recompute=rec.recompute, recompute_layers=rec.recompute_layers,
                precision=precision if precision in ACT_BYTES else "fp32", optimizer=cfg.optim.optimizer,
                momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay,
                cluster=run_profile(cfg), load=False, hf=cfg.hf is not None)
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


__all__ = ["dry_run_report", "plan_request", "read_search", "run_plan", "run_profile"]
