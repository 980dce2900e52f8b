"""Read a DeepSpeed JSON config into typed settings::

    settings = read_ds_config("ds_config.json", dp=2)
    cfg = TrainConfig.of(**settings.train_config_overrides())
    if settings.ignored:
        print(settings.ignored_message())

A value means what it means to DeepSpeed: an absent key takes the installed DeepSpeed's default, or
0.19.x's documented one without DeepSpeed (`mp_toolkit.ds.defaults`; ``DeepSpeedSettings.defaults``
names which, and ``mpt train`` prints it first): no ``gradient_clipping`` is clipping at 1.0 (0 turns it
off), ``Lamb`` clamps its trust ratio to [0.01, 10], ``Adam`` is AdamW unless ``adam_w_mode`` is false;
and train_batch_size = micro-batch x accumulation steps x dp. ``"type": "Lamb"`` trains with DeepSpeed's
FusedLamb rule (``lamb_rule="deepspeed"``, `mp_toolkit.optim.lamb`): every tensor's trust ratio is
clamped, biases and norm weights included.

Understood: the batch keys, ``gradient_clipping``, ``fp16``, ``bf16`` (or the legacy ``bfloat16``),
``optimizer`` (Adam, AdamW, Lamb; Lars is mp_toolkit's own), ``scheduler`` (WarmupLR, WarmupDecayLR,
WarmupCosineLR), ``pipeline.stages`` / ``pipeline.partition_method`` (PipelineModule's argument),
``pipeline.activation_checkpoint_interval`` / ``activation_checkpointing`` (`mp_toolkit.ds.recompute`) and
the monitors ``tensorboard``, ``csv_monitor`` and ``wandb`` (`mp_toolkit.ds.sections.read_monitors`).
mp_toolkit's extensions, which DeepSpeed's reader tolerates: ``pipeline.schedule``, ``pipeline.chunks``
and explicit boundaries ("0,3,7") as ``partition_method``. Understood but unused keys (logging,
profiling, ZeRO stage 0, ...) are listed in ``ignored``. Unknown keys fail where DeepSpeed fails
(inside ``fp16``, ``bf16``, ``optimizer.params``, ``scheduler.params``: DeepSpeed validates those or
passes them to a constructor) and elsewhere, where DeepSpeed tolerates them, are listed in ``ignored``
as "(unknown)". ``zero_optimization.stage`` 1 is mp_toolkit's ZeRO-1 (TrainConfig.parallel.zero); stages 2 and 3,
torch autocast, options mp_toolkit cannot honour and every wrong
type or range are a ConfigError: one line naming the dotted key and the file; so are the keys DeepSpeed
itself refuses (``sparse_attention``, ``amp``, ``elasticity``, ...: features removed from DeepSpeed),
all of them named in the one line. A JSON null counts as
absent. Files are strict JSON without duplicate keys (DeepSpeed's base64 form is not read).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mp_toolkit.ds.defaults import DeepSpeedDefaults, deepspeed_defaults
from mp_toolkit.ds.json_doc import Block, load_json, show
from mp_toolkit.ds.optimizer import OptimizerSettings, read_optimizer, read_scheduler
from mp_toolkit.ds.recompute import read_recompute
from mp_toolkit.ds.sections import read_monitors, read_zero, refuse_autocast, refuse_removed
from mp_toolkit.names import schedule_name
from mp_toolkit.optim.loss_scaler import LOSS_SCALE_FIELDS, Numerics
from mp_toolkit.optim.lr import DeepSpeedSchedule, WarmupCosineLR, WarmupDecayLR
from mp_toolkit.run.config import SCHEDULES, SECTION_OF, ConfigError

_IGNORED_TOP = frozenset("""steps_per_print wall_clock_breakdown memory_breakdown dump_state disable_python_gc
    disable_allgather communication_data_type seq_parallel_communication_data_type prescale_gradients
    gradient_predivide_factor gradient_allreduce_op zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
    activation_checkpointing flops_profiler tensorboard wandb csv_monitor comet comms_logger autotuning checkpoint
    data_types dataloader_drop_last aio log_level timers compile data_efficiency hybrid_engine weight_quantization
    tensor_parallel expert_parallel use_data_before_expert_parallelism managed_gradient_accumulation
    sequence_parallel_size vocabulary_size""".split())
_IGNORED_PIPELINE = ("partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned",
                     "grad_partitioned", "use_reentrant")
_TRAIN_FIELDS = frozenset(SECTION_OF)  # TrainConfig's flat field names


# DeepSpeed's ``fp16`` block (its defaults where a key is absent): ``enabled`` (fp16 training with fp32
# master weights), then the six loss-scale fields of `Numerics` (`LOSS_SCALE_FIELDS`), in its order and
# with its defaults and meanings (built from it, so the six are declared once).
FP16Settings = dataclasses.make_dataclass(
    "FP16Settings", [("enabled", bool, dataclasses.field(default=False))]
    + [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(Numerics)
       if f.name in LOSS_SCALE_FIELDS],
    frozen=True)
FP16Settings.__module__ = __name__  # pickling and repr name this module, as for a class statement
FP16Settings.__doc__ = "DeepSpeed's ``fp16`` block: ``enabled`` and `Numerics`' six loss-scale fields."


@dataclass(frozen=True)
class DeepSpeedSettings:
    """What mp_toolkit understands of one DeepSpeed config (see the module docstring)."""

    source: str
    """The file it was read from, or "DeepSpeed config (dict)"."""
    dp: int
    """Data-parallel degree the batch arithmetic used (DeepSpeed's world size)."""
    train_batch_size: int
    """Sequences per optimizer step over all data-parallel ranks."""
    train_micro_batch_size_per_gpu: int
    """Sequences per micro-batch (TrainConfig.batch.micro_batch)."""
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step on each rank (TrainConfig.batch.microbatches)."""
    gradient_clipping: float
    """Max global gradient norm; 0 means no clipping; absent is DeepSpeed's default (1.0 since 0.19.3)."""
    precision: str
    """fp16, bf16 or fp32 (neither block enabled)."""
    fp16: FP16Settings
    """The ``fp16`` block (also read when fp16 is off, as DeepSpeed does)."""
    optimizer: OptimizerSettings | None
    """The ``optimizer`` block; None when absent (the program picks the optimizer)."""
    scheduler: DeepSpeedSchedule | None
    """The ``scheduler`` block as an lr(step) schedule; None when absent (constant lr)."""
    pp: int | None
    """``pipeline.stages``; None when absent or "auto"."""
    partition: str | None
    """``pipeline.partition_method`` as TrainConfig.parallel.partition (uniform, parameters, 0,3,7); None when
    absent."""
    schedule: str | None
    """``pipeline.schedule`` (mp_toolkit's extension) as TrainConfig.parallel.schedule; None when absent."""
    chunks: int | None
    """``pipeline.chunks`` (mp_toolkit's extension): model chunks per rank; None when absent."""
    ignored: tuple[str, ...] = ()
    """Dotted keys read but not used, sorted; unknown ones carry " (unknown)"."""
    monitors: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The enabled monitor sections as TrainConfig fields (`mp_toolkit.ds.sections.read_monitors`): tensorboard,
    csv, wandb."""
    defaults: str = ""
    """Whose defaults filled the absent keys: "DeepSpeed 0.19.8" (the installed one), or 0.19.x's documented
    ones ("DeepSpeed 0.19.x (its documented defaults: deepspeed is not installed)"), naming the keys whose
    defaults, and the lists of refused keys, the installed sources did not give (`DeepSpeedDefaults.source`)."""
    recompute: str | None = None
    """``pipeline.activation_checkpoint_interval`` > 0: "full" (`mp_toolkit.ds.recompute`); None when off."""
    zero: int = 0
    """``zero_optimization.stage`` (0 or 1; TrainConfig.parallel.zero)."""

    def _overrides(self) -> dict[str, Any]:
        """Every TrainConfig-style field (by flat name) the file determines, whether TrainConfig has it yet or not."""
        fp = self.fp16
        out: dict[str, Any] = dict(
            micro_batch=self.train_micro_batch_size_per_gpu, microbatches=self.gradient_accumulation_steps,
            clip_grad=self.gradient_clipping or None, precision=self.precision,
            **{name: getattr(fp, name) for name in LOSS_SCALE_FIELDS})
        opt = self.optimizer
        if opt is not None:
            out.update(optimizer=opt.name, lr=opt.lr, weight_decay=opt.weight_decay, eps=opt.eps)
            if opt.betas is not None:
                out["betas"] = opt.betas
            if opt.name == "lamb":  # DeepSpeed's "Lamb" is FusedLamb: its trust rule on every tensor
                out.update(min_trust=opt.min_trust, max_trust=opt.max_trust, bias_correction=opt.bias_correction,
                           lamb_rule="deepspeed")
            if opt.name == "lars":
                out.update(momentum=opt.momentum, trust_coefficient=opt.trust_coefficient)
            if self.scheduler is None:  # DeepSpeed keeps the optimizer's lr constant
                out.update(warmup_steps=0, lr_decay="none")
        s = self.scheduler
        if s is not None:
            # lr_schedule is exact; warmup_steps / lr_decay / min_lr are the nearest WarmupDecay (linear
            # warm-up from lr / warmup_steps, no log warm-up, no two-step offset) until TrainConfig has it.
            out.update(lr=s.peak_lr, lr_schedule=s, warmup_steps=max(2, s.warmup_num_steps))
            if isinstance(s, WarmupCosineLR):
                out.update(lr_decay="cosine", min_lr=s.lr * min(1.0, s.cos_min_ratio))
            elif isinstance(s, WarmupDecayLR):
                out.update(lr_decay="linear", min_lr=min(s.warmup_min_lr, s.warmup_max_lr))
            else:
                out.update(lr_decay="none")
        if self.zero:
            out["zero"] = self.zero
        for name in ("pp", "partition", "schedule", "chunks"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out.update(self.monitors)
        if self.recompute is not None:
            out["recompute"] = self.recompute
        return out

    def train_config_overrides(self) -> dict[str, Any]:
        """The fields of TrainConfig this config sets, by flat name: ``TrainConfig.of(**these)``."""
        return {k: v for k, v in self._overrides().items() if k in _TRAIN_FIELDS}

    def pending_overrides(self) -> dict[str, Any]:
        """What the config sets that TrainConfig has no field for: empty today (every mapped key has
        one); kept so a newer reader can hand over settings before TrainConfig grows them."""
        return {k: v for k, v in self._overrides().items() if k not in _TRAIN_FIELDS}

    def ignored_message(self) -> str | None:
        """One log line listing the ignored keys, or None when there are none."""
        if not self.ignored:
            return None
        return f"{self.source}: keys not used by mp_toolkit: {', '.join(self.ignored)}"


def _batch(root: Block, dp: int) -> tuple[int, int, int]:
    """DeepSpeed's rule: any two of the three batch keys give the third; one alone takes 1 accumulation step."""
    tb = root.integer("train_batch_size", None)
    mb = root.integer("train_micro_batch_size_per_gpu", None)
    ga = root.integer("gradient_accumulation_steps", None)
    if tb is None and mb is None:
        raise ConfigError(f"{root.where}: set train_batch_size or train_micro_batch_size_per_gpu "
                          "(DeepSpeed derives the other batch keys from them)")
    if tb is None:
        ga = 1 if ga is None else ga
        return mb * ga * dp, mb, ga
    if mb is not None and ga is not None:
        if tb != mb * ga * dp:
            raise ConfigError(f"{root.where}: train_batch_size {tb} != train_micro_batch_size_per_gpu {mb} x "
                              f"gradient_accumulation_steps {ga} x dp {dp} = {mb * ga * dp}: "
                              "make them agree or drop one")
        return tb, mb, ga
    if mb is not None:      # accumulation steps derived
        factors = [("train_micro_batch_size_per_gpu", mb), ("dp", dp)]
    elif ga is not None:    # micro-batch derived
        factors = [("gradient_accumulation_steps", ga), ("dp", dp)]
    else:                   # train_batch_size alone: one accumulation step
        factors = [("dp", dp)]
    divisor = math.prod(v for _, v in factors)
    if tb % divisor:
        raise ConfigError(f"{root.where}: train_batch_size {tb} is not divisible by "
                          f"{' x '.join(f'{n} {v}' for n, v in factors)} = {divisor}: use a multiple of {divisor}")
    if mb is not None:
        return tb, mb, tb // divisor
    return tb, tb // divisor, 1 if ga is None else ga


def _fp16(block: Block | None, ignored: list[str], ds: DeepSpeedDefaults) -> FP16Settings:
    d = FP16Settings(**ds.fp16.as_dict())
    if block is None:
        return d
    fp = FP16Settings(
        enabled=block.boolean("enabled", d.enabled), loss_scale=block.number("loss_scale", d.loss_scale),
        initial_scale_power=block.integer("initial_scale_power", d.initial_scale_power, lowest=0),
        loss_scale_window=block.integer("loss_scale_window", d.loss_scale_window),
        hysteresis=block.integer("hysteresis", d.hysteresis),
        min_loss_scale=block.number("min_loss_scale", d.min_loss_scale, positive=True),
        consecutive_hysteresis=block.boolean("consecutive_hysteresis", d.consecutive_hysteresis))
    if not fp.min_loss_scale.is_integer():  # DeepSpeedFP16Config declares it an int
        raise block.fail("min_loss_scale", f"{fp.min_loss_scale:g} must be a whole number (DeepSpeed reads it as an "
                                           "integer, and refuses a fraction): use 1 or more")
    block.finish(ignored, known=("auto_cast", "fp16_master_weights_and_grads"),
                 strict=", ".join(f.name for f in dataclasses.fields(FP16Settings)))
    return fp


def _precision(root: Block, ignored: list[str], ds: DeepSpeedDefaults) -> tuple[str, FP16Settings]:
    if "bf16" in root.data and "bfloat16" in root.data:
        raise root.fail("bfloat16", "and bf16 are both given: keep only bf16 (bfloat16 is its legacy name)")
    fp16 = _fp16(root.block("fp16"), ignored, ds)
    bf16 = root.block("bfloat16" if "bfloat16" in root.data else "bf16")
    bf16_on = False
    if bf16 is not None:
        bf16_on = bf16.boolean("enabled", ds.bf16_enabled)
        bf16.finish(ignored, known=("immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                                    "bf16_optimizer_states"), strict="enabled")
    if fp16.enabled and bf16_on:
        raise ConfigError(f"{root.where}: fp16.enabled and {bf16.path}.enabled are both true: enable one of them")
    return ("fp16" if fp16.enabled else "bf16" if bf16_on else "fp32"), fp16


def _pipeline(root: Block, ignored: list[str]) -> tuple[int | None, str | None, str | None, int | None]:
    block = root.block("pipeline")
    if block is None:
        return None, None, None, None
    stages = None if block.get("stages") == "auto" else block.integer("stages", None)
    partition = block.string("partition_method")
    if partition is not None:
        method = partition.lower()  # DeepSpeed lower-cases the method too
        if method in ("parameters", "uniform"):
            partition = method
        elif all(part.strip().isdigit() for part in partition.split(",")):
            partition = ",".join(part.strip() for part in partition.split(","))
        else:
            raise block.fail("partition_method", f"{show(partition)} is not supported by mp_toolkit: use parameters, "
                                                 "uniform or explicit boundaries such as \"0,3,7\"")
    schedule = block.string("schedule")
    if schedule is not None:
        if schedule_name(schedule) is None:
            raise block.fail("schedule", f"{show(schedule)} is not a schedule: use one of {', '.join(SCHEDULES)}")
        schedule = schedule_name(schedule)
    chunks = block.integer("chunks", None)
    if "micro_batches" in block.data:
        raise block.fail("micro_batches", "is not read: micro-batches per step are gradient_accumulation_steps")
    block.finish(ignored, known=_IGNORED_PIPELINE)
    return stages, partition, schedule, chunks


def read_ds_config(source: str | Path | dict, *, dp: int = 1, tp: int = 1,
                   defaults: DeepSpeedDefaults | None = None) -> DeepSpeedSettings:
    """Read a DeepSpeed config file (or an already loaded dict) for ``dp`` data-parallel ranks and
    ``tp`` tensor-parallel ranks (``--tp``, which a DeepSpeed config does not set).

    Absent keys take ``defaults`` (None: `deepspeed_defaults()`, the installed DeepSpeed's). Raises
    ConfigError, one line naming the key and the file, for anything mp_toolkit cannot run.
    """
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ConfigError(f"dp {dp!r} must be a positive integer (the data-parallel degree)")
    ds = deepspeed_defaults() if defaults is None else defaults
    where, data = load_json(source)
    root = Block(where, "", data)
    refuse_removed(root, ds)
    ignored: list[str] = []
    tb, mb, ga = _batch(root, dp)
    clip = root.number("gradient_clipping", ds.gradient_clipping)
    precision, fp16 = _precision(root, ignored, ds)
    optimizer = read_optimizer(root, ignored, ds)
    if optimizer is not None and optimizer.name == "lamb" and fp16.loss_scale > 0:  # DeepSpeed's engine asserts it
        raise ConfigError(f"{where}: optimizer.type {optimizer.type} with fp16.loss_scale {fp16.loss_scale:g}: "
                          "DeepSpeed's Lamb requires dynamic loss scaling: set fp16.loss_scale to 0")
    scheduler = read_scheduler(root, optimizer, ignored)
    recompute, honoured = read_recompute(root, ignored, tp)
    pp, partition, schedule, chunks = _pipeline(root, ignored)
    zero = read_zero(root, ignored)
    refuse_autocast(root, ignored)
    monitors = read_monitors(root, ignored)
    root.finish(ignored, known=_IGNORED_TOP)
    ignored = [k for k in ignored if k not in honoured]
    return DeepSpeedSettings(
        source=where, dp=dp, train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=ga,
        gradient_clipping=clip, precision=precision, fp16=fp16, optimizer=optimizer, scheduler=scheduler, pp=pp,
        partition=partition, schedule=schedule, chunks=chunks, ignored=tuple(sorted(ignored)), monitors=monitors,
        defaults=ds.source,
        recompute=recompute, zero=zero)
