"""The run plan: everything decided about an `mpt train` run before a rank trains, decided once.

`resolve_run` takes the merged `TrainConfig` (flags over a DeepSpeed config over the defaults) and
decides, in this order, each thing once:

1. the model (``--hf`` reads its files' headers here, once), the sequence length where none was
   given (128, or the model's positions when it has fewer), and the precision (``auto``: bf16 where
   this device multiplies it fast, else fp32), so that every check, ``--dry-run`` and the planner see
   what the ranks will train;
2. the layout where ``--layout`` asks the planner's search for it (`run.layout`), then the schedule and
   its chunks (``--schedule auto``, or the planner's pick when none is named;
   `run.recompute_plan.choose_schedule`), keeping the winning candidate's plan;
3. every check that needs no process group, the cut and each stage's recomputation, the
   schedule's actions (`run.checks`);
4. ``mpt plan``'s prediction for that cut: the winning candidate's plan where it planned this cut,
   else one plan of it (`run.predict.run_plan`).

`mpt train` resolves once in the process the user started and hands the decisions to the ranks it
starts (`RunPlan.to_json`, in the ``MPT_RUN_PLAN`` variable `run.launch` reads): a rank rebuilds the
plan from them (`RunPlan.received`) with its own model spec and nothing re-planned. Ranks started by a
launcher (torchrun, deepspeed) each resolve once, alike: planning is arithmetic. A ``--partition
time`` cut is the one exception, measured by rank 0 when the ranks start (`run.cut.time_cut`), and
its prediction planned then.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mp_toolkit.errors import ConfigError
from mp_toolkit.optim.master import resolve_precision
from mp_toolkit.partition.cost import optimizer_bytes
from mp_toolkit.recompute import StageRecompute
from mp_toolkit.run.checks import Checked, check_received, find_model, validate, validate_numbers
from mp_toolkit.run.config import TrainConfig
from mp_toolkit.run.families import ModelSpec
from mp_toolkit.run.layout import apply_layout
from mp_toolkit.run.predict import run_plan
from mp_toolkit.run.recompute_plan import choose_schedule
from mp_toolkit.schedule import Schedule

__all__ = ["RunPlan", "resolve_run"]

RUN_PLAN_FORMAT = 2
LAID_OUT = ("pp", "tp", "dp", "micro_batch", "microbatches", "zero", "recompute", "partition")
"""What ``--layout`` may set beside the schedule (`run.layout`), handed to the ranks as decided."""


@dataclass(frozen=True)
class RunPlan:
    """One `mpt train` run as decided before any rank trains; every later step reads it."""

    cfg: TrainConfig
    """The run's config with its choices resolved: ``precision`` never ``auto``; ``schedule`` and
    ``chunks`` the planner's where none was named (or ``auto``)."""
    spec: ModelSpec
    """The model family and its config (`run.families`)."""
    boundaries: tuple[int, ...]
    """The cut of the unsplit layer list into pp x chunks stages. Under ``--partition time`` the flops
    cut, until rank 0 measures the real one (`measured_cut`)."""
    recompute: tuple[StageRecompute, ...]
    """Each stage's activation recomputation (``--recompute auto``: the planner's per-stage choice)."""
    schedule: Schedule
    """The schedule's actions per rank (`mp_toolkit.schedule.get_schedule`), built once."""
    stage_bytes: tuple[int, ...] | None
    """``mpt plan``'s predicted bytes per stage for this cut above the post-import baseline; None where the
    cost model does not describe the model (or the optimizer)."""
    notes: tuple[str, ...] = ()
    """Lines rank 0 prints first (DeepSpeed config notes, the schedule the planner picked)."""
    prediction: object = None
    """``mpt plan``'s whole `Plan` for the cut (what ``--dry-run`` prints); None in a rank that received
    the plan, and where ``stage_bytes`` is None."""

    stage_copy_bytes: tuple[int, ...] | None = None
    """``--async-save``: the host copy a save holds per stage on the rank that writes it (tp rank 0 of
    data-parallel replica 0): its fp32 tensors, whole across tp, and their optimizer state. None
    without --async-save or a cost model."""

    @property
    def measured_cut(self) -> bool:
        """Whether rank 0 measures the cut when the ranks start (``--partition time``): ``boundaries``
        and ``stage_bytes`` are the flops cut's until then."""
        cfg = self.cfg  # recompute auto: the planner's cut
        return cfg.parallel.partition == "time" and cfg.recomputation.recompute != "auto"

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` runs (interleaved: one per chunk)."""
        return self.schedule.stages_of(pp_rank)

    def predicted_rank_bytes(self, pp_rank: int) -> int | None:
        """What ``mpt plan`` predicts pipeline rank ``pp_rank``'s steps hold above the post-import
        baseline (None: the cost model cannot say)."""
        if self.stage_bytes is None:
            return None
        return sum(self.stage_bytes[s] for s in self.stages_of(pp_rank))

    def copy_bytes(self, pp_rank: int) -> int:
        """The --async-save copy pipeline rank ``pp_rank``'s writer holds (0: none, or not predicted)."""
        if self.stage_copy_bytes is None:
            return 0
        return sum(self.stage_copy_bytes[s] for s in self.stages_of(pp_rank))

    def to_json(self) -> dict:
        """The decisions a rank cannot repeat without planning: what `received` takes back."""
        cfg = self.cfg
        return {"format": RUN_PLAN_FORMAT, "seq_len": cfg.batch.seq_len, "precision": cfg.numerics.precision,
                "schedule": cfg.parallel.schedule, "chunks": cfg.parallel.chunks, "boundaries": list(self.boundaries),
                "recompute": [[c.mode, c.layers] for c in self.recompute],
                "stage_bytes": None if self.stage_bytes is None else list(self.stage_bytes),
                "stage_copy_bytes": None if self.stage_copy_bytes is None else list(self.stage_copy_bytes),
                "layout": {k: cfg.flat()[k] for k in LAID_OUT}}

    @classmethod
    def received(cls, cfg: TrainConfig, doc: dict) -> RunPlan:
        """The plan the process that started this rank resolved (`to_json`) for ``cfg`` (the same
        command line): the model spec is this rank's own, nothing is planned again."""
        if not isinstance(doc, dict) or doc.get("format") != RUN_PLAN_FORMAT:
            raise ConfigError("MPT_RUN_PLAN is not a run plan of this mpt: start the ranks with mpt train or a "
                              "launcher, not with MPT_RUN_PLAN set by hand")
        cfg = cfg.replace(seq_len=doc["seq_len"], precision=doc["precision"], schedule=doc["schedule"],
                          chunks=doc["chunks"], **doc["layout"])
        recompute = tuple(StageRecompute(mode, layers) for mode, layers in doc["recompute"])
        checked = check_received(cfg, tuple(doc["boundaries"]), recompute)
        stage_bytes, copy = doc["stage_bytes"], doc.get("stage_copy_bytes")
        return cls(cfg, checked.spec, checked.boundaries, checked.recompute, checked.schedule,
                   None if stage_bytes is None else tuple(stage_bytes),
                   stage_copy_bytes=None if copy is None else tuple(copy))


def resolve_run(cfg: TrainConfig, *, schedule_named: bool = True, chunks_given: bool = False,
                seq_len_given: bool = True, device: torch.device | None = None,
                notes: tuple[str, ...] = ()) -> RunPlan:
    """Decide ``cfg``'s run once (the module's docstring gives the order). ``schedule_named``: the
    command line or the DeepSpeed config named a schedule (else the planner picks one for our
    engine at pp > 1); ``chunks_given``: ``--chunks`` was given (``--schedule auto`` keeps it);
    ``seq_len_given``: ``--seq-len`` was given (else a model with fewer positions than the default
    trains at its positions, and a line says so);
    ``device``: where ``--precision auto`` is resolved for (default: CUDA when there is one, else
    the CPU). Raises `ConfigError` (one line) for a run that cannot work."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    validate_numbers(cfg)  # before the planner or a schedule sees a size
    spec = find_model(cfg)
    if not seq_len_given and 0 < spec.positions < cfg.batch.seq_len:
        notes = (*notes, f"--seq-len {spec.positions}: the model's positions (the default, {cfg.batch.seq_len}, "
                         "exceeds them)")
        cfg = cfg.replace(seq_len=spec.positions)
    cfg = cfg.replace(precision=resolve_precision(cfg.numerics.precision, device))
    cfg, laid_out = apply_layout(cfg)
    if laid_out is not None:  # the search chose the schedule and its chunks too
        notes, schedule_named, chunks_given = (*notes, laid_out), True, True
    cfg, line, candidate = choose_schedule(cfg, schedule_named, chunks_given)
    notes = (*notes, line) if line else tuple(notes)
    checked = validate(cfg, planned=candidate, spec=spec)
    if candidate is not None and _plans_cut(candidate, checked):
        prediction = candidate
    else:
        prediction = run_plan(cfg, list(checked.boundaries))
    stage_bytes = None if prediction is None else tuple(s.memory_bytes for s in prediction.stages)
    copy = None
    if cfg.checkpoint.async_save and prediction is not None:
        per_param = 4 + optimizer_bytes(cfg.optim.optimizer).state_bytes(cfg.optim.momentum)
        copy = tuple(s.params * per_param for s in prediction.stages)
    return RunPlan(cfg, checked.spec, checked.boundaries, checked.recompute, checked.schedule, stage_bytes,
                   notes, prediction, copy)


def _plans_cut(plan, checked: Checked) -> bool:
    """Whether ``plan`` (a schedule candidate's) planned exactly the run's cut and recomputation."""
    planned = tuple(plan.recompute) or tuple(StageRecompute() for _ in checked.recompute)
    return tuple(plan.boundaries) == checked.boundaries and planned == checked.recompute
