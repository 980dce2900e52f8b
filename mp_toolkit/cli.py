"""`mpt`: the command line.

    mpt train --model gpt-small-cpu --pp 2 --schedule 1f1b --microbatches 4 --steps 100 \\
              --metrics runs/demo/metrics.jsonl --plot runs/demo/loss.png
    torchrun --nproc_per_node 2 -m mp_toolkit.cli train --model gpt-tiny --pp 2

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
    t = sub.add_parser("train", help="train a model over a pipeline of ranks")
    t.add_argument("--model", default=d.model, help="preset (gpt-tiny, gpt-small-cpu, gpt2, ...) or GPT-2 config.json")
    t.add_argument("--pp", type=int, default=d.pp, help="pipeline stages")
    t.add_argument("--schedule", default=d.schedule, type=str.lower, choices=SCHEDULES)
    t.add_argument("--chunks", type=int, default=None, help="model chunks per rank (interleaved; default 2)")
    t.add_argument("--partition", default=d.partition, help="uniform, parameters, or boundaries like 0,3,7")
    t.add_argument("--microbatches", type=int, default=d.microbatches, help="micro-batches per step")
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
    return parser


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=args.model, pp=args.pp, schedule=args.schedule,
        chunks=args.chunks if args.chunks is not None else (2 if args.schedule == "interleaved" else 1), partition=args.partition,
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
    from mp_toolkit.train import run_training, validate

    cfg = train_config(args)
    env = launcher_env()
    if env is None:  # no launcher: validate once, then start the ranks ourselves
        validate(cfg)
        for path in (cfg.metrics, cfg.plot):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
        if cfg.pp == 1:
            run_training(cfg, LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1))
            return 0
        return spawn_local(argv, cfg.pp)
    if env.world_size != cfg.pp:
        raise ConfigError(f"the launcher started {env.world_size} processes but --pp is {cfg.pp}: they must be equal")
    run_training(cfg, env)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(argv, args)
    except ConfigError as e:
        sys.stderr.write(f"mpt {args.command}: error: {e}\n")
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
