"""`mpt plan`: cut a model into stages and predict each stage's time and memory, the bubble and the
throughput (`mp_toolkit.partition.planner`); ``--schedule auto`` plans every candidate; ``--search``
every layout for a device count and global batch (`mp_toolkit.partition.search`); ``--profile-here``
measures this machine's device profile (`mp_toolkit.partition.profile_here`)."""

from __future__ import annotations

import argparse
import dataclasses

from mp_toolkit.commands.simulate import check_output, chunks_of
from mp_toolkit.errors import PartitionError
from mp_toolkit.partition.auto_schedule import fastest_schedule
from mp_toolkit.partition.cluster import read_profile
from mp_toolkit.partition.planner import PlanRequest, make_plan
from mp_toolkit.partition.profile_here import measure_profile, write_profile
from mp_toolkit.partition.report import draw_plan_gantt, format_plan, write_json
from mp_toolkit.partition.search import SearchRequest, search, with_devices
from mp_toolkit.partition.search_report import format_search, search_json


def _make_plan(req: PlanRequest):
    """The plan of ``req``; ``--schedule auto`` plans every candidate and says which it took."""
    if req.schedule != "auto":
        return make_plan(req)
    choice = fastest_schedule(req)
    print(choice.describe())
    return choice.plan


def _profile_here(args: argparse.Namespace) -> int:
    profile = measure_profile(args.model, ranks=2, precisions=None, micro_batch=args.micro_batch,
                              seq_len=args.seq_len, hf=args.hf, calibrated=args.calibrate)
    path = write_profile(profile, args.profile_here)
    print(profile.describe())
    print(f"wrote {path}: pass it to mpt plan --cluster and mpt train --cluster")
    return 0


def _search(args: argparse.Namespace) -> int:
    for flag, value in (("--devices", args.devices), ("--global-batch", args.global_batch)):
        if value is None:
            raise PartitionError(f"--search needs {flag}")
        if value < 1:
            raise PartitionError(f"{flag} {value} must be a positive integer")
    if args.cluster is not None:
        cluster = read_profile(args.cluster)
    else:  # this machine, measured now; every rank on it
        cluster = measure_profile(args.model, ranks=2, hf=args.hf)
        cluster = dataclasses.replace(cluster, devices_per_node=args.devices)
    req = SearchRequest(model=args.model, devices=args.devices, global_batch=args.global_batch, seq_len=args.seq_len,
                        cluster=with_devices(cluster, args.devices), precision=args.precision,
                        optimizer=args.optimizer, momentum=args.momentum, weight_decay=args.weight_decay, hf=args.hf,
                        memory_gb=args.memory_gb, top=args.top, max_micro_batch=args.max_micro_batch,
                        sequence_parallel=args.search_sp, context_parallel=args.search_cp)
    result = search(req)
    print(format_search(result))
    if args.json:
        write_json(search_json(result), args.json)
    return 0 if result.best else 2


def run(args: argparse.Namespace, argv: list[str], main=None) -> int:
    """``mpt plan``; the exit code."""
    if args.profile_here is not None:
        return _profile_here(args)
    if args.calibrate:
        raise PartitionError("--calibrate fits a measured profile: give it with --profile-here OUT")
    if args.search:
        return _search(args)
    req = PlanRequest(
        model=args.model, pp=args.pp, tp=args.tp, dp=args.dp, micro_batch=args.micro_batch,
        microbatches=args.microbatches, seq_len=args.seq_len, method=args.method, memory_gb=args.memory_gb,
        precision=args.precision, optimizer=args.optimizer, momentum=args.momentum, weight_decay=args.weight_decay,
        schedule=args.schedule, chunks=chunks_of(args),
        tflops=args.tflops, measure=args.measure, threads=args.threads, load=args.load,
        p2p_latency_us=args.p2p_latency_us, p2p_gbps=args.p2p_gbps,
        mem_gbps=args.mem_gbps, hf=args.hf, recompute=args.recompute, recompute_layers=args.recompute_layers,
        zero=args.zero, cluster=read_profile(args.cluster) if args.cluster is not None else None,
        sequence_parallel=args.sequence_parallel, cp=args.cp, cp_attention=args.cp_attention,
    )
    check_output(args.gantt)
    plan = _make_plan(req)
    print(format_plan(plan))
    if args.json:
        write_json(plan.to_json(), args.json)
    if args.gantt:
        draw_plan_gantt(plan, args.gantt)
    return 0
