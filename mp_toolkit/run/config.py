"""Typed configuration of a training run (the CLI fills it; recipes pick values).

Imports no torch: `mp_toolkit.cli_args` reads the defaults and the field docstrings for ``mpt train --help``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mp_toolkit.errors import ConfigError
from mp_toolkit.flag_values import with_seq_len
from mp_toolkit.names import LR_DECAYS, OPTIMIZERS, PRECISIONS as COMPUTE_PRECISIONS, SCHEDULES

if TYPE_CHECKING:  # the field's type only: the command line reads this module without torch
    from mp_toolkit.optim.lr import DeepSpeedSchedule

__all__ = ["ENGINES", "LR_DECAYS", "OPTIMIZERS", "PARTITION_METHODS", "PRECISIONS", "SCHEDULES", "ConfigError",
           "TrainConfig", "parse_boundaries"]

PRECISIONS = (*COMPUTE_PRECISIONS, "auto")  # "auto": bf16 where it is fast, else fp32 (`optim.master.resolve_precision`)
PARTITION_METHODS = ("flops", "parameters", "uniform", "time")
ENGINES = ("mp_toolkit", "deepspeed")


@dataclass(frozen=True)
class TrainConfig:
    """One `mpt train` run."""

    model: str = "gpt-small-cpu"
    """Preset name (gpt-tiny, gpt-small-cpu, gpt2, ..., bert-tiny, bert-base, bert-large) or a path
    to a GPT-2 or BERT config.json (``"model_type": "bert"`` selects BERT pre-training: MLM + NSP)."""
    hf: str | None = None
    """A local HuggingFace save_pretrained directory (config.json + model.safetensors, optionally
    tokenizer.json) of a GPT-2, BERT, Llama, Mistral or Qwen2 model, trained from its weights instead
    of ``model`` (`mp_toolkit.run.hf_family`); None: ``model``."""
    pp: int = 2
    """Pipeline stages (ranks along the slowest grid axis)."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split every layer (Megatron's TP_PLAN); must divide the
    model's heads, hidden size, MLP size and vocabulary. The world is pp x tp x dp ranks."""
    dp: int = 1
    """Data-parallel replicas: each trains on its own micro-batches, gradients are averaged."""
    dp_bucket_mb: float = 25.0
    """Data-parallel gradient buckets: MiB of fp32 gradients per all-reduce (DDP's bucket_cap_mb)."""
    zero: int = 0
    """ZeRO stage: 0 (off) or 1 (fp32 masters and optimizer state partitioned over each stage's
    data-parallel replicas; DeepSpeed's zero_optimization.stage 1; `mp_toolkit.engine.zero`)."""
    engine: str = "mp_toolkit"
    """Which pipeline engine trains: mp_toolkit (ours: every schedule, tp, checkpoints) or deepspeed
    (DeepSpeed's PipelineEngine with our cut and optimizer, 1F1B, pp x dp only; `mp_toolkit.engine.deepspeed_bridge`)."""
    schedule: str = "1f1b"
    """Micro-batch schedule: gpipe, 1f1b, interleaved (1F1B with model chunks), zbh1 (zero bubble) or zbdrain
    (1F1B whose drain runs deferred weight gradients, `mp_toolkit.schedule.zero_bubble`)."""
    chunks: int = 1
    """Model chunks per rank for the interleaved schedule (its stages = pp x chunks)."""
    partition: str = "flops"
    """Stage cut: flops (balance forward + backward FLOPs of the cost model, as ``mpt plan --method
    flops``), parameters, uniform, time (layers timed on rank 0, the cut broadcast), or explicit
    boundaries such as 0,3,7."""
    microbatches: int = 4
    """Micro-batches per global batch on each data-parallel replica (= gradient accumulation
    steps); the global batch is dp x microbatches x micro_batch sequences."""
    micro_batch: int = 8
    """Sequences per micro-batch."""
    seq_len: int = 128
    """Tokens per sequence; at most the model's n_positions. A resumed run may change it (the model's
    positions allowing): the pipeline agrees the new shapes (`mp_toolkit.engine.shapes`)."""
    length_buckets: tuple[int, ...] = ()
    """Sequence lengths micro-batches are cut to, each at most seq_len (seq_len is always one):
    padded data (BERT) to the smallest bucket holding the longest pair, packed data (GPT) to a
    bucket drawn from (seed, epoch, row) (`mp_toolkit.data.buckets`); (): every micro-batch seq_len."""
    steps: int = 100
    """Optimizer steps."""
    optimizer: str = "adamw"
    """adamw, adam, adagrad, rmsprop, sgd, lamb or lars."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Weight decay (decoupled for AdamW, LAMB and LARS; L2 for torch's others)."""
    betas: tuple[float, float] | None = None
    """Adam, AdamW and LAMB moment decay rates (DeepSpeed's optimizer.params.betas); None: (0.9, 0.999)."""
    eps: float | None = None
    """Denominator epsilon of Adam, AdamW, LAMB, LARS, Adagrad, RMSprop; None: each optimizer's own
    default (1e-8, LAMB 1e-6, Adagrad 1e-10)."""
    min_trust: float | None = None
    """LAMB: lower clamp of the trust ratio (DeepSpeed's min_coeff); None: no clamp."""
    max_trust: float | None = None
    """LAMB: upper clamp of the trust ratio (DeepSpeed's max_coeff); None: no clamp."""
    bias_correction: bool = True
    """LAMB: bias-correct the moment estimates (Adam and AdamW always do)."""
    momentum: float | None = None
    """Momentum of SGD and LARS (None: 0.9) and RMSprop (None: 0)."""
    trust_coefficient: float | None = None
    """LARS: the trust coefficient eta of the layer-wise rate; None: 0.001."""
    lamb_rule: str = "mp_toolkit"
    """LAMB's per-tensor rule: mp_toolkit (biases and norm weights neither decayed nor adapted, corrected
    moments) or deepspeed (DeepSpeed's FusedLamb, what a DeepSpeed config's "type": "Lamb" means: every
    tensor's trust ratio clamped, 1-D ones included, the bias correction in the step size)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    lr_decay: str = "none"
    """After warm-up: none (constant), linear or cosine decay to min_lr at the last step."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_schedule: DeepSpeedSchedule | None = None
    """An exact DeepSpeed schedule (WarmupLR, WarmupDecayLR, WarmupCosineLR from a DeepSpeed config)
    that replaces lr / warmup_steps / lr_decay / min_lr; it advances only on applied steps (not on
    steps skipped for fp16 overflow), as DeepSpeed's engine does. None: WarmupDecay of those fields."""
    precision: str = "fp32"
    """fp32, fp16 (fp32 masters, dynamic loss scaling), bf16 (fp32 masters, no scaling), or auto:
    bf16 where this device multiplies bf16 fast (CUDA, AMX / AVX512-BF16 CPUs), else fp32."""
    loss_scale: float = 0.0
    """fp16: a static loss scale when > 0 (DeepSpeed's fp16.loss_scale); 0 means dynamic."""
    initial_scale_power: int = 16
    """fp16 dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """fp16: clean steps before the scale doubles."""
    hysteresis: int = 2
    """fp16: overflows tolerated before the scale halves."""
    consecutive_hysteresis: bool = False
    """fp16: refill the hysteresis on every clean step, not only when the scale grows."""
    min_loss_scale: float = 1.0
    """fp16: the scale never drops below this."""
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
    hang_timeout_s: float = 60.0
    """Heartbeats (`run.watchdog`): a rank whose heartbeat stops for this long, or whose step stops
    moving for longer than its limit (this, 5x for the first step, 4x the longest step), is named as
    hung and every rank stops (exit 4); 0 turns heartbeats off (--timeout still bounds every wait)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    save_dir: Path | None = None
    """Checkpoint root (`mp_toolkit.checkpoint`): layout-independent, resumable on any (pp, tp, dp)."""
    save_every: int = 0
    """Save every this many steps (and after the last step); 0: only after the last step."""
    keep: int | None = 3
    """Checkpoints kept in save_dir (the newest of this run: another run's are never pruned); None keeps every one."""
    overwrite: bool = False
    """Let a fresh run (no resume) save into a save_dir that holds another run's checkpoints."""
    resume: str | None = None
    """Resume from a checkpoint: "latest" or "auto" (save_dir's latest, or a fresh start when it holds
    none: "auto" is the spelling for restart loops such as torchrun --max-restarts), a checkpoint
    root (its latest) or one step directory."""
    restarts: int = 0
    """When mpt starts the ranks itself: start them again up to this many times after a rank dies,
    resuming from save_dir's latest checkpoint (needs save_dir and save_every). Under torchrun use
    its --max-restarts with resume "auto"."""
    max_skips: int = 20
    """Stop (exit 3) after this many consecutive skipped steps whose gradients or loss were not finite
    (fp32 / bf16; fp16 once the loss scale is at min_loss_scale or static). No checkpoint is written
    at such a step, so the last good one stays the latest."""

    eval_every: int = 0
    """Evaluate on the held-out split every this many steps and after the last (0: no validation,
    and nothing is held out)."""
    eval_batches: int = 2
    """Global batches of the held-out split per evaluation; the split holds exactly these
    (eval_batches x dp x microbatches x micro_batch sequences, the same ones on every layout)."""
    tensorboard: Path | None = None
    """Directory for TensorBoard event files of the per-step scalars (rank 0; `mp_toolkit.run.loggers`)."""
    csv: Path | None = None
    """CSV file of the per-step scalars, one row per step (rank 0)."""
    wandb: str | None = None
    """Weights & Biases project logged to offline (from a DeepSpeed config's ``wandb`` section); None: off."""

    @property
    def held_out_sequences(self) -> int:
        """Sequences of the validation split (0 without --eval-every)."""
        return self.eval_batches * self.dp * self.microbatches * self.micro_batch if self.eval_every else 0
    recompute: str = "none"
    """Activation recomputation (`mp_toolkit.recompute`): none; full (a block keeps only its input and
    runs its forward again in its backward); selective (only the attention core is run again;
    model_zoo GPT and BERT); auto (per stage, chosen with the cut by the planner so every rank fits
    memory_gb at the least predicted time, as ``mpt plan --method memory --recompute auto``)."""
    recompute_layers: tuple[int, ...] | None = None
    """full / selective: recompute the first N block layers of every stage (one count) or of each
    stage (one count per stage, pp x chunks of them); None: every block layer."""
    memory_gb: float | None = None
    """Per-rank memory cap (GB) that ``recompute`` auto plans for."""

    @property
    def world_size(self) -> int:
        """Ranks the run needs: pp x tp x dp."""
        return self.pp * self.tp * self.dp

    @property
    def bucket_lengths(self) -> tuple[int, ...]:
        """The lengths micro-batches are cut to: length_buckets and seq_len (checked by `run.checks`);
        () without --length-buckets."""
        return with_seq_len(self.length_buckets, self.seq_len)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one global batch, over every data-parallel replica."""
        return self.dp * self.microbatches * self.micro_batch * self.seq_len


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
