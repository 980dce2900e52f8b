"""``--engine``: which pipeline engine trains a run, what DeepSpeed's cannot do, and DeepSpeed's
engine (`mp_toolkit.engine.deepspeed_bridge`) handed the run's settings. Ours is composed by
`mp_toolkit.run.compose.build_engine`."""
from __future__ import annotations

from collections.abc import Callable

from mp_toolkit.engine.deepspeed_bridge import DeepSpeedPipeline, check_precision, fp16_available
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.factory import build_optimizer
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.run.config import ENGINES, ConfigError, TrainConfig


def check_engine(cfg: TrainConfig) -> None:
    """ConfigError (one line) for a run ``cfg.engine`` cannot do; imports no DeepSpeed."""
    if cfg.engine not in ENGINES:
        raise ConfigError(f"--engine {cfg.engine!r} is unknown: choose one of {', '.join(ENGINES)}")
    if cfg.engine != "deepspeed":
        return
    other, par, ck = "or --engine mp_toolkit", cfg.parallel, cfg.checkpoint
    if par.tp != 1:
        raise ConfigError(f"--tp {par.tp} with --engine deepspeed: its PipelineModule is run without tensor "
                          f"parallelism here; use --tp 1 {other}")
    if par.zero:
        raise ConfigError(f"--zero {par.zero} with --engine deepspeed: ZeRO is mp_toolkit's own here (DeepSpeed's "
                          f"pipeline engine takes stage 0 or 1 of its own); use --zero 0 {other}")
    if par.schedule != "1f1b":
        raise ConfigError(f"--schedule {par.schedule} with --engine deepspeed: DeepSpeed's pipeline engine runs "
                          f"its own 1F1B only; use --schedule 1f1b {other}")
    if ck.save_dir is not None or ck.resume is not None:
        flag = "--save-dir" if ck.save_dir is not None else "--resume"
        raise ConfigError(f"{flag} with --engine deepspeed: checkpoints are not written or read by this engine; "
                          f"drop {flag} {other}")
    check_precision(cfg.numerics.precision, cfg.optim.optimizer)
    if cfg.numerics.precision == "fp16" and not fp16_available():
        raise ConfigError("--precision fp16 with --engine deepspeed: DeepSpeed's CPU accelerator runs fp16 only where "
                          f"oneDNN has fp16 kernels, not on this CPU; use --precision fp32 or bf16 {other}")


def deepspeed_pipeline(cfg: TrainConfig, ctx: ParallelContext, layers: LayerList, boundaries: list[int],
                       loss_fn: Callable) -> DeepSpeedPipeline:
    """DeepSpeed's engine for this rank over the unsplit ``layers`` cut at ``boundaries``, with the run's
    batch, optimizer (the client optimizer `build_optimizer` makes of the optimizer section), clipping,
    precision and loss scale (the numerics section)."""
    batch, optim = cfg.batch, cfg.optim
    return DeepSpeedPipeline(
        layers, ctx, boundaries, batch.microbatches, optimizer=lambda named: build_optimizer(optim, named),
        loss_fn=loss_fn, micro_batch=batch.micro_batch, precision=cfg.numerics.precision,
        optimizer_name=optim.optimizer, clip_grad=optim.clip_grad, loss_scale=cfg.numerics,
        timeout_s=cfg.faults.timeout_s, dynamic_shape=bool(batch.length_buckets),
    )
