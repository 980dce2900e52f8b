"""Typed configuration of a training run (the CLI fills it; recipes pick values): `TrainConfig`, a
few top-level fields and one frozen section per concern, each field with its docstring.

=================  ===============  ==========================================================================
``cfg.``           section          its fields (each also a flat name: ``--pp``, ``"pp"``)
=================  ===============  ==========================================================================
``parallel``       `Parallel`       pp, tp, dp, dp_bucket_mb, zero, schedule, chunks, partition
``batch``          `Batch`          microbatches, micro_batch, seq_len, length_buckets
``optim``          `Optim`          optimizer, lr, weight_decay, betas, eps, ..., lr_schedule, clip_grad
``numerics``       `Numerics`       precision and the fp16 loss scale (loss_scale, hysteresis, ...)
``recomputation``  `Recomputation`  recompute, recompute_layers, memory_gb
``checkpoint``     `Checkpoint`     save_dir, save_every, keep, overwrite, resume
``faults``         `Faults`         timeout_s, hang_timeout_s, restarts, max_skips
``logging``        `Logging`        eval_every, eval_batches, metrics, plot, tensorboard, csv, wandb, progress
``dataset``        `Dataset`        data, tokenizer, cache_dir, data_changed_ok
=================  ===============  ==========================================================================

The optimizer (`mp_toolkit.optim.factory.build_optimizer`) takes ``cfg.optim``, the loss scaler and
DeepSpeed's engine ``cfg.numerics``: the sections are passed, not copied. At the edges a setting keeps
its flat name: the flags (``--lr``), a DeepSpeed config's overrides, a checkpoint's recorded config, so
`SECTION_OF` (derived from the sections' fields) maps each flat name to its section, and
`TrainConfig.of` / `TrainConfig.replace` / `TrainConfig.flat` take and give flat names.

Imports no torch: `mp_toolkit.cli_args` reads the defaults and the field docstrings for ``mpt train --help``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from mp_toolkit.errors import ConfigError
from mp_toolkit.flag_values import with_seq_len
from mp_toolkit.names import LR_DECAYS, OPTIMIZERS, SCHEDULES
from mp_toolkit.names import PRECISIONS as COMPUTE_PRECISIONS
from mp_toolkit.optim.loss_scaler import Numerics
from mp_toolkit.optim.settings import Optim

__all__ = ["ENGINES", "LR_DECAYS", "OPTIMIZERS", "PARTITION_METHODS", "PRECISIONS", "SCHEDULES", "SECTIONS",
           "SECTION_OF", "Batch", "Checkpoint", "ConfigError", "Dataset", "Faults", "Logging", "Numerics", "Optim",
           "Parallel", "Recomputation", "TrainConfig", "parse_boundaries"]

# "auto": bf16 where it is fast, else fp32 (`optim.master.resolve_precision`)
PRECISIONS = (*COMPUTE_PRECISIONS, "auto")
PARTITION_METHODS = ("flops", "parameters", "uniform", "time")
ENGINES = ("mp_toolkit", "deepspeed")


@dataclass(frozen=True)
class Parallel:
    """The pp x tp x dp grid of ranks, the pipeline schedule and the stage cut."""

    pp: int = 2
    """Pipeline stages (ranks along the slowest grid axis)."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split every layer (Megatron's TP_PLAN); must divide the
    model's heads, hidden size, MLP size and vocabulary. The world is pp x tp x dp ranks."""
    dp: int = 1
    """Data-parallel replicas: each trains on its own micro-batches, gradients are averaged."""
    elastic: tuple[int, int] | None = None
    """(MIN, MAX) data-parallel replicas: under a launcher (torchrun ``--nnodes MIN:MAX``) dp is what pp x
    tp x cp leave of the world, within these bounds, and the micro-batches per replica follow from
    global_batch (`mp_toolkit.run.elastic`); None: dp as given."""
    cp: int = 1
    """Context-parallel degree: ranks that split every sequence (zig-zag, ring attention,
    `mp_toolkit.parallel.context_parallel`; model_zoo's GPT, HF's Llama family). The world is
    pp x tp x cp x dp ranks."""
    cp_attention: str = "ring"
    """How context-parallel ranks attend: ring (key and value slices around the ring) or ulysses
    (all-to-all: the heads split over the cp ranks for the whole sequence; cp must divide the heads)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1): between the tensor-parallel regions (norms,
    dropouts, residuals, the messages between stages) each tp rank holds seq / tp of every sequence;
    all-gathers and reduce-scatters replace the all-reduces (`mp_toolkit.parallel.sequence_parallel`)."""
    dp_bucket_mb: float = 25.0
    """Data-parallel gradient buckets: MiB of fp32 gradients per all-reduce (DDP's bucket_cap_mb)."""
    zero: int = 0
    """ZeRO stage: 0 (off) or 1 (fp32 masters and optimizer state partitioned over each stage's
    data-parallel replicas; DeepSpeed's zero_optimization.stage 1; `mp_toolkit.engine.zero`)."""
    schedule: str = "1f1b"
    """Micro-batch schedule: gpipe, 1f1b, interleaved (1F1B with model chunks), zbh1 (zero bubble), zbdrain
    (1F1B whose drain runs deferred weight gradients, `mp_toolkit.schedule.zero_bubble`), zbv or dualpipev
    (two stages per rank in a V, `mp_toolkit.schedule.vshape`)."""
    chunks: int = 1
    """Stages per rank: model chunks of the interleaved schedule (its stages = pp x chunks), 2 for the V
    schedules (`mp_toolkit.names.stages_per_rank`)."""
    partition: str = "flops"
    """Stage cut: flops (balance forward + backward FLOPs of the cost model, as ``mpt plan --method
    flops``), parameters, uniform, time (layers timed on rank 0, the cut broadcast), or explicit
    boundaries such as 0,3,7."""

    cluster: str | None = None
    """Device and cluster profile (a JSON / YAML file, or a shipped name: h100-sxm, h200-sxm, a100-sxm-80gb,
    l4; ``mpt plan --profile-here OUT`` measures one) that every planner decision takes: the default
    schedule, ``--schedule auto``, ``--recompute auto`` and ``--layout``. Default: the profile of this
    device kind (`run.predict.run_profile`)."""
    layout: str | None = None
    """The run's layout from the planner's search (``mpt plan --search``): ``auto`` searches pp, tp, dp,
    micro-batch size and count, schedule, recomputation and ZeRO over this run's world (pp x tp x dp as
    given) for ``--global-batch``; ``FILE[:K]`` takes the K-th layout (default the first) of a
    ``mpt plan --search --json`` output, and its profile."""

    @property
    def world_size(self) -> int:
        """Ranks the run needs: pp x tp x cp x dp."""
        return self.pp * self.tp * self.cp * self.dp


@dataclass(frozen=True)
class Batch:
    """One replica's share of a global batch: micro-batches, their sequences and lengths."""

    microbatches: int = 4
    """Micro-batches per global batch on each data-parallel replica (= gradient accumulation
    steps); the global batch is dp x microbatches x micro_batch sequences."""
    micro_batch: int = 8
    """Sequences per micro-batch."""
    seq_len: int = 128
    """Tokens per sequence; at most the model's n_positions. A resumed run may change it (the model's
    positions allowing): the pipeline agrees the new shapes (`mp_toolkit.engine.shapes`)."""
    global_batch: int | None = None
    """Sequences per step over all replicas that ``--layout auto`` searches a layout for, or that
    ``--elastic`` keeps whatever dp the launcher's world makes."""
    length_buckets: tuple[int, ...] = ()
    """Sequence lengths micro-batches are cut to, each at most seq_len (seq_len is always one):
    padded data (BERT) to the smallest bucket holding the longest pair, packed data (GPT) to a
    bucket drawn from (seed, epoch, row) (`mp_toolkit.data.buckets`); (): every micro-batch seq_len."""

    @property
    def bucket_lengths(self) -> tuple[int, ...]:
        """The lengths micro-batches are cut to: length_buckets and seq_len (checked by `run.checks`);
        () without --length-buckets."""
        return with_seq_len(self.length_buckets, self.seq_len)


@dataclass(frozen=True)
class Recomputation:
    """Activation recomputation, and the memory cap it may be planned for."""

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


@dataclass(frozen=True)
class Checkpoint:
    """Where and how often checkpoints are written, and which one a run resumes from."""

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
    async_save: bool = False
    """Write checkpoints in the background: the step after a save starts once this rank's share is
    copied to host memory (`mp_toolkit.run.async_save`); the files, the manifest and ``latest`` follow
    as in a synchronous save, a second save waits for the first, and a failed background write stops
    the run at the next save or at the end."""


@dataclass(frozen=True)
class Faults:
    """Bounds on waits, hung ranks, restarts and non-finite steps."""

    timeout_s: float = 300.0
    """Bound on every collective and point-to-point wait."""
    hang_timeout_s: float = 60.0
    """Heartbeats (`run.watchdog`): a rank whose heartbeat stops for this long, or whose step stops
    moving for longer than its limit (this, 5x for the first step, 4x the longest step), is named as
    hung and every rank stops (exit 4); 0 turns heartbeats off (--timeout still bounds every wait)."""
    restarts: int = 0
    """When mpt starts the ranks itself: start them again up to this many times after a rank dies,
    resuming from save_dir's latest checkpoint (needs save_dir and save_every). Under torchrun use
    its --max-restarts with resume "auto"."""
    max_skips: int = 20
    """Stop (exit 3) after this many consecutive skipped steps whose gradients or loss were not finite
    (fp32 / bf16; fp16 once the loss scale is at min_loss_scale or static). No checkpoint is written
    at such a step, so the last good one stays the latest."""
    check_replicas: int = 0
    """Every this many steps the data-parallel replicas (and cp slices) of each stage compare a hash of
    every parameter, fp32 master and optimizer-state tensor (`mp_toolkit.run.replicas`); a mismatch names
    the step, stage, tensor and replica, saves nothing and stops every rank (exit 6). 0: off."""
    spike_rewind: tuple[float, int, int] | None = None
    """(Z, K, R): a step whose loss is more than Z standard deviations above the last steps' (or a run of
    max_skips non-finite steps) rewinds to the latest checkpoint and skips the next K global batches,
    at most R times (`mp_toolkit.run.spikes`); None: off."""


@dataclass(frozen=True)
class Logging:
    """Evaluation on held-out data, and what rank 0 writes and shows of each step."""

    eval_every: int = 0
    """Evaluate on the held-out split every this many steps and after the last (0: no validation,
    and nothing is held out)."""
    eval_batches: int = 2
    """Global batches of the held-out split per evaluation; the split holds exactly these
    (eval_batches x dp x microbatches x micro_batch sequences, the same ones on every layout)."""
    metrics: Path | None = None
    """JSON-lines file with one object per step (written by rank 0)."""
    plot: Path | None = None
    """PNG of the loss curve (written by rank 0)."""
    tensorboard: Path | None = None
    """Directory for TensorBoard event files of the per-step scalars (rank 0; `mp_toolkit.run.loggers`)."""
    csv: Path | None = None
    """CSV file of the per-step scalars, one row per step (rank 0)."""
    wandb: str | None = None
    """Weights & Biases project logged to offline (from a DeepSpeed config's ``wandb`` section); None: off."""
    progress: bool = True
    """Show a progress bar on rank 0."""


@dataclass(frozen=True)
class Dataset:
    """The data trained on, its tokenizer, and where what is prepared from it is cached (`mp_toolkit.data.feed`)."""

    data: str = "stdlib"
    """A prepared directory (mpt data prepare) or Megatron prefix, a blend of them (0.7:DIR_A,0.3:DIR_B), a
    local text / JSON-lines file or folder (prepared into --cache-dir on first use), stdlib (this
    interpreter's standard library sources) or synthetic."""
    tokenizer: Path | None = None
    """A HF tokenizer directory or tokenizer.json to prepare unprepared --data with (its vocabulary must fit
    the model's); None: a prepared corpus's own, else a byte-level BPE trained with the model's vocab_size."""
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "mp_toolkit")
    """Where unprepared --data is prepared, and sample indices of read-only corpora are kept."""
    data_changed_ok: bool = False
    """Resume on data other than the checkpoint's (another manifest digest): the saved sample count then
    continues in the new data's order."""


@dataclass(frozen=True)
class TrainConfig:
    """One `mpt train` run: the model, the engine, steps, seed and threads, and one section per concern
    (the module docstring lists them). Build it from flat names with `of`, change it with `replace`."""

    model: str = "gpt-small-cpu"
    """Preset name (gpt-tiny, gpt-small-cpu, gpt2, ..., bert-tiny, bert-base, bert-large) or a path
    to a GPT-2 or BERT config.json (``"model_type": "bert"`` selects BERT pre-training: MLM + NSP)."""
    hf: str | None = None
    """A local HuggingFace save_pretrained directory (config.json + model.safetensors, optionally
    tokenizer.json) of a GPT-2, BERT, Llama, Mistral or Qwen2 model, trained from its weights instead
    of ``model`` (`mp_toolkit.run.hf_family`); None: ``model``."""
    engine: str = "mp_toolkit"
    """Which pipeline engine trains: mp_toolkit (ours: every schedule, tp, checkpoints) or deepspeed
    (DeepSpeed's PipelineEngine with our cut and optimizer, 1F1B, pp x dp only;
    `mp_toolkit.engine.deepspeed_bridge`)."""
    steps: int = 100
    """Optimizer steps."""
    seed: int = 1234
    """Seeds model initialisation and data shuffling."""
    threads: int | None = None
    """torch intra-op threads per rank; None: cores divided by local ranks."""
    parallel: Parallel = field(default_factory=Parallel)
    """The grid, the schedule and the cut."""
    batch: Batch = field(default_factory=Batch)
    """Micro-batches and sequence lengths."""
    optim: Optim = field(default_factory=Optim)
    """The optimizer, its learning-rate schedule and clipping."""
    numerics: Numerics = field(default_factory=Numerics)
    """Precision and the fp16 loss scale."""
    recomputation: Recomputation = field(default_factory=Recomputation)
    """Activation recomputation."""
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    """Saving and resuming."""
    faults: Faults = field(default_factory=Faults)
    """Timeouts, hangs, restarts, skipped steps."""
    logging: Logging = field(default_factory=Logging)
    """Evaluation, metrics and loggers."""
    dataset: Dataset = field(default_factory=Dataset)
    """The data and the tokenizer cache."""

    @classmethod
    def of(cls, **settings) -> TrainConfig:
        """The defaults with ``settings`` made, by flat name: ``TrainConfig.of(model="gpt-tiny", pp=4, lr=1e-2)``."""
        return cls().replace(**settings)

    def replace(self, **changes) -> TrainConfig:
        """A copy with ``changes``: flat names (``lr=1e-2``, put into its section by `SECTION_OF`),
        top-level fields, or whole sections (``parallel=Parallel(pp=4)``, before its flat names)."""
        top: dict[str, object] = {}
        by_section: dict[str, dict[str, object]] = {}
        for name, value in changes.items():
            section = SECTION_OF.get(name)
            if section is None:  # a top-level field or a whole section (an unknown name: dataclasses says so)
                top[name] = value
            else:
                by_section.setdefault(section, {})[name] = value
        sections = {s: dataclasses.replace(top.get(s, getattr(self, s)), **kw) for s, kw in by_section.items()}
        return dataclasses.replace(self, **{**top, **sections})

    def flat(self) -> dict[str, object]:
        """Every setting by its flat name, top-level fields first, then each section's (what a
        checkpoint's manifest records and a resumed run compares)."""
        out: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in SECTIONS:
                out.update((g.name, getattr(value, g.name)) for g in dataclasses.fields(value))
            else:
                out[f.name] = value
        return out

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one global batch, over every data-parallel replica."""
        return self.parallel.dp * self.batch.microbatches * self.batch.micro_batch * self.batch.seq_len

    @property
    def held_out_sequences(self) -> int:
        """Sequences of the validation split (0 without --eval-every)."""
        if not self.logging.eval_every:
            return 0
        return self.logging.eval_batches * self.parallel.dp * self.batch.microbatches * self.batch.micro_batch


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)
                             if dataclasses.is_dataclass(f.default_factory)}
"""TrainConfig's sections by attribute: ``{"parallel": Parallel, "batch": Batch, ...}``."""
SECTION_OF: dict[str, str | None] = {
    **{f.name: None for f in dataclasses.fields(TrainConfig) if f.name not in SECTIONS},
    **{g.name: name for name, kind in SECTIONS.items() for g in dataclasses.fields(kind)}}
"""Each flat name (a flag's dest, a DeepSpeed override's key, a manifest's key) -> the attribute of the
section holding it, or None for a top-level field: the one table, derived from the sections' fields."""


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
