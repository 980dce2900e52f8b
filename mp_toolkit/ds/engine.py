"""`mpt train --engine deepspeed`: DeepSpeed's own PipelineEngine over our model, cut and optimizer.

DeepSpeed's engine (``deepspeed.pipe.PipelineModule`` + ``deepspeed.initialize``: its 1F1B
TrainSchedule, p2p, tied-weight all-reduce, gradient accumulation and clipping) trains the plain
model our engine trains, cut at the boundaries `mp_toolkit.run.cut.plan_boundaries` computes, with
the optimizer `build_optimizer` makes (LAMB, LARS, AdamW, ...) as DeepSpeed's *client* optimizer.
The loop, the data and the per-step metrics rows stay `mp_toolkit.run.loop`'s: `DeepSpeedPipeline`
implements `mp_toolkit.engine.interface.TrainEngine` as our PipelineEngine does (``train_batch``, ``optimizer``
whose lr the loop sets before every step, ``scaler``, ``trust_ratio_stats``), so the two engines can be compared step
by step (tests/test_ds_engine.py) and a user can move between them::

    mpt train --engine deepspeed --model gpt-tiny --pp 2 --optimizer lamb --partition 0,3,7
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 -m mp_toolkit.cli train --engine deepspeed --pp 2 --dp 2

TrainConfig -> DeepSpeed: micro_batch -> ``train_micro_batch_size_per_gpu``, microbatches ->
``gradient_accumulation_steps``, clip_grad -> ``gradient_clipping`` (the global norm over all
stages: `mp_toolkit.ds.pipe.count_in_norm_once`), precision -> ``bf16`` / ``fp16`` blocks (fp16 with
the loss-scale fields), ZeRO stage 0. The loss is computed on fp32 logits, as our executor does.
DeepSpeed divides each micro-batch loss by the accumulation steps before backward and reports the
mean over micro-batches, exactly as ours (DESIGN.md invariant 5).

Refused with one line (`check_engine`): tp > 1, schedules other than 1f1b (DeepSpeed runs its own
1F1B), checkpoints (--save-dir / --resume), LAMB / LARS under bf16 (DeepSpeed's BF16_Optimizer
flattens each parameter group into one tensor, so a per-layer trust ratio would become one per
group), fp16 where DeepSpeed's accelerator has no fp16. Non-finite steps follow DeepSpeed's rules:
fp16 overflows are skipped (and counted by --max-skips); fp32 / bf16 steps are always applied.
Without --clip-grad under fp32 DeepSpeed computes no norm: grad_norm is then nan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mp_toolkit.engine.interface import StepStats
from mp_toolkit.engine.reductions import trust_ratio_rows
from mp_toolkit.optim.factory import OptimizerOptions, build_optimizer
from mp_toolkit.optim.loss_scaler import LossScaleSettings
from mp_toolkit.optim.master import resolve_precision
from mp_toolkit.layers import LayerList
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.run.config import ENGINES, ConfigError, TrainConfig

_FLATTENED = ("lamb", "lars")  # layer-wise optimizers that DeepSpeed's bf16 flattening would change


def check_engine(cfg: TrainConfig) -> None:
    """ConfigError (one line) for a run ``cfg.engine`` cannot do; imports no DeepSpeed."""
    if cfg.engine not in ENGINES:
        raise ConfigError(f"--engine {cfg.engine!r} is unknown: choose one of {', '.join(ENGINES)}")
    if cfg.engine != "deepspeed":
        return
    other = "or --engine mp_toolkit"
    if cfg.tp != 1:
        raise ConfigError(f"--tp {cfg.tp} with --engine deepspeed: its PipelineModule is run without tensor "
                          f"parallelism here; use --tp 1 {other}")
    if cfg.zero:
        raise ConfigError(f"--zero {cfg.zero} with --engine deepspeed: ZeRO is mp_toolkit's own here (DeepSpeed's "
                          f"pipeline engine takes stage 0 or 1 of its own); use --zero 0 {other}")
    if cfg.schedule != "1f1b":
        raise ConfigError(f"--schedule {cfg.schedule} with --engine deepspeed: DeepSpeed's pipeline engine runs "
                          f"its own 1F1B only; use --schedule 1f1b {other}")
    if cfg.save_dir is not None or cfg.resume is not None:
        flag = "--save-dir" if cfg.save_dir is not None else "--resume"
        raise ConfigError(f"{flag} with --engine deepspeed: checkpoints are not written or read by this engine; "
                          f"drop {flag} {other}")
    _check_precision(cfg, cfg.precision)
    if cfg.precision == "fp16" and not fp16_available():
        raise ConfigError("--precision fp16 with --engine deepspeed: DeepSpeed's CPU accelerator runs fp16 only where "
                          f"oneDNN has fp16 kernels, not on this CPU; use --precision fp32 or bf16 {other}")


def fp16_available() -> bool:
    """Whether DeepSpeed can train fp16 here: CUDA, or its CPU accelerator's ``is_fp16_supported`` test
    (deepspeed/accelerator/cpu_accelerator.py: oneDNN fp16 kernels)."""
    if torch.cuda.is_available():
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def _check_precision(cfg: TrainConfig, precision: str) -> None:
    if precision == "bf16" and cfg.optimizer in _FLATTENED:
        raise ConfigError(f"--optimizer {cfg.optimizer} with --precision bf16 and --engine deepspeed: DeepSpeed's "
                          "BF16_Optimizer flattens each parameter group into one tensor, so the per-layer trust ratio "
                          "would become one per group; use --precision fp32, --optimizer adamw, or --engine mp_toolkit")


def deepspeed_config(micro_batch: int, microbatches: int, dp: int, clip_grad: float | None, precision: str,
                     fp16: dict | None = None) -> dict:
    """DeepSpeed's config dict for a pipeline run: batch sizes, clipping (0 = none), precision, ZeRO 0."""
    config = {"train_batch_size": micro_batch * microbatches * dp, "train_micro_batch_size_per_gpu": micro_batch,
              "gradient_accumulation_steps": microbatches, "gradient_clipping": clip_grad or 0.0,
              "steps_per_print": 10**9, "wall_clock_breakdown": False, "zero_optimization": {"stage": 0},
              "bf16": {"enabled": precision == "bf16"}}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, **(fp16 or {})}
    return config


def fp32_logits(loss_fn):
    """``loss_fn`` on fp32 copies of fp16 / bf16 outputs (what our executor does before the loss)."""
    def loss(outputs, labels):
        up = lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
        return loss_fn(tuple(map(up, outputs)) if isinstance(outputs, tuple) else up(outputs), labels)
    return loss


class DeepSpeedPipeline:
    """DeepSpeed's PipelineEngine for this rank, behind `TrainEngine` (the loop's and checkpoints' calls).

    It is handed what `mp_toolkit.run.compose` plans for ours: the unsplit LayerList every rank built
    alike (same seed), the cut, and the last stage's loss; this rank keeps its stage.
    """

    def __init__(self, cfg: TrainConfig, ctx: ParallelContext, layers: LayerList, boundaries: list[int],
                 loss_fn: Callable):
        from mp_toolkit.ds import pipe as ds_pipe  # imports DeepSpeed (seconds): only runs that ask for it

        precision = resolve_precision(cfg.precision, ctx.device)
        _check_precision(cfg, precision)
        ds_pipe.init_deepspeed(ctx.device, cfg.timeout_s)
        self._check_fp16(precision)
        self.boundaries = list(boundaries)
        # --length-buckets: micro-batches of several lengths, so DeepSpeed sends each message's shapes with
        # it (PipelineModule's dynamic_shape); one length keeps its first-batch-only shape exchange
        module, self.named = ds_pipe.pipeline_module(layers, cfg.pp, fp32_logits(loss_fn), self.boundaries,
                                                     dynamic_shape=bool(cfg.length_buckets))
        grid = module._grid
        if (grid.get_stage_id(), grid.get_data_parallel_id()) != (ctx.pp_rank, ctx.dp_rank):
            raise RuntimeError(f"rank {ctx.rank}: DeepSpeed's grid puts it at stage {grid.get_stage_id()}, replica "
                               f"{grid.get_data_parallel_id()}; ours at {ctx.pp_rank}, {ctx.dp_rank}")
        if ctx.rank == 0:  # DeepSpeed's own record of the cut (module.parts), which its schedule and ties use
            print(f"deepspeed PipelineModule: boundaries {[int(b) for b in module.parts]}, {precision}, "
                  f"client optimizer {cfg.optimizer}", flush=True)
        self.optimizer = build_optimizer(cfg.optimizer, self.named, cfg.lr, cfg.weight_decay,
                                         options=OptimizerOptions.of(cfg))
        config = deepspeed_config(cfg.micro_batch, cfg.microbatches, cfg.dp, cfg.clip_grad, precision,
                                  LossScaleSettings.of(cfg).as_dict())  # loss_scale 0: dynamic, as in DeepSpeed
        self.engine = ds_pipe.initialize(module, self.optimizer, config)  # casts to bf16 / fp16, keeps fp32 masters
        self.ctx, self.precision = ctx, precision
        self._layer_names = [layers.names[i] for i in range(self.boundaries[ctx.pp_rank],
                                                            self.boundaries[ctx.pp_rank + 1])]
        self._norm = float("nan")
        if precision == "fp32" and cfg.clip_grad is not None:
            self.engine.clip_fp32_gradients = self._clip_fp32  # the instance's, in place of DeepSpeed's

    @property
    def scaler(self) -> None:
        """None: DeepSpeed scales fp16 losses itself (its scale is in each step's `StepStats`)."""
        return None

    @staticmethod
    def _check_fp16(precision: str) -> None:
        from deepspeed.accelerator import get_accelerator

        accel = get_accelerator()
        if precision == "fp16" and not accel.is_fp16_supported():
            raise ConfigError(f"--precision fp16 with --engine deepspeed: DeepSpeed's {accel.device_name()} "
                              "accelerator has no fp16 here; use --precision fp32 or bf16, or --engine mp_toolkit")

    def _clip_fp32(self) -> None:
        """DeepSpeed's ``clip_fp32_gradients`` (the same call), keeping the norm it computes and drops."""
        from deepspeed.runtime.utils import clip_grad_norm_

        e = self.engine
        self._norm = float(clip_grad_norm_(parameters=e.module.parameters(), max_norm=e.gradient_clipping(),
                                           mpu=e.mpu))

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This stage's trainable parameters, named as in the unsplit LayerList."""
        return list(self.named)

    def loss_scale(self) -> float:
        scale = getattr(getattr(self.engine.optimizer, "loss_scale_config", None), "cur_scale", None)
        return float(scale) if scale is not None else 1.0

    def train_batch(self, data_iter) -> StepStats:
        """One global batch through DeepSpeed's 1F1B and its optimizer step; the loss is the mean
        over micro-batches and replicas, on every rank (DeepSpeed broadcasts it from the last stage)."""
        skipped_before, scale = self.engine.skipped_steps, self.loss_scale()
        self._norm = float("nan")
        loss = float(self.engine.train_batch(data_iter=data_iter))
        skipped = self.engine.skipped_steps > skipped_before
        norm = self._norm if self.precision == "fp32" else self.engine.get_global_grad_norm()
        norm = float("nan") if norm is None or skipped else float(norm)
        return StepStats(loss=loss, grad_norm=norm, skipped=skipped, loss_scale=scale,
                         nonfinite="gradients" if skipped else "")

    def eval_batch(self, data_iter) -> float:
        """Mean loss of one global batch through DeepSpeed's inference schedule, forward only, no step."""
        return float(self.engine.eval_batch(data_iter=data_iter))

    def trust_ratio_stats(self) -> list[dict] | None:
        """Per pipeline rank min / median / max of the last step's trust ratios (our LAMB / LARS)."""
        return trust_ratio_rows(self.optimizer, self.ctx)

    def master_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The tensor our client optimizer steps: DeepSpeed hands it this stage's own parameters."""
        return p

    def layer_names(self) -> list[str]:
        """The layers of this rank's stage (DeepSpeed's checkpoints are not written here: `check_engine`)."""
        return list(self._layer_names)

    def copy_back(self) -> None:
        """Nothing to copy: the optimizer steps the parameters themselves."""
