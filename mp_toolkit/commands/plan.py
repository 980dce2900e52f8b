"""`mpt plan`: cut a model into stages and predict each stage's time and memory, the bubble and the
throughput (`mp_toolkit.partition.planner`); ``--schedule auto`` plans every candidate."""

from __future__ import annotations

import argparse

from mp_toolkit.commands.simulate import check_output, chunks_of
from mp_toolkit.partition.auto_schedule import fastest_schedule
from mp_toolkit.partition.planner import PlanRequest, make_plan
from mp_toolkit.partition.report import draw_plan_gantt, format_plan, write_json


def _make_plan(req: PlanRequest):
    """The plan of ``req``; ``--schedule auto`` plans every candidate and says which it took."""
    if req.schedule != "auto":
        return make_plan(req)
    choice = fastest_schedule(req)
    print(choice.describe())
    return choice.plan


def run(args: argparse.Namespace, argv: list[str], main=None) -> int:
    """``mpt plan``; the exit code."""
    req = PlanRequest(
        model=args.model, pp=args.pp, tp=args.tp, dp=args.dp, micro_batch=args.micro_batch,
        microbatches=args.microbatches, seq_len=args.seq_len, method=args.method, memory_gb=args.memory_gb,
        precision=args.precision, optimizer=args.optimizer, momentum=args.momentum, weight_decay=args.weight_decay,
        schedule=args.schedule, chunks=chunks_of(args),
        tflops=args.tflops, measure=args.measure, threads=args.threads, load=args.load,
        p2p_latency_us=args.p2p_latency_us, p2p_gbps=args.p2p_gbps,
        mem_gbps=args.mem_gbps, hf=args.hf, recompute=args.recompute, recompute_layers=args.recompute_layers,
        zero=args.zero,
    )
    check_output(args.gantt)
    plan = _make_plan(req)
    print(format_plan(plan))
    if args.json:
        write_json(plan.to_json(), args.json)
    if args.gantt:
        draw_plan_gantt(plan, args.gantt)
    return 0
