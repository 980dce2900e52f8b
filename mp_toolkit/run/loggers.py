"""Rank 0's scalar loggers beside the metrics JSONL: ``--tensorboard DIR``, ``--csv FILE``, wandb.

Every metrics row becomes the same named scalars for each logger (`scalars_of`):

    train/loss  train/lr  train/grad_norm  train/loss_scale  train/tokens_per_s  train/step_time_s
    train/skipped  val/loss  val/ppl (evaluation steps; BERT: val/mlm_loss  val/nsp_loss
    val/mlm_accuracy)  trust_ratio/stage{s}/{min,median,max}
    (LAMB, LARS)  memory/peak_rank{r}_mib  memory/peak_rss_rank{r}_mib (the last step)

* TensorBoard: `torch.utils.tensorboard.SummaryWriter` event files in DIR (the ``tensorboard``
  package must be installed; `make setup` installs it). A resumed run purges the events after its
  checkpoint's step (``purge_step``), so the curves have no doubled steps.
* CSV: one ``step,tag,value`` line per scalar (long form: the tags vary with the optimizer, the
  stages and the evaluation steps); a resumed run keeps the lines up to its step.
* wandb (a DeepSpeed config's ``wandb`` section): ``wandb.init(mode="offline")`` in ``wandb/`` of
  the working directory; ``wandb sync`` uploads it later. Never online: runs here have no network.

The DeepSpeed config's ``tensorboard`` and ``csv_monitor`` sections set DIR and FILE
(`mp_toolkit.ds.config`).
"""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

from mp_toolkit.run.config import ConfigError, TrainConfig
from mp_toolkit.user_files import check_output_file, special_kind, writing

TRAIN_KEYS = ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "step_time_s", "skipped")
VAL_KEYS = ("val_loss", "val_ppl", "val_mlm_loss", "val_nsp_loss", "val_mlm_accuracy")


def scalars_of(row: dict) -> dict[str, float]:
    """The named scalars of one metrics row (module docstring)."""
    out = {f"train/{k}": float(row[k]) for k in TRAIN_KEYS if k in row}
    out.update({f"val/{k[4:]}": row[k] for k in VAL_KEYS if k in row})
    for t in row.get("trust_ratio", []):
        out.update({f"trust_ratio/stage{t['stage']}/{k}": t[k] for k in ("min", "median", "max")})
    for key, name in (("peak_memory_bytes", "peak"), ("peak_rss_bytes", "peak_rss")):
        out.update({f"memory/{name}_rank{r}_mib": b / 2**20 for r, b in enumerate(row.get(key, []))})
    return out


def check_loggers(cfg: TrainConfig) -> None:
    """Before any rank starts: the packages the asked-for loggers need are installed, and no output is a
    directory where a file goes (or a file where TensorBoard's directory goes)."""
    if cfg.logging.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(f"--tensorboard {cfg.logging.tensorboard} needs the tensorboard package: pip install "
                          "tensorboard (make setup installs it)")
    log = cfg.logging
    for flag, path in (("--metrics", log.metrics), ("--csv", log.csv), ("--plot", log.plot)):
        if path is not None:
            check_output_file(flag, path)
    tb = log.tensorboard
    if tb is not None and Path(tb).exists() and not Path(tb).is_dir():
        raise ConfigError(f"--tensorboard {tb} is {special_kind(tb) or 'a file'}: give a directory for its event files")
    if cfg.logging.wandb is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError("wandb.enabled is true but the wandb package is not installed: pip install wandb "
                          "(it logs offline), or set wandb.enabled to false")


class TensorBoardLog:
    def __init__(self, directory: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter  # optional dependency: only --tensorboard runs

        self.directory = directory
        with writing("--tensorboard", directory):
            self.writer = SummaryWriter(log_dir=str(directory), purge_step=start_step + 1 if start_step else None)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        with writing("--tensorboard", self.directory):  # its thread's failed write is raised by the next one
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        with writing("--tensorboard", self.directory):
            self.writer.close()


class CsvLog:
    def __init__(self, path: Path, start_step: int):
        self.path = path
        with writing("--csv", path):
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if start_step > 0 and path.is_file():
                with open(path, newline="") as f:
                    kept = [r for r in list(csv.reader(f))[1:]
                            if len(r) == 3 and r[0].isdigit() and int(r[0]) <= start_step]
            self.file = open(path, "w", newline="")
            self.out = csv.writer(self.file)
            self.out.writerows([("step", "tag", "value"), *kept])

    def write(self, step: int, scalars: dict[str, float]) -> None:
        with writing("--csv", self.path):
            self.out.writerows((step, tag, repr(value)) for tag, value in scalars.items())
            self.file.flush()

    def close(self) -> None:
        with writing("--csv", self.path):
            self.file.close()


class WandbLog:
    def __init__(self, project: str, cfg: TrainConfig):
        import wandb  # optional dependency: only a DeepSpeed config with wandb.enabled

        self.wandb = wandb
        self.run = wandb.init(project=project, mode="offline", config={k: str(v) for k, v in cfg.flat().items()})

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class ScalarLogs:
    """The loggers ``cfg`` asks for, fed every metrics row (rank 0 only)."""

    def __init__(self, cfg: TrainConfig, start_step: int = 0):
        self.logs: list = []
        log = cfg.logging
        if log.tensorboard is not None:
            self.logs.append(TensorBoardLog(log.tensorboard, start_step))
        if log.csv is not None:
            self.logs.append(CsvLog(log.csv, start_step))
        if log.wandb is not None:
            self.logs.append(WandbLog(log.wandb, cfg))

    def write(self, row: dict) -> None:
        if self.logs:
            scalars = scalars_of(row)
            for log in self.logs:
                log.write(row["step"], scalars)

    def close(self) -> None:
        for log in self.logs:
            log.close()
