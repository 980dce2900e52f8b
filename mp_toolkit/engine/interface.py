"""What the `mpt train` loop and checkpoints need of an engine, written down once.

Two engines implement `TrainEngine`: ours (`mp_toolkit.engine.pipeline.PipelineEngine`) and the
DeepSpeed bridge (`mp_toolkit.engine.deepspeed_bridge.DeepSpeedPipeline`, ``--engine deepspeed``), so the loop,
its metrics rows and the checkpoint code call the same methods whichever trains.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from mp_toolkit.optim.loss_scaler import DynamicLossScaler


@dataclass
class StepStats:
    """What one `train_batch` measured and decided."""

    loss: float
    """Mean loss over the global batch (unscaled)."""
    grad_norm: float
    """Global gradient norm before clipping (nan when the step was skipped)."""
    skipped: bool = False
    """True when inf/nan gradients on any rank made every rank skip the step."""
    loss_scale: float = 1.0
    """The loss scale this batch used."""
    nonfinite: str = ""
    """What was not finite on some rank when skipped: "gradients", "loss" or "loss and gradients"."""


@runtime_checkable
class TrainEngine(Protocol):
    """One rank's engine: its share of the model, an optimizer over fp32 masters, a step per batch."""

    boundaries: list[int]
    """The cut ``[0, b1, ..., n]`` of the unsplit LayerList the engine runs."""
    optimizer: torch.optim.Optimizer
    """Its optimizer; the loop sets the learning rate of every group before each step."""

    def train_batch(self, data_iter: Iterator) -> StepStats:
        """Every micro-batch of one global batch, then one optimizer step (or a skip every rank agrees on)."""

    def eval_batch(self, data_iter: Iterator) -> float:
        """Mean loss of one global batch, forward only, no step."""

    @property
    def scaler(self) -> DynamicLossScaler | None:
        """Our fp16 loss scaler, or None (fp32 / bf16, or an engine that scales the loss itself)."""

    def trust_ratio_stats(self) -> list[dict] | None:
        """Per pipeline rank min / median / max of the last step's trust ratios (LAMB / LARS), or None."""

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's trainable parameters, named as in the unsplit LayerList."""

    def master_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 tensor the optimizer steps for ``p`` (checkpoints save and load these)."""

    def layer_names(self) -> list[str]:
        """The layers this rank holds (a checkpoint's layer files it writes)."""

    def copy_back(self) -> None:
        """Copy the fp32 masters into the model's parameters (after a checkpoint load)."""
