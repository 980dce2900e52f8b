"""The cut and the per-stage activation recomputation of an `mpt train` run, and ``--schedule auto``.

``--recompute none|full|selective`` keeps the cut ``--partition`` names and recomputes the first
``--recompute-layers`` block layers of each stage (`mp_toolkit.recompute.stage_choices`).
``--recompute auto`` asks the planner for both, as ``mpt plan --method memory --recompute auto
--memory-gb GB`` answers (`mp_toolkit.partition.recompute.min_max_recompute`), under ``--memory-gb``
or else the device's capacity, with times from the cost model's FLOPs at the run's device profile
(`run.predict.run_profile`): pure arithmetic on facts of the machine, so every rank plans the same cut.
"""
from __future__ import annotations

import dataclasses

from mp_toolkit.layers import LayerList
from mp_toolkit.names import stages_per_rank
from mp_toolkit.partition import PartitionError
from mp_toolkit.partition.auto_schedule import DEFAULT_CANDIDATES, ScheduleChoice, fastest_schedule
from mp_toolkit.partition.cost import CostModelError
from mp_toolkit.partition.planner import Plan, PlanRequest, make_plan
from mp_toolkit.recompute import RecomputeError, StageRecompute, apply_recompute, stage_blocks, stage_choices
from mp_toolkit.run.config import ConfigError, TrainConfig, parse_boundaries
from mp_toolkit.run.cut import CutWorkload, plan_boundaries
from mp_toolkit.run.predict import plan_request


def auto_request(cfg: TrainConfig) -> PlanRequest:
    """The ``mpt plan`` request whose answer ``--recompute auto`` applies (FLOP times at the run's profile)."""
    return plan_request(cfg, method="memory", recompute="auto", recompute_layers=None,
                        recompute_modes=("full",) if cfg.hf is not None else ("full", "selective"))  # HF: full only


def cut_and_recompute(cfg: TrainConfig, layers: LayerList, config, ctx=None,
                      planned: Plan | None = None) -> tuple[list[int], list[StageRecompute]]:
    """(boundaries, one `StageRecompute` per stage) for ``cfg`` over the unsplit ``layers``.
    ``planned``: a plan of ``cfg``'s own ``--recompute auto`` request already made (the schedule
    candidate `choose_schedule` kept), taken instead of planning it again."""
    rec, par = cfg.recomputation, cfg.parallel
    if rec.recompute != "auto":
        bounds = plan_boundaries(layers, par.pp, par.partition, par.chunks, CutWorkload.of(cfg, config, ctx),
                                 par.schedule)
        try:
            return bounds, stage_choices(rec.recompute, rec.recompute_layers, len(bounds) - 1)
        except RecomputeError as e:
            raise ConfigError(str(e)) from None
    request = auto_request(cfg)
    try:
        plan = planned if planned is not None and planned.request == request else make_plan(request)
    except (PartitionError, CostModelError) as e:
        raise ConfigError(f"--recompute auto: {str(e).splitlines()[0]}") from None
    if plan.boundaries[-1] != len(layers):
        raise ConfigError(f"--recompute auto: the cost model describes {plan.boundaries[-1]} layers but the model "
                          f"has {len(layers)}; use --recompute full or selective")
    return plan.boundaries, plan.recompute


def apply_choices(layers: LayerList, boundaries: list[int], choices: list[StageRecompute]) -> dict[str, str]:
    """`apply_recompute`, its refusal as a `ConfigError`."""
    try:
        return apply_recompute(layers, boundaries, choices)
    except RecomputeError as e:
        raise ConfigError(str(e)) from None


def describe(layers: LayerList, boundaries: list[int], choices: list[StageRecompute]) -> str:
    """One line: each stage's recomputation."""
    blocks = stage_blocks(layers.names, boundaries)
    return "; ".join(f"stage {j}: {c.describe(len(b))}" for j, (c, b) in enumerate(zip(choices, blocks)))


def choose_schedule(cfg: TrainConfig, named: bool = True,
                    chunks_given: bool = False) -> tuple[TrainConfig, str | None, Plan | None]:
    """The run's schedule, decided once: (``cfg`` with it, the line saying so or None, the winning
    candidate's plan or None). ``--schedule auto`` takes the planner's fastest (`resolve_auto_schedule`);
    a run that names none (``named`` False) the planner's default pick (`default_schedule`); a named
    schedule stays, and nothing is planned."""
    if cfg.parallel.schedule == "auto":
        choice = _auto_choice(cfg, chunks_given, None)
        return _with_choice(cfg, choice), choice.describe(), choice.plan
    if named or not _default_applies(cfg):
        return cfg, None, None
    try:
        choice = _auto_choice(cfg, False, default_candidates(cfg))
    except ConfigError:  # e.g. a model the cost model does not describe: 1F1B, as before the planner
        return cfg, None, None
    picked = _with_choice(cfg, choice)
    if picked.parallel.schedule == cfg.parallel.schedule:
        return cfg, None, choice.plan
    line = choice.describe().replace("--schedule auto:", "schedule (default, the planner's pick):", 1)
    return picked, line + "; --schedule 1f1b to keep 1F1B", choice.plan


def _auto_choice(cfg: TrainConfig, chunks_given: bool, candidates: tuple[str, ...] | None) -> ScheduleChoice:
    """The planner's fastest schedule for ``cfg`` among ``candidates`` (default: all): FLOP times at the
    run's device profile, on the cut the run will train (`own_cut`), fitting ``--memory-gb`` or else the
    device's capacity."""
    request = dataclasses.replace(auto_request(cfg), chunks=cfg.parallel.chunks if chunks_given else 1)
    rec = cfg.recomputation
    if rec.recompute != "auto":
        request = dataclasses.replace(request, **own_cut(cfg), recompute=rec.recompute,
                                      recompute_layers=rec.recompute_layers)
    try:
        return fastest_schedule(request, *(() if candidates is None else (candidates,)))
    except (PartitionError, CostModelError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def own_cut(cfg: TrainConfig) -> dict:
    """The plan request's fields for the cut ``cfg`` trains: ``--partition``'s boundaries, or its method
    (``time``, measured by rank 0 when the ranks start, planned on the flops cut)."""
    bounds = parse_boundaries(cfg.parallel.partition)
    if bounds is not None:
        return {"boundaries": tuple(bounds)}
    method = cfg.parallel.partition
    return {"method": "flops" if method == "time" else method}


def _with_choice(cfg: TrainConfig, choice: ScheduleChoice) -> TrainConfig:
    r = choice.plan.request
    return cfg.replace(schedule=r.schedule, chunks=r.chunks)


def _default_applies(cfg: TrainConfig) -> bool:
    """The planner picks the schedule of a run naming none with our engine at pp > 1."""
    return cfg.engine == "mp_toolkit" and cfg.parallel.pp >= 2 and cfg.parallel.schedule == "1f1b"


def resolve_auto_schedule(cfg: TrainConfig, chunks_given: bool = False,
                          candidates: tuple[str, ...] | None = None) -> tuple[TrainConfig, str]:
    """``--schedule auto``: ``cfg`` with the fastest schedule the planner predicts among ``candidates``
    (default: all), and the line saying so (`_auto_choice`)."""
    choice = _auto_choice(cfg, chunks_given, candidates)
    return _with_choice(cfg, choice), choice.describe()


def default_schedule(cfg: TrainConfig) -> tuple[TrainConfig, str | None]:
    """The schedule of a run that names none (no ``--schedule``, no DeepSpeed ``pipeline.schedule``):
    with our engine at pp > 1, the one the planner predicts fastest of `default_candidates` (ZB-drain
    and ZB-H1 hold what their deferred weight gradients need, interleaved one more chunk micro-batch
    per stage below: more memory, capped by ``--memory-gb`` when given), 1F1B on a tie. Returns
    ``cfg`` and the line saying so (None when 1F1B stays, or when the planner cannot describe the model)."""
    picked, line, _ = choose_schedule(cfg, named=False)
    return picked, line


def default_candidates(cfg: TrainConfig) -> tuple[str, ...]:
    """`DEFAULT_CANDIDATES`, less those of several stages per rank (interleaved, the V schedules) where the
    run fixes what they would change: boundaries named by ``--partition`` (pp + 1 of them),
    ``--recompute-layers`` counted per stage (pp of them), or ``--chunks`` (given without a schedule
    that takes it: the check that refuses it stays)."""
    layer_counts = cfg.recomputation.recompute_layers
    fixed = (parse_boundaries(cfg.parallel.partition) is not None or cfg.parallel.chunks != 1
             or (layer_counts is not None and len(layer_counts) > 1))
    return tuple(c for c in DEFAULT_CANDIDATES if not (fixed and stages_per_rank(c) > 1))
