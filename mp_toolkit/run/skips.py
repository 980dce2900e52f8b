"""Non-finite steps: which count toward --max-skips, when a checkpoint waits for a good step, and
the test hook that makes one (RELIABILITY.md)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mp_toolkit.checkpoint import latest_step
from mp_toolkit.engine.pipeline import PipelineEngine
from mp_toolkit.optim.loss_scaler import DynamicLossScaler
from mp_toolkit.run.config import ConfigError, TrainConfig
from mp_toolkit.run.metrics import MetricsLog


class Diverged(Exception):
    """--max-skips consecutive steps were skipped for non-finite values (every rank raises it; exit 3)."""


@contextmanager
def injected_nonfinite(engine: PipelineEngine, kind: str | None):
    """Test hook (``MPT_FAULTS``, `mp_toolkit.run.faults.Faults`): for one step make this rank's gradients
    ("grad": the first parameter's gradient becomes inf) or its loss ("loss": the last stage's output
    times inf) non-finite. Nothing happens when ``kind`` is None."""
    handle = None
    if kind == "grad":
        handle = engine.named_parameters()[0][1].register_hook(lambda g: torch.full_like(g, float("inf")))
    elif kind in ("loss", "spike"):
        last = engine.schedule.num_stages - 1
        if last not in engine.stages:
            raise ConfigError(f"MPT_FAULTS: a non-finite or spiking loss needs the rank of the last stage ({last}), "
                              f"this one holds stages {sorted(engine.stages)}")
        factor = float("inf") if kind == "loss" else 30.0
        scaled = lambda t: t * factor if t.is_floating_point() else t
        handle = engine.stages[last].register_forward_hook(
            lambda module, args, out: tuple(map(scaled, out)) if isinstance(out, tuple) else scaled(out))
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


@dataclass
class SkipStreak:
    """Consecutive skipped steps that count toward --max-skips: every skip in fp32 / bf16; in fp16 only
    those the scaler cannot answer by lowering the scale (a static scale, or one at --min-loss-scale)."""

    limit: int
    count: int = 0
    first: int = 0

    def update(self, step: int, stats, scaler: DynamicLossScaler | None) -> bool:
        """Whether this step counts (and so may not be checkpointed)."""
        counts = stats.skipped and (scaler is None or scaler.static or stats.loss_scale <= scaler.min_loss_scale)
        self.first = step if counts and not self.count else self.first
        self.count = self.count + 1 if counts else 0
        return counts

    def line(self, step: int, stats, cfg: TrainConfig, scaler: DynamicLossScaler | None) -> str:
        what = f"non-finite {stats.nonfinite or 'values'} on some rank"
        if self.count:
            return (f"step {step} skipped on every rank: {what} in {cfg.numerics.precision}; parameters and optimizer "
                    f"state unchanged ({self.count} in a row, --max-skips {self.limit})")
        return (f"step {step} skipped on every rank: fp16 overflow ({what}), "
                f"loss scale {stats.loss_scale:g} -> {scaler.scale:g}")

    def stop_reason(self, cfg: TrainConfig) -> str:
        """Why a --spike-rewind rewinds instead of stopping."""
        return f"{self.count} consecutive steps skipped (--max-skips {self.limit}) in {cfg.numerics.precision}"

    def stop_message(self, step: int, stats, cfg: TrainConfig) -> str:
        save_dir = cfg.checkpoint.save_dir
        latest = latest_step(save_dir) if save_dir is not None else None
        kept = (f"the last good checkpoint is {save_dir / f'step-{latest:08d}'}" if latest is not None
                else "no checkpoint was written")
        return (f"{self.count} consecutive steps skipped (steps {self.first}-{step}): non-finite "
                f"{stats.nonfinite or 'values'} on some rank in {cfg.numerics.precision}; stopping, {kept} (lower "
                f"--lr, check the data, or raise --max-skips above {self.limit})")


@dataclass
class SaveSchedule:
    """Checkpoints every --save-every steps and after the last one, but never at a step that counts
    toward --max-skips: that save waits for the next applied step, so `latest` stays on a good one."""

    cfg: TrainConfig
    deferred: bool = False

    def now(self, step: int, counted: bool, log: MetricsLog) -> bool:
        cfg, every = self.cfg, self.cfg.checkpoint.save_every
        due = cfg.checkpoint.save_dir is not None and (step == cfg.steps or (every and step % every == 0))
        if not (due or self.deferred):
            return False
        if counted and due:
            log.note(f"no checkpoint at step {step}: it was skipped; the next applied step saves")
        self.deferred = counted
        return not counted
