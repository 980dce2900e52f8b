"""How long ``mpt plan --search`` takes, and how much of the space it plans (issue 36's goal: GPT-2-XL
on 64 devices in under 10 s on one core).

    python -m tools.bench_search            # the cases below, each searched --repeats times (default 3)

Each case is searched in this process (one core: the planner is single-threaded Python) with the
shipped specification profile named, after one warm-up search of a small case (imports, first
schedules built). Prints the machine header (`tools.report`), per case the layouts considered,
planned in full and never planned (their step-time bound above the k-th best), the median and
largest wall time, and the pick; last, one JSON line. Nothing else should run on the machine.
"""
from __future__ import annotations

import argparse
import statistics
import time

from mp_toolkit.partition.cluster import read_profile
from mp_toolkit.partition.search import SearchRequest, search, with_devices
from tools.report import header, json_line

# (label, model, profile, devices, global batch, seq len, precision)
CASES = [
    ("gpt2-xl 64 x h100", "gpt2-xl", "h100-sxm", 64, 512, 1024, "bf16"),
    ("gpt2-xl 64 x a100", "gpt2-xl", "a100-sxm-80gb", 64, 512, 1024, "bf16"),
    ("gpt2-xl 16 x h100", "gpt2-xl", "h100-sxm", 16, 256, 1024, "bf16"),
    ("gpt2-medium 8 x l4", "gpt2-medium", "l4", 8, 64, 1024, "bf16"),
    ("bert-large 32 x a100", "bert-large", "a100-sxm-80gb", 32, 1024, 512, "fp16"),
]


def run_case(model: str, profile: str, devices: int, batch: int, seq: int, precision: str):
    req = SearchRequest(model=model, devices=devices, global_batch=batch, seq_len=seq, precision=precision,
                        cluster=with_devices(read_profile(profile), devices))
    t0 = time.perf_counter()
    result = search(req)
    return time.perf_counter() - t0, result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    head = header("bench_search")
    run_case("gpt-tiny", "h100-sxm", 4, 16, 64, "bf16")  # warm-up
    rows = []
    print(f"{'case':24s} {'layouts':>8s} {'planned':>8s} {'bounded':>8s} {'median s':>9s} {'max s':>7s}  pick")
    for label, model, profile, devices, batch, seq, precision in CASES:
        times, result = [], None
        for _ in range(args.repeats):
            seconds, result = run_case(model, profile, devices, batch, seq, precision)
            times.append(seconds)
        pick = result.best[0][0].describe() if result.best else "none fits"
        row = {"case": label, "considered": result.considered, "planned": result.planned, "bounded": result.bounded,
               "median_s": statistics.median(times), "max_s": max(times), "pick": pick,
               "step_ms": result.best[0][1].step_time_ms if result.best else None}
        rows.append(row)
        print(f"{label:24s} {row['considered']:8d} {row['planned']:8d} {row['bounded']:8d} {row['median_s']:9.2f} "
              f"{row['max_s']:7.2f}  {pick}")
    json_line("bench_search", head, rows=rows)


if __name__ == "__main__":
    main()
