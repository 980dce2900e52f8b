"""`mpt`: the command line.

    mpt train --model gpt-small-cpu --pp 2 --schedule 1f1b --microbatches 4 --steps 100 \\
              --metrics runs/demo/metrics.jsonl --plot runs/demo/loss.png
    mpt train --model gpt-tiny --pp 2 --tp 2 --dp 2     # starts pp*tp*dp = 8 ranks itself
    torchrun --nproc_per_node 2 -m mp_toolkit.cli train --model gpt-tiny --pp 2
    torchrun --nproc_per_node 4 -m mp_toolkit.cli train --model gpt-tiny --pp 1 --tp 2 --dp 2

A wrong value ends with one line on stderr that names it and what would work, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mp_toolkit.config import LR_DECAYS, OPTIMIZERS, PRECISIONS, SCHEDULES, ConfigError, TrainConfig


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (exit 2) instead of usage + error."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _positive_float_or_none(text: str) -> float | None:
    if text.lower() in ("none", "off", "0"):
        return None
    return float(text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mpt", description="Pipeline model-parallel training for Transformers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    d = TrainConfig()
    t = sub.add_parser("train", help="train a model over a pp x tp x dp grid of ranks")
    t.add_argument("--model", default=d.model, help="preset (gpt-tiny, gpt-small-cpu, gpt2, ...) or GPT-2 config.json")
    t.add_argument("--pp", type=int, default=d.pp, help="pipeline stages")
    t.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel ranks per stage (Megatron TP_PLAN)")
    t.add_argument("--dp", type=int, default=d.dp, help="data-parallel replicas (the global batch is dp x microbatches)")
    t.add_argument("--dp-bucket-mb", type=float, default=d.dp_bucket_mb, help="MiB of gradients per data-parallel all-reduce")
    t.add_argument("--schedule", default=d.schedule, type=str.lower, choices=SCHEDULES)
    t.add_argument("--chunks", type=int, default=None, help="model chunks per rank (interleaved; default 2)")
    t.add_argument("--partition", default=d.partition, help="uniform, parameters, or boundaries like 0,3,7")
    t.add_argument("--microbatches", type=int, default=d.microbatches, help="micro-batches per step and replica")
    t.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per micro-batch")
    t.add_argument("--seq-len", type=int, default=d.seq_len)
    t.add_argument("--steps", type=int, default=d.steps)
    t.add_argument("--optimizer", default=d.optimizer, type=str.lower, choices=OPTIMIZERS)
    t.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    t.add_argument("--weight-decay", type=float, default=d.weight_decay)
    t.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    t.add_argument("--lr-decay", default=d.lr_decay, type=str.lower, choices=LR_DECAYS)
    t.add_argument("--min-lr", type=float, default=d.min_lr)
    t.add_argument("--precision", default=d.precision, type=str.lower, choices=PRECISIONS)
    t.add_argument("--loss-scale", type=float, default=d.loss_scale, help="fp16 static scale; 0 = dynamic")
    t.add_argument("--initial-scale-power", type=int, default=d.initial_scale_power)
    t.add_argument("--loss-scale-window", type=int, default=d.loss_scale_window)
    t.add_argument("--hysteresis", type=int, default=d.hysteresis)
    t.add_argument("--min-loss-scale", type=float, default=d.min_loss_scale)
    t.add_argument("--clip-grad", type=_positive_float_or_none, default=d.clip_grad, help="max global grad norm, or none")
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--data", default=d.data, help="stdlib, synthetic, or a local text/JSON-lines file or folder")
    t.add_argument("--metrics", type=Path, default=None, help="write one JSON object per step here")
    t.add_argument("--plot", type=Path, default=None, help="write the loss curve PNG here")
    t.add_argument("--cache-dir", type=Path, default=d.cache_dir, help="tokenizer cache")
    t.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    t.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds any communication may wait")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_plan_parser(sub)
    _add_simulate_parser(sub)
    return parser


def _add_plan_parser(sub) -> None:
    from mp_toolkit.partition.planner import PLAN_METHODS, PlanRequest

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
    p.add_argument("--dtype", default=d.dtype, type=str.lower, choices=("fp32", "fp16", "bf16"))
    p.add_argument("--optimizer", default=d.optimizer, type=str.lower, choices=OPTIMIZERS)
    p.add_argument("--schedule", default=d.schedule, type=str.lower, choices=SCHEDULES)
    p.add_argument("--chunks", type=int, default=None, help="model chunks per rank (interleaved; default 2)")
    p.add_argument("--tflops", type=float, default=None, help="device TFLOP/s for FLOP-based times (default: measured here)")
    p.add_argument("--measure", action="store_true", help="time every layer here whatever the method")
    p.add_argument("--p2p-latency-us", type=float, default=d.p2p_latency_us)
    p.add_argument("--p2p-gbps", type=float, default=d.p2p_gbps, help="p2p and collective bandwidth, GB/s")
    p.add_argument("--mem-gbps", type=float, default=d.mem_gbps, help="memory bandwidth for the optimizer step estimate")
    p.add_argument("--json", type=Path, default=None, help="write the plan as JSON")
    p.add_argument("--gantt", type=Path, default=None, help="draw the predicted schedule (.png or .svg)")


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


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=args.model, pp=args.pp, tp=args.tp, dp=args.dp, dp_bucket_mb=args.dp_bucket_mb, schedule=args.schedule,
        chunks=_chunks(args), partition=args.partition,
        microbatches=args.microbatches, micro_batch=args.micro_batch, seq_len=args.seq_len,
        steps=args.steps, optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, lr_decay=args.lr_decay, min_lr=args.min_lr,
        precision=args.precision, loss_scale=args.loss_scale, initial_scale_power=args.initial_scale_power,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        min_loss_scale=args.min_loss_scale, clip_grad=args.clip_grad,
        seed=args.seed, data=args.data, metrics=args.metrics, plot=args.plot,
        cache_dir=args.cache_dir, threads=args.threads, timeout_s=args.timeout,
        progress=not args.no_progress,
    )


def _train(argv: list[str], args: argparse.Namespace) -> int:
    from mp_toolkit.launch import LaunchEnv, launcher_env, spawn_local
    from mp_toolkit.parallel.context import GridError, check_grid
    from mp_toolkit.train import run_training, validate

    cfg = train_config(args)
    env = launcher_env()
    validate(cfg)  # no process group needed: every rank fails the same way before any talks
    if env is None:  # no launcher: start the pp*tp*dp ranks ourselves
        for path in (cfg.metrics, cfg.plot):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
        if cfg.world_size == 1:
            run_training(cfg, LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1))
            return 0
        return spawn_local(argv, cfg.world_size)
    try:
        check_grid(env.world_size, cfg.pp, cfg.tp, cfg.dp)
    except GridError as e:
        raise ConfigError(f"the launcher started {env.world_size} processes: {e}") from None
    run_training(cfg, env)
    return 0


def _chunks(args: argparse.Namespace) -> int:
    return args.chunks if args.chunks is not None else (2 if args.schedule == "interleaved" else 1)


def _plan(args: argparse.Namespace) -> int:
    from mp_toolkit.partition.planner import PlanRequest, make_plan
    from mp_toolkit.partition.report import draw_plan_gantt, format_plan, write_json

    req = PlanRequest(
        model=args.model, pp=args.pp, tp=args.tp, dp=args.dp, micro_batch=args.micro_batch,
        microbatches=args.microbatches, seq_len=args.seq_len, method=args.method, memory_gb=args.memory_gb,
        dtype=args.dtype, optimizer=args.optimizer, schedule=args.schedule, chunks=_chunks(args),
        tflops=args.tflops, measure=args.measure, p2p_latency_us=args.p2p_latency_us, p2p_gbps=args.p2p_gbps,
        mem_gbps=args.mem_gbps,
    )
    _check_output(args.gantt)
    plan = make_plan(req)
    print(format_plan(plan))
    if args.json:
        write_json(plan.to_json(), args.json)
    if args.gantt:
        draw_plan_gantt(plan, args.gantt)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from mp_toolkit.partition.report import write_json
    from mp_toolkit.schedule import simulate_report

    for name in ("pp", "microbatches"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} {getattr(args, name)} must be at least 1")
    if not (args.cost_f > 0 and args.cost_b > 0):
        raise ConfigError(f"--cost-f {args.cost_f:g} and --cost-b {args.cost_b:g} must be positive")
    _check_output(args.gantt)
    report = simulate_report(args.schedule, args.pp, args.microbatches, _chunks(args),
                             {"F": args.cost_f, "B": args.cost_b}, gantt=str(args.gantt) if args.gantt else None)
    print(f"{report['schedule']}: pp={report['pp']} microbatches={report['microbatches']} "
          f"chunks={report['chunks']}: step time {report['step_time']:g}, "
          f"bubble fraction {report['bubble_fraction']:.4f}, peak in-flight per stage {report['peak_inflight']}")
    if args.json:
        write_json(report, args.json)
    return 0


def _check_output(gantt: Path | None) -> None:
    if gantt is not None and gantt.suffix.lower() not in (".png", ".svg"):
        raise ConfigError(f"--gantt {gantt} must end in .png or .svg")


def main(argv: list[str] | None = None) -> int:
    from mp_toolkit.partition import PartitionError
    from mp_toolkit.partition.cost import CostModelError
    from mp_toolkit.schedule import ScheduleError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(argv, args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "simulate":
            return _simulate(args)
    except (PartitionError, CostModelError, ScheduleError) as e:
        sys.stderr.write(f"mpt {args.command}: error: {str(e).splitlines()[0]}\n")
        return 2
    except ConfigError as e:
        sys.stderr.write(f"mpt {args.command}: error: {e}\n")
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
