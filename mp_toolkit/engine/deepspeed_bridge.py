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

It takes its settings as arguments, as `PipelineEngine` does (`mp_toolkit.run.engines.deepspeed_pipeline`
hands it a run's): micro_batch -> ``train_micro_batch_size_per_gpu``, microbatches ->
``gradient_accumulation_steps``, clip_grad -> ``gradient_clipping`` (the global norm over all
stages: `mp_toolkit.engine.deepspeed_pipe.count_in_norm_once`), precision -> ``bf16`` / ``fp16`` blocks (fp16 with
the loss-scale fields), ZeRO stage 0. The loss is computed on fp32 logits, as our executor does.
DeepSpeed divides each micro-batch loss by the accumulation steps before backward and reports the
mean over micro-batches, exactly as ours (DESIGN.md invariant 5).

What it cannot run is refused with one line before any rank starts (`mp_toolkit.run.engines.check_engine`):
tp > 1, schedules other than 1f1b (DeepSpeed runs its own 1F1B), checkpoints (--save-dir / --resume),
LAMB / LARS under bf16 (`check_precision`: DeepSpeed's BF16_Optimizer flattens each parameter group
into one tensor, so a per-layer trust ratio would become one per group), fp16 where DeepSpeed's
accelerator has no fp16. Non-finite steps follow DeepSpeed's rules: fp16 overflows are skipped (and
counted by --max-skips); fp32 / bf16 steps are always applied. Without --clip-grad under fp32
DeepSpeed computes no norm: grad_norm is then nan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mp_toolkit.engine.interface import StepStats
from mp_toolkit.engine.reductions import trust_ratio_rows
from mp_toolkit.errors import ConfigError
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.loss_scaler import Numerics
from mp_toolkit.optim.master import resolve_precision
from mp_toolkit.parallel.context import ParallelContext

_FLATTENED = ("lamb", "lars")  # layer-wise optimizers that DeepSpeed's bf16 flattening would change


def fp16_available() -> bool:
    """Whether DeepSpeed can train fp16 here: CUDA, or its CPU accelerator's ``is_fp16_supported`` test
    (deepspeed/accelerator/cpu_accelerator.py: oneDNN fp16 kernels)."""
    if torch.cuda.is_available():
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def check_precision(precision: str, optimizer: str) -> None:
    """ConfigError (one line) for an optimizer DeepSpeed's handling of ``precision`` would change."""
    if precision == "bf16" and optimizer in _FLATTENED:
        raise ConfigError(f"--optimizer {optimizer} with --precision bf16 and --engine deepspeed: DeepSpeed's "
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

    def __init__(self, layers: LayerList, ctx: ParallelContext, boundaries: list[int], microbatches: int,
                 optimizer: Callable[[list], torch.optim.Optimizer], loss_fn: Callable, *, micro_batch: int,
                 precision: str, optimizer_name: str, clip_grad: float | None = None,
                 loss_scale: Numerics | None = None, timeout_s: float = 300.0, dynamic_shape: bool = False):
        """``optimizer``: (named parameters of this stage) -> the client optimizer (its ``optimizer_name``
        for the log and `check_precision`); ``precision`` may be "auto" (`resolve_precision`);
        ``loss_scale``: fp16's settings (None: DeepSpeed's dynamic defaults); ``timeout_s``: of the
        process group DeepSpeed forms when none is; ``dynamic_shape``: micro-batches of several lengths
        (``--length-buckets``), so DeepSpeed sends each message's shapes with it (PipelineModule's
        dynamic_shape); one length keeps its first-batch-only shape exchange."""
        from mp_toolkit.engine import deepspeed_pipe  # imports DeepSpeed (seconds): only runs that ask for it

        precision = resolve_precision(precision, ctx.device)
        check_precision(precision, optimizer_name)
        deepspeed_pipe.init_deepspeed(ctx.device, timeout_s)
        self._check_fp16(precision)
        self.boundaries = list(boundaries)
        module, self.named = deepspeed_pipe.pipeline_module(layers, ctx.pp, fp32_logits(loss_fn), self.boundaries,
                                                            dynamic_shape=dynamic_shape)
        grid = module._grid
        if (grid.get_stage_id(), grid.get_data_parallel_id()) != (ctx.pp_rank, ctx.dp_rank):
            raise RuntimeError(f"rank {ctx.rank}: DeepSpeed's grid puts it at stage {grid.get_stage_id()}, replica "
                               f"{grid.get_data_parallel_id()}; ours at {ctx.pp_rank}, {ctx.dp_rank}")
        if ctx.rank == 0:  # DeepSpeed's own record of the cut (module.parts), which its schedule and ties use
            print(f"deepspeed PipelineModule: boundaries {[int(b) for b in module.parts]}, {precision}, "
                  f"client optimizer {optimizer_name}", flush=True)
        self.optimizer = optimizer(self.named)
        fp16 = loss_scale.as_dict() if loss_scale is not None else None  # loss_scale 0: dynamic, as in DeepSpeed
        config = deepspeed_config(micro_batch, microbatches, ctx.dp, clip_grad, precision, fp16)
        # casts to bf16 / fp16, keeps fp32 masters
        self.engine = deepspeed_pipe.initialize(module, self.optimizer, config)
        self.ctx, self.precision = ctx, precision
        self._layer_names = [layers.names[i] for i in range(self.boundaries[ctx.pp_rank],
                                                            self.boundaries[ctx.pp_rank + 1])]
        self._norm = float("nan")
        if precision == "fp32" and clip_grad is not None:
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
