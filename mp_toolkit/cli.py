"""`mpt`: the command line.

    mpt train --model gpt-small-cpu --pp 2 --schedule 1f1b --microbatches 4 --steps 100 \\
              --metrics runs/demo/metrics.jsonl --plot runs/demo/loss.png
    mpt train --model gpt-tiny --pp 2 --tp 2 --dp 2     # starts pp*tp*dp = 8 ranks itself
    mpt train --model bert-tiny --seq-len 64 --pp 2 --save-dir runs/bert --save-every 20
    mpt train --model bert-tiny --seq-len 64 --pp 1 --tp 2 --save-dir runs/bert --resume latest
    mpt train --model gpt-tiny --pp 2 --save-dir runs/x --save-every 20 --restarts 3   # restarts dead ranks
    mpt train --config recipes/gpt_pretrain/ds_config.json --steps 50   # a DeepSpeed config; flags override it
    torchrun --nproc_per_node 2 -m mp_toolkit.cli train --model gpt-tiny --pp 2
    torchrun --nproc_per_node 4 -m mp_toolkit.cli train --model gpt-tiny --pp 1 --tp 2 --dp 2
    torchrun --nproc_per_node 2 --max-restarts 3 -m mp_toolkit.cli train --model gpt-tiny --pp 2 \\
             --save-dir runs/x --save-every 20 --resume auto
    deepspeed --num_gpus 2 recipes/gpt_pretrain/train.py --deepspeed_config recipes/gpt_pretrain/ds_config.json
    mpt export --checkpoint runs/bert --out hf/bert   # BertForPreTraining.from_pretrained("hf/bert")

A wrong value ends with one line on stderr that names it and what would work, exit code 2. `mpt train`
exits 3 after --max-skips consecutive non-finite steps, 1 when a rank died (the line names it), 4 when
a rank hung (--hang-timeout; the line names it), 5 when SIGTERM / SIGUSR1 stopped it after a saved
step, and 128 + N when it started the ranks itself and one died of signal N (RELIABILITY.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import NoReturn

from mp_toolkit.checkpoint import CheckpointError
from mp_toolkit.ds.overrides import blame, ds_overrides, merge
from mp_toolkit.parallel.context import GridError, check_grid
from mp_toolkit.partition import PartitionError
from mp_toolkit.partition.cost import CostModelError
from mp_toolkit.partition.auto_schedule import fastest_schedule
from mp_toolkit.partition.planner import MAX_MICROBATCHES, PLAN_METHODS, PlanRequest, make_plan
from mp_toolkit.partition.report import draw_plan_gantt, format_plan, write_json
from mp_toolkit.run.checks import validate
from mp_toolkit.optim import master
from mp_toolkit.optim.lamb import LAMB_RULES
from mp_toolkit.data.buckets import BucketError, parse_buckets
from mp_toolkit.recompute import MODES as RECOMPUTE_MODES, RecomputeError, parse_layer_counts
from mp_toolkit.run.config import ENGINES, LR_DECAYS, OPTIMIZERS, PRECISIONS, SCHEDULES, ConfigError, TrainConfig
from mp_toolkit.run.predict import dry_run_report
from mp_toolkit.run.launch import EXIT_DIVERGED, EXIT_PREEMPTED, LaunchEnv, PeerLost, launcher_env, local_faults
from mp_toolkit.run.spawn import can_fork_ranks, spawn_local
from mp_toolkit.run.loop import Preempted, run_training
from mp_toolkit.run.recompute_plan import default_schedule, resolve_auto_schedule
from mp_toolkit.run.skips import Diverged
from mp_toolkit.run.state import PeerFailed
from mp_toolkit.schedule import ScheduleError, simulate_report


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (exit 2) instead of usage + error."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _positive_float_or_none(text: str) -> float | None:
    if text.lower() in ("none", "off", "0"):
        return None
    return float(text)


class _Unset:
    """Default of every `train` flag, so a flag given on the command line (which overrides the
    DeepSpeed config) can be told from one left out."""

    def __repr__(self) -> str:
        return "(default)"


_UNSET = _Unset()
RECOMPUTE_CHOICES = (*RECOMPUTE_MODES, "auto")
_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig))
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
        t.add_argument(*flags, default=_UNSET, **kw)

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
    p.add_argument("--dtype", default=d.dtype, type=str.lower, choices=tuple(master.PRECISIONS))
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


def train_config(args: argparse.Namespace, world_size: int | None = None) -> tuple[TrainConfig, list[str]]:
    """(TrainConfig, log lines): TrainConfig's defaults, then the DeepSpeed config's values, then every
    flag given on the command line. ``world_size`` (a launcher's) gives DeepSpeed's dp = world / (pp x tp)."""
    given, from_file, notes = _sources(args, world_size)
    return merge(given, from_file), notes


def _sources(args: argparse.Namespace, world_size: int | None) -> tuple[dict, dict, list[str]]:
    """(fields given on the command line, fields the DeepSpeed config sets and no flag overrides, log lines)."""
    given = {k: v for k, v in vars(args).items() if k in _FIELDS and v is not _UNSET}
    if "betas" in given:
        given["betas"] = tuple(given["betas"])
    if given.get("keep") == 0:
        given["keep"] = None
    if args.ds_config is _UNSET:
        return given, {}, []
    return (given, *ds_overrides(args.ds_config, given, world_size))


def _train(argv: list[str], args: argparse.Namespace, fork_ranks: bool) -> int:
    env = launcher_env()
    given, from_file, notes = _sources(args, env.world_size if env is not None else None)
    cfg = merge(given, from_file)
    if cfg.schedule == "auto":  # every rank resolves it alike (FLOP times: arithmetic)
        cfg, line = resolve_auto_schedule(cfg, chunks_given="chunks" in given)
        notes = [*notes, line]
    elif "schedule" not in given and "schedule" not in from_file:  # no schedule named: the planner's default
        cfg, line = default_schedule(cfg)
        notes = [*notes, line] if line else notes
    try:
        boundaries = validate(cfg)  # no process group needed: every rank fails the same way before any talks
    except ConfigError as e:
        raise blame(e, from_file, args.ds_config) from None
    dry_run = args.dry_run is not _UNSET
    if (env.rank == 0) if env is not None else cfg.world_size == 1:  # once, by the process that trains rank 0
        for line in notes:
            print(line, flush=True)
    if env is None and dry_run:
        print(dry_run_report(cfg, boundaries, "mpt train itself"), flush=True)
        return 0
    if env is None:  # no launcher: start the pp*tp*dp ranks ourselves
        for path in (cfg.metrics, cfg.plot):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
        if cfg.world_size == 1 and not cfg.restarts and cfg.engine == "mp_toolkit":  # DeepSpeed reads a launcher's env
            return _run(cfg, LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, faults=local_faults()))
        fork_with = main if fork_ranks and can_fork_ranks() else None
        return spawn_local(argv, cfg.world_size, restarts=cfg.restarts, save_dir=cfg.save_dir, fork_with=fork_with)
    if cfg.restarts and not env.started_by_mpt:
        raise ConfigError(f"--restarts {cfg.restarts} is for mpt train starting the ranks itself; under a launcher "
                          "restart with it (torchrun --max-restarts N) and pass --resume auto")
    try:
        check_grid(env.world_size, cfg.pp, cfg.tp, cfg.dp)
    except GridError as e:
        raise ConfigError(f"the launcher started {env.world_size} processes: {e}") from None
    if dry_run:
        if env.rank == 0:
            print(dry_run_report(cfg, boundaries, f"the launcher (world size {env.world_size})"), flush=True)
        return 0
    return _run(cfg, env)


def _run(cfg: TrainConfig, env) -> int:
    """Train this rank; a lost peer (exit 1) and a diverged run (exit 3, said once by rank 0) end in one line."""
    try:
        run_training(cfg, env)
    except Diverged as e:
        if env.rank == 0:
            sys.stderr.write(f"mpt train: error: {e}\n")
        return EXIT_DIVERGED
    except Preempted as e:
        if env.rank == 0:
            sys.stderr.write(f"mpt train: {e}\n")
        return EXIT_PREEMPTED
    except PeerLost as e:
        sys.stderr.write(f"mpt train: error: {e}\n")
        _exit_without_finalizing(1)
    return 0


def _exit_without_finalizing(code: int) -> NoReturn:
    """End a rank whose process group is broken, skipping interpreter finalization.

    A peer died, so the gloo / NCCL group still has work and threads tied to it; finalizing the
    interpreter runs their C++ destructors, which may abandon a joinable thread and abort the
    process (SIGABRT, "terminate called without an active exception", seen on an Intel Xeon after
    this rank had already named the lost peer). The rank has nothing left to write: its line is
    out, its metrics rows and checkpoint files were closed by the ``with`` blocks the exception
    left. Only reached when world size > 1, i.e. in a rank process of its own.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _chunks(args: argparse.Namespace) -> int:
    return args.chunks if args.chunks is not None else (2 if args.schedule == "interleaved" else 1)


def _make_plan(req: PlanRequest):
    """The plan of ``req``; ``--schedule auto`` plans every candidate and says which it took."""
    if req.schedule != "auto":
        return make_plan(req)
    choice = fastest_schedule(req)
    print(choice.describe())
    return choice.plan


def _plan(args: argparse.Namespace) -> int:
    req = PlanRequest(
        model=args.model, pp=args.pp, tp=args.tp, dp=args.dp, micro_batch=args.micro_batch,
        microbatches=args.microbatches, seq_len=args.seq_len, method=args.method, memory_gb=args.memory_gb,
        dtype=args.dtype, optimizer=args.optimizer, schedule=args.schedule, chunks=_chunks(args),
        tflops=args.tflops, measure=args.measure, threads=args.threads, load=args.load,
        p2p_latency_us=args.p2p_latency_us, p2p_gbps=args.p2p_gbps,
        mem_gbps=args.mem_gbps, hf=args.hf, recompute=args.recompute, recompute_layers=args.recompute_layers,
        zero=args.zero,
    )
    _check_output(args.gantt)
    plan = _make_plan(req)
    print(format_plan(plan))
    if args.json:
        write_json(plan.to_json(), args.json)
    if args.gantt:
        draw_plan_gantt(plan, args.gantt)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    for name, top in (("pp", 1024), ("microbatches", MAX_MICROBATCHES), ("chunks", 64)):
        value = getattr(args, name)
        if value is not None and not 1 <= value <= top:
            raise ConfigError(f"--{name} {value} must be between 1 and {top}")
    if not (math.isfinite(args.cost_f) and math.isfinite(args.cost_b) and args.cost_f > 0 and args.cost_b > 0):
        raise ConfigError(f"--cost-f {args.cost_f:g} and --cost-b {args.cost_b:g} must be positive")
    _check_output(args.gantt)
    try:
        report = simulate_report(args.schedule, args.pp, args.microbatches, _chunks(args),
                                 {"F": args.cost_f, "B": args.cost_b}, gantt=str(args.gantt) if args.gantt else None)
    except ValueError as e:  # sizes the schedule cannot take: one line, as mpt plan and mpt train say it
        raise ConfigError(str(e)) from None
    print(f"{report['schedule']}: pp={report['pp']} microbatches={report['microbatches']} "
          f"chunks={report['chunks']}: step time {report['step_time']:g}, "
          f"bubble fraction {report['bubble_fraction']:.4f}, peak in-flight per stage {report['peak_inflight']}")
    if args.json:
        write_json(report, args.json)
    return 0


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


def _export(args: argparse.Namespace) -> int:
    from mp_toolkit.hf.export_run import export_run  # imports transformers (seconds, optional): export only

    try:
        done = export_run(args.checkpoint, args.out, config=args.config, tokenizer=args.tokenizer, force=args.force,
                          max_shard_size=args.max_shard_size,
                          cache_dir=args.cache_dir if args.cache_dir is not None else TrainConfig().cache_dir)
    except ValueError as e:  # also HF's config errors; a CheckpointError (e.g. a hash mismatch) names --checkpoint
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"--checkpoint {line}" if isinstance(e, CheckpointError) else line) from None
    print(f"wrote {done.out}: {done.architecture}, {done.parameters:,} parameters, step {done.step} of "
          f"{args.checkpoint}; {done.tokenizer}")
    return 0


def _check_output(gantt: Path | None) -> None:
    if gantt is not None and gantt.suffix.lower() not in (".png", ".svg"):
        raise ConfigError(f"--gantt {gantt} must end in .png or .svg")


def main(argv: list[str] | None = None, fork_ranks: bool = False) -> int:
    """``mpt <argv>``; the exit code. ``fork_ranks``: this process is the ``mpt`` command itself (a
    fresh interpreter that has run nothing else), so `mpt train` may fork its ranks from it
    (`run.spawn`); a Python caller gets ranks that start as interpreters of their own."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(argv, args, fork_ranks)
        if args.command == "plan":
            return _plan(args)
        if args.command == "simulate":
            return _simulate(args)
        if args.command == "export":
            return _export(args)
    except (PartitionError, CostModelError, ScheduleError) as e:
        sys.stderr.write(f"mpt {args.command}: error: {str(e).splitlines()[0]}\n")
        return 2
    except (ConfigError, CheckpointError) as e:
        sys.stderr.write(f"mpt {args.command}: error: {e}\n")
        return 2
    except PeerFailed:  # another rank failed and reported why
        return 2
    return 2


def console() -> int:
    """The ``mpt`` command (and ``python -m mp_toolkit.cli``)."""
    return main(fork_ranks=True)


if __name__ == "__main__":
    sys.exit(console())
