"""`mpt train`: merge the flags with a DeepSpeed config, check the run, then start the ranks (or,
under a launcher, train this one)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import torch

from mp_toolkit.cli_args import FIELDS, UNSET
from mp_toolkit.ds.overrides import blame, ds_overrides, merge
from mp_toolkit.errors import ConfigError
from mp_toolkit.parallel.context import GridError, check_grid
from mp_toolkit.run.config import TrainConfig
from mp_toolkit.run.elastic import elastic_layout
from mp_toolkit.run.launch import (
    EXIT_DIVERGED,
    EXIT_PREEMPTED,
    EXIT_REPLICAS,
    LaunchEnv,
    PeerLost,
    device_and_backend,
    launcher_env,
    local_faults,
)
from mp_toolkit.run.loop import Preempted, run_training
from mp_toolkit.run.plan import RunPlan, resolve_run
from mp_toolkit.run.predict import dry_run_report
from mp_toolkit.run.replicas import ReplicasDiffer
from mp_toolkit.run.skips import Diverged
from mp_toolkit.run.spawn import can_fork_ranks, spawn_local


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


def plan_run(args: argparse.Namespace, env: LaunchEnv | None = None) -> RunPlan:
    """The run ``mpt train ARGS`` trains, decided once (`run.plan`): the DeepSpeed config and the flags
    merged (`train_config`), then resolved here, or, in a rank that ``mpt train`` started, received from
    it. A value that cannot work raises `ConfigError`, naming the DeepSpeed key it came from."""
    given, from_file, notes = _sources(args, env.world_size if env is not None else None)
    cfg = merge(given, from_file)
    try:
        if env is not None and env.run_plan is not None:
            return RunPlan.received(cfg, json.loads(env.run_plan))
        cfg, line = elastic_layout(cfg, env.world_size if env is not None else None, "dp" in given)
        notes = [*notes, line] if line else notes
        device = None if env is None else device_and_backend(env.local_rank, env.local_world_size,
                                                             torch.cuda.device_count())[0]
        return resolve_run(cfg, schedule_named="schedule" in given or "schedule" in from_file,
                           chunks_given="chunks" in given, seq_len_given="seq_len" in given or "seq_len" in from_file,
                           device=device, notes=tuple(notes))
    except ConfigError as e:
        raise blame(e, from_file, args.ds_config) from None


def run(args: argparse.Namespace, argv: list[str], main: Callable | None = None) -> int:
    """``mpt train``; the exit code. ``main``: the ``mpt`` entry point when this process is the ``mpt``
    command itself (a fresh interpreter that has run nothing else), so the ranks may be forked from it
    (`run.spawn`); None: ranks start as interpreters of their own."""
    env = launcher_env()
    plan = plan_run(args, env)  # no process group needed: every rank fails the same way before any talks
    cfg, dry_run = plan.cfg, args.dry_run is not UNSET
    if env is None or (env.rank == 0 and env.run_plan is None):  # once: the process the user started, or rank 0
        for line in plan.notes:
            print(line, flush=True)
    if env is None and dry_run:
        print(dry_run_report(cfg, plan.boundaries, plan.prediction, "mpt train itself"), flush=True)
        return 0
    if env is None:  # no launcher: start the pp*tp*dp ranks ourselves
        for path in (cfg.logging.metrics, cfg.logging.plot):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
        world, restarts = cfg.parallel.world_size, cfg.faults.restarts
        if world == 1 and not restarts and cfg.engine == "mp_toolkit":  # DeepSpeed reads a launcher's env
            return _run(plan, LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, faults=local_faults()))
        fork_with = main if main is not None and can_fork_ranks() else None
        return spawn_local(argv, world, restarts=restarts, save_dir=cfg.checkpoint.save_dir, fork_with=fork_with,
                           run_env={"MPT_RUN_PLAN": json.dumps(plan.to_json())})
    if cfg.faults.restarts and not env.started_by_mpt:
        raise ConfigError(f"--restarts {cfg.faults.restarts} is for mpt train starting the ranks itself; under a "
                          "launcher restart with it (torchrun --max-restarts N) and pass --resume auto")
    try:
        check_grid(env.world_size, cfg.parallel.pp, cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.cp)
    except GridError as e:
        raise ConfigError(f"the launcher started {env.world_size} processes: {e}") from None
    if dry_run:
        if env.rank == 0:
            print(dry_run_report(cfg, plan.boundaries, plan.prediction,
                                 f"the launcher (world size {env.world_size})"), flush=True)
        return 0
    return _run(plan, env)


def _run(plan: RunPlan, env: LaunchEnv) -> int:
    """Train this rank; a lost peer (exit 1), a diverged run (exit 3, said once by rank 0) and replicas that
    differ (exit 6, said by the rank that saw it) end in one line."""
    try:
        run_training(plan, env)
    except Diverged as e:
        if env.rank == 0:
            sys.stderr.write(f"mpt train: error: {e}\n")
        return EXIT_DIVERGED
    except Preempted as e:
        if env.rank == 0:
            sys.stderr.write(f"mpt train: {e}\n")
        return EXIT_PREEMPTED
    except ReplicasDiffer as e:
        if str(e):
            sys.stderr.write(f"mpt train: error: {e}\n")
        return EXIT_REPLICAS
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
