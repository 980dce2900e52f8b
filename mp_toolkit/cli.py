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
from mp_toolkit.partition.planner import PlanRequest, make_plan
from mp_toolkit.partition.request import MAX_MICROBATCHES
from mp_toolkit.partition.report import draw_plan_gantt, format_plan, write_json
from mp_toolkit.run.checks import validate
from mp_toolkit.run.config import ConfigError, TrainConfig
from mp_toolkit.run.predict import dry_run_report
from mp_toolkit.run.launch import EXIT_DIVERGED, EXIT_PREEMPTED, LaunchEnv, PeerLost, launcher_env, local_faults
from mp_toolkit.run.spawn import can_fork_ranks, spawn_local
from mp_toolkit.run.loop import Preempted, run_training
from mp_toolkit.run.recompute_plan import default_schedule, resolve_auto_schedule
from mp_toolkit.run.skips import Diverged
from mp_toolkit.run.state import PeerFailed
from mp_toolkit.schedule import ScheduleError, simulate_report
from mp_toolkit.cli_args import FIELDS, UNSET, build_parser


def train_config(args: argparse.Namespace, world_size: int | None = None) -> tuple[TrainConfig, list[str]]:
    """(TrainConfig, log lines): TrainConfig's defaults, then the DeepSpeed config's values, then every
    flag given on the command line. ``world_size`` (a launcher's) gives DeepSpeed's dp = world / (pp x tp)."""
    given, from_file, notes = _sources(args, world_size)
    return merge(given, from_file), notes


def _sources(args: argparse.Namespace, world_size: int | None) -> tuple[dict, dict, list[str]]:
    """(fields given on the command line, fields the DeepSpeed config sets and no flag overrides, log lines)."""
    given = {k: v for k, v in vars(args).items() if k in FIELDS and v is not UNSET}
    if "betas" in given:
        given["betas"] = tuple(given["betas"])
    if given.get("keep") == 0:
        given["keep"] = None
    if args.ds_config is UNSET:
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
    dry_run = args.dry_run is not UNSET
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
