"""The DeepSpeed config sections that switch features on or off rather than set training numbers:
``zero_optimization`` (stage 1 is mp_toolkit's ZeRO-1), the monitors (``tensorboard``,
``csv_monitor``, ``wandb``), ``torch_autocast``, and the keys DeepSpeed itself refuses. Each reader
takes the config's root `Block` and the list of ignored keys `mp_toolkit.ds.config.read_ds_config`
reports; every refusal is a one-line ConfigError naming the key."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from mp_toolkit.ds.defaults import DeepSpeedDefaults
from mp_toolkit.ds.json_doc import Block
from mp_toolkit.run.config import ConfigError


def read_zero(root: Block, ignored: list[str]) -> int:
    """``zero_optimization.stage``: 0 (the block is ignored) or 1 (mp_toolkit's ZeRO-1, its other keys
    ignored); stages 2 and 3 refused."""
    zero = root.get("zero_optimization")
    if zero is None:
        return 0
    block = None if isinstance(zero, bool) else root.block("zero_optimization")
    stage = int(zero) if block is None else block.integer("stage", 0, lowest=0)  # legacy bool: true is stage 1
    if stage > 1:
        raise ConfigError(f"{root.where}: zero_optimization.stage {stage}: mp_toolkit implements ZeRO stage 1 "
                          "(optimizer state partitioned), not gradient or parameter partitioning; set stage 1 or 0")
    if stage == 0 or block is None:
        ignored.append("zero_optimization")
    else:
        block.finish(ignored, known=frozenset(block.data) - {"stage"})
    return stage


def refuse_autocast(root: Block, ignored: list[str]) -> None:
    """torch autocast: accepted only when off, then listed as ignored."""
    autocast = root.block("torch_autocast")
    if autocast is not None:
        if autocast.boolean("enabled", False):
            raise ConfigError(f"{root.where}: torch_autocast.enabled is not supported by mp_toolkit: "
                              "use fp16.enabled or bf16.enabled")
        ignored.append("torch_autocast")


def read_monitors(root: Block, ignored: list[str]) -> dict[str, Any]:
    """DeepSpeed's monitor sections, when enabled, as TrainConfig fields: ``tensorboard`` ->
    ``tensorboard`` = output_path/job_name (DeepSpeed's SummaryWriter directory); ``csv_monitor`` ->
    ``csv`` = output_path/job_name/metrics.csv (one long-form file where DeepSpeed writes one per
    metric); ``wandb`` -> ``wandb`` = its project, logged offline (`mp_toolkit.run.loggers`, which
    refuses it in one line when the package is missing)."""
    out: dict[str, Any] = {}
    for key, field, leaf in (("tensorboard", "tensorboard", None), ("csv_monitor", "csv", "metrics.csv")):
        block = root.block(key)
        if block is not None and block.boolean("enabled", False):
            where = Path(block.string("output_path", "") or ".") / block.string("job_name", "DeepSpeedJobName")
            out[field] = where / leaf if leaf else where
        if block is not None:
            block.finish(ignored, known=("output_path", "job_name"))
    wandb = root.block("wandb")
    if wandb is not None:
        if wandb.boolean("enabled", False):
            out["wandb"] = wandb.string("project", "deepspeed")
        wandb.finish(ignored, known=("group", "team", "project"))
    return out


def refuse_removed(root: Block, ds: DeepSpeedDefaults) -> None:
    """The keys DeepSpeed refuses (features it removed), all named in one line."""
    found = [k for k in ds.removed_top if k in root.data]
    zero = root.data.get("zero_optimization")
    if isinstance(zero, dict):
        found += [f"zero_optimization.{k}" for k in ds.removed_zero if k in zero]
    if found:
        raise ConfigError(f"{root.where}: {', '.join(found)}: {'is a key' if len(found) == 1 else 'are keys'} "
                          f"DeepSpeed {ds.version} refuses (the feature was removed from DeepSpeed): remove "
                          f"{'it' if len(found) == 1 else 'them'}")
