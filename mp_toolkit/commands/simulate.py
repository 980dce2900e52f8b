"""`mpt simulate`: a schedule's timeline, bubble and peak in-flight micro-batches from unit or given
costs (`mp_toolkit.schedule.simulate_report`)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from mp_toolkit.errors import ConfigError
from mp_toolkit.names import stages_per_rank
from mp_toolkit.partition.report import write_json
from mp_toolkit.partition.request import MAX_MICROBATCHES, too_many_microbatches
from mp_toolkit.schedule import simulate_report


def chunks_of(args: argparse.Namespace) -> int:
    """``--chunks``, or its default: 2 for the interleaved and the V schedules, else 1 (`stages_per_rank`)."""
    return args.chunks if args.chunks is not None else stages_per_rank(args.schedule)


def check_output(gantt: Path | None) -> None:
    """``--gantt`` names a file matplotlib can write."""
    if gantt is not None and gantt.suffix.lower() not in (".png", ".svg"):
        raise ConfigError(f"--gantt {gantt} must end in .png or .svg")


def run(args: argparse.Namespace, argv: list[str], main=None) -> int:
    """``mpt simulate``; the exit code."""
    if args.microbatches is not None and too_many_microbatches(args.microbatches):
        raise ConfigError(too_many_microbatches(args.microbatches))
    for name, top in (("pp", 1024), ("microbatches", MAX_MICROBATCHES), ("chunks", 64)):
        value = getattr(args, name)
        if value is not None and not 1 <= value <= top:
            raise ConfigError(f"--{name} {value} must be between 1 and {top}")
    if not (math.isfinite(args.cost_f) and math.isfinite(args.cost_b) and args.cost_f > 0 and args.cost_b > 0):
        raise ConfigError(f"--cost-f {args.cost_f:g} and --cost-b {args.cost_b:g} must be positive")
    check_output(args.gantt)
    try:
        report = simulate_report(args.schedule, args.pp, args.microbatches, chunks_of(args),
                                 {"F": args.cost_f, "B": args.cost_b}, gantt=str(args.gantt) if args.gantt else None)
    except ValueError as e:  # sizes the schedule cannot take: one line, as mpt plan and mpt train say it
        raise ConfigError(str(e)) from None
    print(f"{report['schedule']}: pp={report['pp']} microbatches={report['microbatches']} "
          f"chunks={report['chunks']}: step time {report['step_time']:g}, "
          f"bubble fraction {report['bubble_fraction']:.4f}, peak in-flight per stage {report['peak_inflight']}, "
          f"per rank {report['peak_inflight_rank']}")
    if report["chunks"] > 1:
        print("stage -> rank: " + " ".join(f"{s}:{r}" for s, r in enumerate(report["placement"])))
    if args.print_grid:
        print(report["grid"])
    if args.json:
        write_json(report, args.json)
    return 0
