"""Validation during `mpt train`: ``--eval-every N --eval-batches K``.

The held-out split is the last K x dp x microbatches x micro_batch sequences of the shuffled
dataset (`mp_toolkit.data.lm.MicroBatches`'s ``holdout``), which training never reads: the same
sequences on every (pp, tp, dp) layout and on resume. Every evaluation reads the whole split from
its first sequence, K global batches through the engine's `eval_batch` (forward only, the run's
own schedule and layout), so the values of successive evaluations are comparable and a run resumed
from a checkpoint reports what the uninterrupted run reports.
"""

from __future__ import annotations

import math

from mp_toolkit.engine.interface import TrainEngine
from mp_toolkit.run.config import TrainConfig


def evaluates_at(cfg: TrainConfig, step: int) -> bool:
    """Whether the run evaluates after ``step``: every ``eval_every`` steps and after the last."""
    return cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.steps)


def validation_loss(engine: TrainEngine, data, batches: int) -> float:
    """Mean `eval_batch` loss over the held-out split's first ``batches`` global batches."""
    held_out = data.held_out()
    losses = [engine.eval_batch(held_out) for _ in range(batches)]
    return math.fsum(losses) / len(losses)


def validation_row(loss: float) -> dict:
    """The metrics row's validation fields: loss and perplexity (exp of the mean token loss)."""
    return {"val_loss": loss, "val_ppl": math.exp(loss) if loss < 700 else math.inf}
