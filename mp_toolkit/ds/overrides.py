"""The CLI's DeepSpeed rules: a ``--config`` / ``--deepspeed_config`` file's settings under the flags
given on the command line (flags win), what a flag given drops from the file (another optimizer's
coefficients, the scheduler block), and the file's key named when one of its values fails a check.

    given = {"steps": 50, "lr": 1e-3}                      # the flags the command line set
    from_file, notes = ds_overrides(Path("ds_config.json"), given, world_size=8)
    cfg = merge(given, from_file)
"""

from __future__ import annotations

from pathlib import Path

from mp_toolkit.ds.config import read_ds_config
from mp_toolkit.names import stages_per_rank
from mp_toolkit.run.config import ConfigError, Parallel, TrainConfig
from mp_toolkit.user_files import parse_json, read_config_text

_FLAG_NAMES = {"timeout_s": "--timeout", "hang_timeout_s": "--hang-timeout", "progress": "--no-progress",
               "bias_correction": "--no-bias-correction"}
_SCHEDULE_FIELDS = ("lr", "warmup_steps", "lr_decay", "min_lr")
_OPTIMIZER_FIELDS = ("betas", "eps", "min_trust", "max_trust", "bias_correction", "momentum", "trust_coefficient",
                     "lamb_rule")
# The DeepSpeed key each TrainConfig field comes from, to name it when its value fails a check.
_DS_KEYS = {"pp": "pipeline.stages", "partition": "pipeline.partition_method", "schedule": "pipeline.schedule",
            "chunks": "pipeline.chunks", "zero": "zero_optimization.stage",
            "micro_batch": "train_micro_batch_size_per_gpu",
            "microbatches": "gradient_accumulation_steps", "clip_grad": "gradient_clipping",
            "lr": "optimizer.params.lr (or scheduler.params)", "weight_decay": "optimizer.params.weight_decay",
            "eps": "optimizer.params.eps", "betas": "optimizer.params.betas", "min_trust": "optimizer.params.min_coeff",
            "max_trust": "optimizer.params.max_coeff", "momentum": "optimizer.params.momentum",
            "trust_coefficient": "optimizer.params.trust_coefficient", "min_lr": "scheduler.params",
            "warmup_steps": "scheduler.params.warmup_num_steps", "loss_scale": "fp16.loss_scale",
            "min_loss_scale": "fp16.min_loss_scale", "hysteresis": "fp16.hysteresis",
            "loss_scale_window": "fp16.loss_scale_window", "initial_scale_power": "fp16.initial_scale_power",
            "recompute": "pipeline.activation_checkpoint_interval"}


def flag_name(field: str) -> str:
    """The `mpt train` flag of a TrainConfig field."""
    return _FLAG_NAMES.get(field, "--" + field.replace("_", "-"))


def merge(given: dict, from_file: dict) -> TrainConfig:
    """TrainConfig's defaults, then the DeepSpeed config's values (``from_file``), then the flags given
    (both by flat field name, `mp_toolkit.run.config.SECTION_OF`)."""
    if "model" in given and "hf" in given:
        raise ConfigError(f"--model {given['model']} and --hf {given['hf']} both name the model: give one of them")
    merged = {**from_file, **given}
    merged.setdefault("chunks", stages_per_rank(merged.get("schedule", Parallel.schedule)))
    return TrainConfig.of(**merged)


def pipeline_stages(path: Path) -> int | None:
    """``pipeline.stages`` of a DeepSpeed config, peeked before the full read (which needs dp, and so pp)."""
    try:
        doc = parse_json(read_config_text(path, "--config"))
        stages = doc["pipeline"]["stages"]
    except (ValueError, KeyError, TypeError):  # ConfigError is a ValueError
        return None  # read_ds_config reports what is wrong
    return stages if type(stages) is int and stages > 0 else None


def ds_overrides(path: Path, given: dict, world_size: int | None) -> tuple[dict, list[str]]:
    """(the fields the DeepSpeed config at ``path`` sets and no flag in ``given`` overrides, log lines).
    ``world_size`` (a launcher's) gives DeepSpeed's dp = world / (pp x tp) when --dp is not given."""
    dp = given.get("dp")
    if dp is None:
        dp = 1
        if world_size is not None:  # DeepSpeed's data-parallel size: what pp x tp leave of the world
            model_parallel = (given.get("pp") or pipeline_stages(path) or Parallel.pp) * given.get("tp", 1)
            dp = world_size // model_parallel if model_parallel and world_size % model_parallel == 0 else 1
    settings = read_ds_config(path, dp=dp, tp=given.get("tp", Parallel.tp))
    base = {**settings.train_config_overrides(), "dp": dp}
    notes = []
    if "optimizer" in given and given["optimizer"] != base.get("optimizer"):
        for k in _OPTIMIZER_FIELDS:  # the config's Lamb coefficients mean nothing to another optimizer
            base.pop(k, None)
    if given.keys() & set(_SCHEDULE_FIELDS) and base.pop("lr_schedule", None) is not None:
        notes.append(f"{path}: the scheduler block is replaced by warm-up/decay of "
                     f"{', '.join(flag_name(k) for k in _SCHEDULE_FIELDS if k in given)} from the command line")
    overridden = [flag_name(k) for k in sorted(given) if k in base and given[k] != base[k]]
    line = f"{path}: {len(base)} settings from the DeepSpeed config (dp {dp}; "
    line += f"absent keys take the defaults of {settings.defaults})"
    notes.insert(0, line + (f"; overridden on the command line: {', '.join(overridden)}" if overridden else ""))
    if settings.ignored_message():
        notes.append(settings.ignored_message())
    return {k: v for k, v in base.items() if k not in given}, notes


def blame(error: ConfigError, from_file: dict, source) -> ConfigError:
    """A check failed on a value the DeepSpeed config set: name its key too."""
    text = str(error)
    for field in from_file.keys() & _DS_KEYS.keys():
        if text.startswith(flag_name(field) + " "):
            return ConfigError(f"{text} (from {_DS_KEYS[field]} in {source})")
    return error
