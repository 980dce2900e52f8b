"""`mpt`'s flags: the parser of ``mpt train``, ``plan``, ``simulate`` and ``export`` (`build_parser`).

Every ``train`` flag defaults to `UNSET`, so a flag given on the command line (which overrides the
DeepSpeed config) can be told from one left out; `FIELDS` are the flags that are `TrainConfig` fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from mp_toolkit.partition.request import PLAN_METHODS, PlanRequest
from mp_toolkit.optim import master
from mp_toolkit.optim.lamb import LAMB_RULES
from mp_toolkit.data.buckets import BucketError, parse_buckets
from mp_toolkit.recompute import MODES as RECOMPUTE_MODES, RecomputeError, parse_layer_counts
from mp_toolkit.run.config import ENGINES, LR_DECAYS, OPTIMIZERS, PRECISIONS, SCHEDULES, TrainConfig


DEPRECATED = "deprecated_flags"
"""Where `_Deprecated` notes the deprecated flags given (removed from the parsed namespace)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (exit 2) instead of usage + error."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)

    def parse_args(self, args=None, namespace=None):
        """Parse, then say once per deprecated flag given what to write instead (one line each)."""
        parsed = super().parse_args(args, namespace)
        for old, new in vars(parsed).pop(DEPRECATED, {}).items():
            sys.stderr.write(f"{old} is deprecated: use {new}\n")
        return parsed


class _Deprecated(argparse.Action):
    """A flag kept for old command lines: stores its value as its successor does and notes the flag,
    so that `_Parser.parse_args` says once, after a parse that succeeded, what to write instead."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        notes = getattr(namespace, DEPRECATED, {})
        notes[option_string] = "--" + self.dest.replace("_", "-")
        setattr(namespace, DEPRECATED, notes)


def _positive_float_or_none(text: str) -> float | None:
    if text.lower() in ("none", "off", "0"):
        return None
    return float(text)


class _Unset:
    """Default of every `train` flag, so a flag given on the command line (which overrides the
    DeepSpeed config) can be told from one left out."""

    def __repr__(self) -> str:
        return "(default)"


UNSET = _Unset()
RECOMPUTE_CHOICES = (*RECOMPUTE_MODES, "auto")
FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig))
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mpt", description="Pipeline model-parallel training for Transformers.")
    # the deepspeed launcher passes --local_rank=N first; LOCAL_RANK in the environment says the same
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_train_parser(sub)
    _add_plan_parser(sub)
    _add_simulate_parser(sub)
    _add_export_parser(sub)
    return parser


def _add_train_parser(sub) -> None:
    d = TrainConfig()
    t = sub.add_parser("train", help="train a model over a pp x tp x dp grid of ranks")

    def opt(*flags, **kw):
        t.add_argument(*flags, default=UNSET, **kw)

    opt("--config", "--deepspeed_config", "--deepspeed-config", dest="ds_config", type=Path,
        help="a DeepSpeed JSON config (batch, fp16/bf16, optimizer, scheduler, pipeline); flags given here override it")
    t.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    opt("--model", help=f"preset (gpt-tiny, gpt-small-cpu, gpt2, ..., bert-tiny, bert-base, bert-large) or a "
                        f"GPT-2 / BERT config.json (default {d.model})")
    opt("--hf", metavar="DIR", help="a local HuggingFace save_pretrained directory (GPT-2, BERT, Llama, Mistral, "
                                    "Qwen2) to train from its weights, instead of --model")
    opt("--pp", type=int, help=f"pipeline stages (default {d.pp})")
    opt("--tp", type=int, help="tensor-parallel ranks per stage (Megatron TP_PLAN)")
    opt("--dp", type=int, help="data-parallel replicas (the global batch is dp x microbatches); under a launcher "
                               "with --config, world size / (pp x tp) as DeepSpeed computes it")
    opt("--dp-bucket-mb", type=float, help="MiB of gradients per data-parallel all-reduce")
    opt("--zero", type=int, help="ZeRO stage: 0 (default) or 1: fp32 masters and optimizer state partitioned over "
                                 "the data-parallel replicas (gradients reduce-scattered, parameters all-gathered)")
    opt("--schedule", type=str.lower, choices=(*SCHEDULES, "auto"),
        help="auto: the fastest the planner predicts (FLOP times) that fits (--memory-gb when given)")
    opt("--engine", type=str.lower, choices=ENGINES, help=f"pipeline engine (default {d.engine}); deepspeed: "
        "DeepSpeed's PipelineEngine with this cut and optimizer (1F1B, pp x dp)")
    opt("--chunks", type=int, help="model chunks per rank (interleaved; default 2)")
    opt("--partition", help=f"flops, parameters, uniform, time, or boundaries like 0,3,7 (default {d.partition})")
    opt("--microbatches", type=int, help="micro-batches per step and replica")
    opt("--micro-batch", type=int, help="sequences per micro-batch")
    opt("--seq-len", type=int, help="tokens per sequence (may change on --resume, up to the model's positions)")
    opt("--length-buckets", type=_buckets, metavar="L[,L...]",
        help="cut each micro-batch to one of these lengths (and --seq-len): BERT to the smallest holding its "
             "longest pair, GPT to one drawn per micro-batch from the seed; default: every one --seq-len")
    opt("--steps", type=int, help="optimizer steps in all (a resumed run continues up to this step)")
    opt("--optimizer", type=str.lower, choices=OPTIMIZERS)
    opt("--lr", type=float, help="peak learning rate (replaces a DeepSpeed config's scheduler by warm-up/decay)")
    opt("--weight-decay", type=float)
    opt("--betas", type=float, nargs=2, metavar=("BETA1", "BETA2"), help="Adam / AdamW / LAMB (default 0.9 0.999)")
    opt("--eps", type=float, help="optimizer epsilon (default: the optimizer's own)")
    opt("--min-trust", type=float, help="LAMB: lower clamp of the trust ratio (DeepSpeed's min_coeff)")
    opt("--max-trust", type=float, help="LAMB: upper clamp of the trust ratio (DeepSpeed's max_coeff)")
    opt("--no-bias-correction", dest="bias_correction", action="store_const", const=False, help="LAMB without bias correction")
    opt("--lamb-rule", type=str.lower, choices=LAMB_RULES, help="LAMB: mp_toolkit (biases and norm weights not "
        "adapted; default) or deepspeed (FusedLamb's: every tensor's trust ratio clamped; a config's \"Lamb\")")
    opt("--momentum", type=float, help="SGD / LARS (default 0.9), RMSprop (default 0)")
    opt("--trust-coefficient", type=float, help="LARS eta (default 0.001)")
    opt("--warmup-steps", type=int)
    opt("--lr-decay", type=str.lower, choices=LR_DECAYS)
    opt("--min-lr", type=float)
    opt("--precision", type=str.lower, choices=PRECISIONS)
    opt("--loss-scale", type=float, help="fp16 static scale; 0 = dynamic")
    opt("--initial-scale-power", type=int)
    opt("--loss-scale-window", type=int)
    opt("--hysteresis", type=int)
    opt("--consecutive-hysteresis", action="store_const", const=True, help="fp16: refill hysteresis on every clean step")
    opt("--min-loss-scale", type=float)
    opt("--clip-grad", type=_positive_float_or_none, help=f"max global grad norm, or none (default {d.clip_grad})")
    opt("--seed", type=int)
    opt("--data", help="stdlib, synthetic, or a local text/JSON-lines file or folder")
    opt("--metrics", type=Path, help="write one JSON object per step here")
    opt("--plot", type=Path, help="write the loss curve PNG here")
    opt("--eval-every", type=int, help="validation loss every N steps (and after the last) on a held-out split")
    opt("--eval-batches", type=int, help=f"global batches per validation (default {d.eval_batches})")
    opt("--tensorboard", type=Path, metavar="DIR", help="write TensorBoard scalars to DIR")
    opt("--csv", type=Path, metavar="FILE", help="write the per-step scalars as CSV")
    opt("--cache-dir", type=Path, help="tokenizer cache")
    opt("--threads", type=int, help="torch threads per rank")
    opt("--timeout", dest="timeout_s", type=float, metavar="SECONDS", help="seconds any communication may wait")
    opt("--hang-timeout", dest="hang_timeout_s", type=float, metavar="SECONDS",
        help=f"name a rank whose heartbeat or step stops for this long and stop every rank (exit 4; default "
             f"{d.hang_timeout_s:g}, the first step 5x; 0: off)")
    opt("--no-progress", dest="progress", action="store_const", const=False, help="no progress bar")
    opt("--save-dir", type=Path, help="checkpoint root: layout-independent checkpoints (resume on any pp/tp/dp)")
    opt("--save-every", type=int, help="save every N steps (and after the last); default: after the last only")
    opt("--overwrite", action="store_const", const=True, help="a fresh run (no --resume) may save into a "
        "--save-dir holding checkpoints (its steps replace those of the same number)")
    opt("--keep", type=int, help=f"checkpoints kept in --save-dir (default {d.keep}; 0 keeps all)")
    opt("--resume", nargs="?", const="latest", metavar="DIR|latest|auto",
        help="resume from --save-dir's latest checkpoint (latest or auto: a fresh start when none), or from DIR")
    opt("--restarts", type=int, help="without a launcher: restart the ranks up to N times after one dies, resuming "
                                     "from the latest checkpoint (needs --save-dir and --save-every)")
    opt("--max-skips", type=int, help=f"stop after N consecutive steps skipped for non-finite loss or gradients "
                                      f"(default {d.max_skips})")
    opt("--recompute", type=str.lower, choices=RECOMPUTE_CHOICES,
        help="activation recomputation: none, full (whole blocks), selective (attention core), or auto "
             "(per stage, with the cut, to fit --memory-gb at the least predicted time)")
    opt("--recompute-layers", type=_layer_counts, metavar="N[,N...]",
        help="recompute the first N block layers of every stage, or one count per stage (default: all)")
    opt("--memory-gb", type=float, help="per-rank memory cap that --recompute auto plans for")
    opt("--dry-run", action="store_true", help="run every check, print the run and mpt plan's prediction for its "
                                               "cut, start nothing (exit 0), also under a launcher")


def _add_plan_parser(sub) -> None:
    d = PlanRequest(model="")
    p = sub.add_parser("plan", help="cut a model into stages and predict time, memory and bubble")
    p.add_argument("--model", required=True, help="preset or HuggingFace config.json (GPT-2, BERT, Llama families)")
    for name in ("pp", "tp", "dp"):
        p.add_argument(f"--{name}", type=int, default=getattr(d, name))
    p.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per micro-batch")
    p.add_argument("--microbatches", type=int, default=d.microbatches, help="micro-batches per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--method", default=d.method, help=", ".join(PLAN_METHODS))
    p.add_argument("--memory-gb", type=float, default=None, help="per-device memory cap")
    p.add_argument("--precision", default=d.precision, type=str.lower, choices=tuple(master.PRECISIONS),
                   help="what the stages compute and communicate in (mpt train --precision)")
    p.add_argument("--dtype", dest="precision", type=str.lower, choices=tuple(master.PRECISIONS),
                   action=_Deprecated, help=argparse.SUPPRESS)
    p.add_argument("--optimizer", default=d.optimizer, type=str.lower, choices=OPTIMIZERS)
    p.add_argument("--zero", type=int, default=d.zero, help="ZeRO stage 0 or 1: optimizer state and fp32 masters "
                   "partitioned over the dp replicas (static bytes per parameter)")
    p.add_argument("--schedule", default=d.schedule, type=str.lower, choices=(*SCHEDULES, "auto"),
                   help="auto: the fastest predicted schedule that fits --memory-gb")
    p.add_argument("--chunks", type=int, default=None, help="model chunks per rank (interleaved; default 2)")
    p.add_argument("--tflops", type=float, default=None, help="device TFLOP/s for FLOP-based times (default: measured here)")
    p.add_argument("--measure", action="store_true", help="time every layer here whatever the method")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank while timing layers "
                   "(default: as mpt train picks them)")
    p.add_argument("--no-load", dest="load", action="store_false",
                   help="time layers on an idle machine, without stand-ins for the other ranks")
    p.add_argument("--p2p-latency-us", type=float, default=d.p2p_latency_us)
    p.add_argument("--p2p-gbps", type=float, default=d.p2p_gbps, help="p2p and collective bandwidth, GB/s")
    p.add_argument("--mem-gbps", type=float, default=d.mem_gbps, help="memory bandwidth for the optimizer step estimate")
    p.add_argument("--hf", action="store_true", help="--model is a HuggingFace config trained from transformers' "
                   "modules (mpt train --hf): count what they keep")
    p.add_argument("--json", type=Path, default=None, help="write the plan as JSON")
    p.add_argument("--gantt", type=Path, default=None, help="draw the predicted schedule (.png or .svg)")
    p.add_argument("--recompute", default=d.recompute, type=str.lower, choices=RECOMPUTE_CHOICES,
                   help="none, full, selective, or auto (with --method memory: chosen per stage with the cut)")
    p.add_argument("--recompute-layers", type=_layer_counts, default=None, metavar="N[,N...]",
                   help="first N block layers of every stage, or one count per stage (default: all)")


def _buckets(text: str) -> tuple[int, ...]:
    try:
        return parse_buckets(text)
    except BucketError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _layer_counts(text: str) -> tuple[int, ...]:
    try:
        return parse_layer_counts(text)
    except RecomputeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_simulate_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a schedule with unit or given costs")
    p.add_argument("--schedule", required=True, type=str.lower, choices=SCHEDULES)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--chunks", type=int, default=None, help="model chunks per rank (interleaved; default 2)")
    for kind, default in (("f", 1.0), ("b", 2.0)):
        p.add_argument(f"--cost-{kind}", type=float, default=default, help=f"{kind.upper()} cost of one micro-batch")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--gantt", type=Path, default=None, help=".png or .svg")




def _add_export_parser(sub) -> None:
    e = sub.add_parser("export", help="write a HuggingFace model directory (from_pretrained) from a checkpoint")
    e.add_argument("--checkpoint", required=True, type=Path, help="a --save-dir (its latest) or one step-XXXXXXXX")
    e.add_argument("--out", required=True, type=Path, help="the HF directory to write (new or empty)")
    e.add_argument("--config", type=Path, default=None,
                   help="HF config.json, for a checkpoint of an HF-loaded run whose manifest has no hf_config")
    e.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer directory or tokenizers JSON to ship (default: the run's own, when it can be found)")
    e.add_argument("--cache-dir", type=Path, default=None, help="the tokenizer cache the run used (mpt train "
                   "--cache-dir; default its default): the run's trained tokenizer is read only from here")
    e.add_argument("--force", action="store_true", help="replace --out when it is not empty")
    e.add_argument("--max-shard-size", default="5GB",
                   help="split the weights into model-0000i-of-0000n.safetensors + index above this size "
                        "(e.g. 5GB, 500MiB; default 5GB); the export streams one layer at a time either way")
