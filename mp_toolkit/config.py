"""Typed configuration of a training run (the CLI fills it; recipes pick values)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

SCHEDULES = ("gpipe", "1f1b")
PARTITION_METHODS = ("uniform", "parameters")


class ConfigError(ValueError):
    """A value that cannot work, with the reason and what would (shown as one line, exit 2)."""


@dataclass(frozen=True)
class TrainConfig:
    """One `mpt train` run."""

    model: str = "gpt-small-cpu"
    """Preset name (gpt-tiny, gpt-small-cpu, gpt2, ...) or a path to a GPT-2 config.json."""
    pp: int = 2
    """Pipeline stages (ranks)."""
    schedule: str = "1f1b"
    """Micro-batch schedule: gpipe or 1f1b."""
    partition: str = "parameters"
    """Stage cut: uniform, parameters, or explicit boundaries such as 0,3,7."""
    microbatches: int = 4
    """Micro-batches per global batch (= gradient accumulation steps)."""
    micro_batch: int = 8
    """Sequences per micro-batch."""
    seq_len: int = 128
    """Tokens per sequence; at most the model's n_positions."""
    steps: int = 100
    """Optimizer steps."""
    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    clip_grad: float | None = 1.0
    """Max global gradient norm over all stages; None disables clipping."""
    seed: int = 1234
    """Seeds model initialisation and data shuffling."""
    data: str = "stdlib"
    """stdlib (this interpreter's standard library sources), synthetic, or a local file/folder."""
    metrics: Path | None = None
    """JSON-lines file with one object per step (written by rank 0)."""
    plot: Path | None = None
    """PNG of the loss curve (written by rank 0)."""
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "mp_toolkit")
    """Where the trained tokenizer is cached."""
    threads: int | None = None
    """torch intra-op threads per rank; None: cores divided by local ranks."""
    timeout_s: float = 300.0
    """Bound on every collective and point-to-point wait."""
    progress: bool = True
    """Show a progress bar on rank 0."""

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches * self.micro_batch * self.seq_len


def parse_boundaries(text: str) -> list[int] | None:
    """``"0,3,7"`` -> [0, 3, 7]; a method name -> None."""
    if text in PARTITION_METHODS:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"--partition {text!r} is neither a method ({', '.join(PARTITION_METHODS)}) nor boundaries like 0,3,7"
        ) from None
