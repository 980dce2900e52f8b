"""mp_toolkit's PipelineEngine beside DeepSpeed's PipelineEngine, torch.distributed.pipelining and
single-process gradient accumulation, on one GPT workload (issue 8).

Workload (defaults): GPT of 8 blocks, width 256, 8 heads, sequence 128, vocabulary 8192, embedding
and LM head *untied* (every peer trains the same untied model, so none needs tied-weight
machinery); 8 micro-batches of 4 per step, 2 pipeline stages, one thread per rank; AdamW
(lr 1e-3, weight decay 0.01), gradient clipping off for every peer (DeepSpeed's pipeline engine
would count only part of the model in its clip norm); fp32, or ``--precision bf16`` (bf16
compute, fp32 master weights in every peer).

Peers (each the real library, `tools.peers`):

* mp_toolkit: 1F1B, GPipe, ZB-H1, interleaved 1F1B with 2 chunks on our default "parameters"
  cut (`mp_toolkit.run.cut.plan_boundaries`); 1F1B, ZB-H1 and ZB-drain on the planner's "flops" cut,
  interleaved on its "flops" cut into 2 stages per rank, ZB-V and DualPipeV on its V cut (the "flops" cut
  that balances ranks of two stages), as ``mpt train`` runs them, and ZB-V and DualPipeV on the same V cut
  with the peers' optimizer and heap; 1F1B on the planner's "time" cut
  (`make_plan(method="time")`, layers measured here first, ~20 s; ``--no-time-cut`` skips it),
  and interleaved on the planner's "flops" cut (deterministic; the time cut of 4 chunks moves
  with machine noise);
* DeepSpeed 0.19 (DS_ACCELERATOR=cpu, gloo): ``PipelineModule`` with ``partition_method``
  "parameters" and "uniform", ``PipelineEngine.train_batch`` (its 1F1B TrainSchedule);
* torch.distributed.pipelining: ``PipelineStage`` built by hand per stage, ``Schedule1F1B`` and
  ``ScheduleGPipe`` on our "parameters" cut, ``Schedule1F1B`` on the "flops" and "time" cuts,
  ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` on the planner's "flops" cut into
  2 chunks per rank, ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (rank r holds stages r and
  2p-1-r) on the planner's V cut;
* one process, plain gradient accumulation (T1, for the bound).

Rows "as mpt train" (and "mpt defaults") run our engine as ``mpt train`` does on CPU: fused
AdamW and the heap that keeps freed pages (`mp_toolkit.partition.memstats.DeviceMemory.keep_freed`); the
"heap kept" rows give DeepSpeed and the single process the same heap, so the table shows how
much of a margin is the heap. A row's efficiency is against the bound of the single process on
the same heap.

All build the same weights from the same seed and see the same batches. After the first round
the program prints the check that they train the same model (parameter count, first loss within
1e-5 of the single process's, and the loss after the last step) and exits 1 at the end if it
failed. Runs alternate between peers, the order reversed every other round (round 1: A B C ...,
round 2: ... C B A; the first run of a round measured 1-3% slow, and no row should always be it);
each run is a fresh set of processes, timing ``--steps`` steps after ``--warmup`` warm-up steps;
a step's time runs from a barrier to the end of its slowest rank. A peer's figure is the median
over all its timed steps. pp=2 efficiency = tokens/s / (2 * T1 * m / (m + p - 1)), the 1F1B bound.
Each rank's process CPU time per step is shown too: it counts work, not waiting, so it is the
figure that other load on the machine disturbs least.

    python -m tools.bench_pipeline                    # the full table: ~9 minutes on 2 quiet cores
                                                      # (12.5 measured on 2 shared, loaded ones)
    python -m tools.bench_pipeline --precision bf16
    python -m tools.bench_pipeline --rounds 1 --steps 5 --only 'mpt 1F1B|deepspeed'
    python -m tools.bench_pipeline --profile          # where mp_toolkit's (and DeepSpeed's) time goes, per rank
    python -m tools.bench_pipeline --side-by-side 3   # issue 23: three runs of our defaults against DeepSpeed's
                                                      # defaults and every torch schedule (~10 min a run, 2 cores)
    python -m tools.bench_pipeline --side-by-side 3 --control   # and the control row (below)

The control row, "mpt control", is our defaults' run (same schedule, chunks and cut) with what the
peers' rows run: torch's AdamW (foreach) on glibc's default heap, so that beside it the rows "as mpt
train" show what fused AdamW and the kept heap add, and the rest is the engine.

Prints the machine header first (`tools.report`), then a table and, last, one JSON line. Nothing
else should run on the machine meanwhile.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mp_toolkit.layers import LayerList
from mp_toolkit.run.cut import plan_boundaries
from tools import pipeline_profile
from tools.peers import Workload, build_gpt, run_peer
from tools.predict import predict, resolve_run, workload_config
from tools.ranks import RunError
from tools.report import header, json_line
from tools.side_by_side import CONTROL, side_by_side

FIRST_LOSS_TOL = 1e-5  # the first loss depends only on the weights and the batch: every peer's is the same
AS_TRAIN = {"optimizer": "mpt", "keep_freed_memory": True}
"""What ``mpt train`` adds to an engine run: fused AdamW (`peers.optimizer`) and the heap that keeps
freed pages (`peers.train`); a spec without them steps torch's AdamW (foreach) on glibc's default heap."""


def planner_cut(w: Workload, method: str, chunks: int = 1, schedule: str | None = None) -> list[int]:
    """The planner's cut into ``pp * chunks`` stages: ``method="time"`` measures each layer here
    with ``w.threads`` threads (~20 s); ``"flops"`` counts matrix FLOPs (only their ratios matter,
    so no GEMM is timed). ``schedule`` a V one: the cut that balances ranks of two stages
    (`mp_toolkit.partition.vcut.min_max_v`), as ``mpt train --schedule zbv`` cuts."""
    torch.set_num_threads(w.threads)
    schedule = schedule or ("interleaved" if chunks > 1 else "1f1b")
    with tempfile.TemporaryDirectory() as d:
        cfg = workload_config(w, Path(d), schedule=schedule, chunks=chunks)
        plan = predict(cfg, method=method, tflops=1.0 if method == "flops" else None, load=True)
    return list(plan.boundaries)


def defaults_of(w: Workload) -> tuple[str, int, list[int]]:
    """The schedule, model chunks per rank and cut ``mpt train`` runs on this workload when no schedule
    is named: its run plan (`mp_toolkit.run.plan.resolve_run`)."""
    with tempfile.TemporaryDirectory() as d:
        run = resolve_run(workload_config(w, Path(d)), schedule_named=False, device=torch.device("cpu"))
    return run.cfg.parallel.schedule, run.cfg.parallel.chunks, list(run.boundaries)


def default_cut(w: Workload, chunks: int = 1) -> list[int]:
    with torch.device("meta"):
        layers = LayerList.from_model(build_gpt(w))
    return plan_boundaries(layers, w.pp, "parameters", chunks)


def peer_runs(w: Workload, tcut: list[int] | None, fcut: list[int], fcut2: list[int],
              vcut: list[int]) -> list[tuple[str, dict, int]]:
    """(label, spec, processes) of every run, in the order a round visits them. ``tcut``: the
    planner's time cut (None: no time-cut runs); ``fcut``: its FLOPs cut (``mpt train``'s default
    partition), ``fcut2`` into 2 chunks per rank, ``vcut`` for a V placement (`planner_cut`). Rows "as mpt
    train" (and "mpt defaults") run as ``mpt train`` does (`AS_TRAIN`); every other row, the control
    row (`CONTROL`: our defaults' run) among them, steps the same torch AdamW (foreach) on glibc's
    default heap, so those compare engines alone. "deepspeed uniform, heap kept" and "single
    process, heap kept" give DeepSpeed and the single process the heap ``mpt train`` keeps."""
    pcut = default_cut(w)
    schedule, chunks, cut = defaults_of(w)  # as `mpt train` without --schedule runs it
    defaults = {"peer": "mpt", "schedule": schedule, "chunks": chunks, "boundaries": cut}
    named = f"{schedule}{f' x{chunks}' if chunks > 1 else ''}"
    runs = [(f"mpt defaults ({named}, the planner's cut, fused AdamW)", {**defaults, **AS_TRAIN}, w.pp),
            (f"{CONTROL} ({named}, foreach AdamW, glibc heap)", defaults, w.pp),
            ("mpt 1F1B flops cut, as mpt train", {"peer": "mpt", "schedule": "1f1b", "boundaries": fcut, **AS_TRAIN},
             w.pp),
            ("mpt ZBH1 flops cut, as mpt train", {"peer": "mpt", "schedule": "zbh1", "boundaries": fcut, **AS_TRAIN},
             w.pp),
            ("mpt ZBDrain flops cut, as mpt train",
             {"peer": "mpt", "schedule": "zbdrain", "boundaries": fcut, **AS_TRAIN}, w.pp),
            ("mpt Interleaved1F1B x2 flops cut, as mpt train",
             {"peer": "mpt", "schedule": "interleaved", "chunks": 2, "boundaries": fcut2, **AS_TRAIN}, w.pp),
            ("mpt ZBVZeroBubble V cut, as mpt train",
             {"peer": "mpt", "schedule": "zbv", "chunks": 2, "boundaries": vcut, **AS_TRAIN}, w.pp),
            ("mpt DualPipeV V cut, as mpt train",
             {"peer": "mpt", "schedule": "dualpipev", "chunks": 2, "boundaries": vcut, **AS_TRAIN}, w.pp),
            ("mpt ZBVZeroBubble V cut", {"peer": "mpt", "schedule": "zbv", "chunks": 2, "boundaries": vcut}, w.pp),
            ("mpt DualPipeV V cut", {"peer": "mpt", "schedule": "dualpipev", "chunks": 2, "boundaries": vcut}, w.pp),
            ("mpt 1F1B", {"peer": "mpt", "schedule": "1f1b"}, w.pp),
            ("mpt GPipe", {"peer": "mpt", "schedule": "gpipe"}, w.pp),
            ("mpt ZBH1", {"peer": "mpt", "schedule": "zbh1"}, w.pp),
            ("mpt Interleaved1F1B x2", {"peer": "mpt", "schedule": "interleaved", "chunks": 2}, w.pp)]
    if tcut is not None and tcut != pcut:
        runs.append(("mpt 1F1B time cut", {"peer": "mpt", "schedule": "1f1b", "boundaries": tcut}, w.pp))
    if fcut2 != default_cut(w, 2):
        runs.append(("mpt Interleaved1F1B x2 flops cut",
                     {"peer": "mpt", "schedule": "interleaved", "chunks": 2, "boundaries": fcut2}, w.pp))
    runs += [("deepspeed parameters", {"peer": "deepspeed", "partition": "parameters"}, w.pp),
             ("deepspeed uniform", {"peer": "deepspeed", "partition": "uniform"}, w.pp),
             ("deepspeed uniform, heap kept", {"peer": "deepspeed", "partition": "uniform",
                                               "keep_freed_memory": True}, w.pp),
             ("torch Schedule1F1B", {"peer": "torch", "schedule": "1f1b", "boundaries": pcut}, w.pp),
             ("torch ScheduleGPipe", {"peer": "torch", "schedule": "gpipe", "boundaries": pcut}, w.pp),
             ("torch ScheduleInterleaved1F1B flops cut",
              {"peer": "torch", "schedule": "interleaved", "boundaries": fcut2}, w.pp),
             ("torch ScheduleInterleavedZeroBubble flops cut",
              {"peer": "torch", "schedule": "interleavedzb", "boundaries": fcut2}, w.pp),
             ("torch ScheduleZBVZeroBubble V cut", {"peer": "torch", "schedule": "zbv", "boundaries": vcut}, w.pp),
             ("torch ScheduleDualPipeV V cut", {"peer": "torch", "schedule": "dualpipev", "boundaries": vcut}, w.pp)]
    if fcut != pcut:
        runs.append(("torch Schedule1F1B flops cut", {"peer": "torch", "schedule": "1f1b", "boundaries": fcut}, w.pp))
    if tcut is not None and tcut != pcut:
        runs.append(("torch Schedule1F1B time cut", {"peer": "torch", "schedule": "1f1b", "boundaries": tcut}, w.pp))
    runs += [("single process (T1)", {"peer": "single"}, 1),
             ("single process, heap kept", {"peer": "single", "keep_freed_memory": True}, 1)]
    return runs


def summarise(results: list[dict], warmup: int) -> dict:
    """One run: per-step time of the slowest rank, the loss curve, parameters over all ranks."""
    steps = [max(r["times"][i] for r in results) for i in range(len(results[0]["times"]))]
    losses = [next((r["losses"][i] for r in results if r["losses"][i] is not None), None)
              for i in range(len(steps))]
    return {"step_s": steps[warmup:], "cpu_s": [r["cpu_times"][warmup:] for r in results],
            "losses": losses, "params": sum(r["params"] for r in results),
            "boundaries": results[0]["boundaries"], "threads": [r["threads"] for r in results],
            "dtype": sorted({r["dtype"] for r in results})}


def check_same_model(rows: dict, w: Workload) -> dict:
    """Same parameter count and the same first (and last) loss as the single process."""
    ref = rows["single process (T1)"]
    tol = FIRST_LOSS_TOL
    out = {"reference_params": ref["params"], "reference_first_loss": ref["losses"][0], "tolerance": tol,
           "peers": {}}
    print(f"\ncheck: every peer trains the same model (reference: single process, {ref['params']:,} parameters, "
          f"first loss {ref['losses'][0]:.8f})")
    ok_all = True
    for label, r in rows.items():
        d0 = abs(r["losses"][0] - ref["losses"][0])
        dn = abs(r["losses"][-1] - ref["losses"][-1])
        ok = r["params"] == ref["params"] and d0 <= tol
        ok_all &= ok
        out["peers"][label] = {"params": r["params"], "first_loss": r["losses"][0], "first_loss_diff": d0,
                               "last_loss_diff": dn, "compute_dtype": r["dtype"], "ok": ok}
        print(f"  {label:32s} params {r['params']:>11,}  first loss {r['losses'][0]:.8f} (|d| {d0:.1e})  "
              f"loss after {len(r['losses']) - 1} steps |d| {dn:.1e}  {'/'.join(r['dtype'])}  "
              f"{'ok' if ok else 'MISMATCH'}")
    out["ok"] = ok_all
    print(f"  -> {'all peers agree' if ok_all else 'PEERS DISAGREE'} (first loss within {tol:g}, same parameter count)")
    return out


def print_table(table: list[dict], w: Workload, t1: float, bound: float) -> None:
    print(f"\n{w.n_layer} blocks x {w.n_embd}, {w.n_head} heads, seq {w.seq_len}, vocab {w.vocab} (untied), "
          f"{w.microbatches} micro-batches of {w.micro_batch}, pp {w.pp}, {w.threads} thread/rank, AdamW, "
          f"{w.precision}, no clipping; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"T1 (single process) {t1:,.0f} tokens/s; 1F1B bound 2*T1*m/(m+p-1) = {bound:,.0f} tokens/s")
    print(f"{'peer':56s} {'cut':>13s} {'tokens/s':>9s} {'step ms':>8s} {'runs (ms)':>17s} {'best mpt/x':>10s} "
          f"{'eff.':>6s} {'CPU ms/step':>12s}")
    for r in table:
        runs = "/".join(f"{m:.0f}" for m in r["run_median_ms"])
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "  -"
        cpu = "/".join(f"{c:.0f}" for c in r["cpu_ms_per_rank"])
        print(f"{r['label']:56s} {str(r['boundaries']).replace(' ', ''):>13s} {r['tokens_per_s']:9.0f} "
              f"{r['step_ms']:8.0f} {runs:>17s} {r['best_mpt_ratio']:10.2f} {eff:>6s} {cpu:>12s}")
    print("runs: each run's median step; best mpt/x: the best mp_toolkit row's tokens/s over this row's; eff.: "
          "tokens/s over the 1F1B bound (of the single process on the same heap); "
          "CPU ms/step: process CPU time per step of each rank (work, not waiting: "
          "the figure other load on the machine changes least)")


def bench(args, w: Workload) -> dict:
    tcut = None if args.no_time_cut else planner_cut(w, "time")
    fcut, fcut2, vcut = planner_cut(w, "flops"), planner_cut(w, "flops", 2), planner_cut(w, "flops", 2, "zbv")
    runs = [r for r in peer_runs(w, tcut, fcut, fcut2, vcut) if re.search(args.only, r[0]) or r[2] == 1]
    print(f"planned cuts: parameters {default_cut(w)} (x2 chunks {default_cut(w, 2)}), time {tcut}, "
          f"flops {fcut} (x2 chunks {fcut2}), V {vcut}; {len(runs)} runs x {args.rounds} rounds", flush=True)
    pooled: dict[str, dict] = {}
    errors: dict[str, str] = {}
    check = None
    for rnd in range(args.rounds):
        for label, spec, nprocs in (runs if rnd % 2 == 0 else runs[::-1]):
            if label in errors:
                continue
            full = {**spec, "workload": w.__dict__, "warmup": args.warmup, "steps": args.steps}
            t = time.perf_counter()
            try:
                s = summarise(run_peer(full, nprocs, timeout_s=args.timeout, threads=w.threads), args.warmup)
            except RunError as e:
                errors[label] = str(e)
                print(f"round {rnd + 1} {label}: FAILED\n{e}", flush=True)
                continue
            med = statistics.median(s["step_s"])
            row = pooled.setdefault(label, {**s, "step_s": [], "cpu_s": [[] for _ in range(nprocs)],
                                            "run_median_ms": [], "spec": spec})
            row["step_s"] += s["step_s"]
            for mine, got in zip(row["cpu_s"], s["cpu_s"]):
                mine += got
            row["run_median_ms"].append(1e3 * med)
            print(f"round {rnd + 1} {label:32s} {1e3 * med:7.0f} ms/step  ({time.perf_counter() - t:.0f} s wall)",
                  flush=True)
        if rnd == 0 and "single process (T1)" in pooled:
            check = check_same_model(pooled, w)
    def tokens_per_s(label: str) -> float:
        r = pooled.get(label)
        return w.tokens_per_step / statistics.median(r["step_s"]) if r else float("nan")

    m, p = w.microbatches, w.pp
    t1, t1_kept = tokens_per_s("single process (T1)"), tokens_per_s("single process, heap kept")
    bound = p * t1 * m / (m + p - 1)
    # a row's efficiency is against the single process on the same heap (when that row ran)
    bounds = {False: bound, True: p * t1_kept * m / (m + p - 1) if t1_kept == t1_kept else bound}
    table = []
    for label, r in pooled.items():
        tok = w.tokens_per_step / statistics.median(r["step_s"])
        table.append({"label": label, "boundaries": r["boundaries"], "tokens_per_s": tok,
                      "step_ms": 1e3 * statistics.median(r["step_s"]), "run_median_ms": r["run_median_ms"],
                      "cpu_ms_per_rank": [1e3 * statistics.median(c) for c in r["cpu_s"]],
                      "efficiency": (tok / bounds[bool(r["spec"].get("keep_freed_memory"))]
                                     if r["spec"]["peer"] != "single" else None),
                      "first_loss": r["losses"][0], "last_loss": r["losses"][-1], "params": r["params"],
                      "threads": r["threads"]})
    ours = [r for r in table if r["label"].startswith("mpt")]
    best = max(ours, key=lambda r: r["tokens_per_s"]) if ours else None
    for r in table:
        r["best_mpt_ratio"] = best["tokens_per_s"] / r["tokens_per_s"] if best else float("nan")
    print_table(table, w, t1, bound)
    print(f"single process, heap kept: {t1_kept:,.0f} tokens/s, its 1F1B bound {bounds[True]:,.0f}: the bound for "
          f"the rows run with the heap kept")
    if best:
        print(f"best mp_toolkit: {best['label']} ({best['tokens_per_s']:.0f} tokens/s)")
    for label, e in errors.items():
        print(f"{label}: could not run: {e.splitlines()[-1]}")
    return {"t1_tokens_per_s": t1, "bound_tokens_per_s": bound, "t1_heap_kept_tokens_per_s": t1_kept,
            "bound_heap_kept_tokens_per_s": bounds[True], "best_mpt": best["label"] if best else None,
            "time_cut": tcut, "flops_cut": fcut, "flops_cut_x2": fcut2, "v_cut": vcut,
            "parameters_cut": default_cut(w), "parameters_cut_x2": default_cut(w, 2), "check": check, "peers": table,
            "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every peer, alternating (A B ..., then ... B A)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    ap.add_argument("--threads", type=int, default=1, help="threads per rank (and for the single process)")
    ap.add_argument("--only", default="", help="regex over peer labels (the single process always runs)")
    ap.add_argument("--no-time-cut", action="store_true", help="skip the planner's measured 'time' cut")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run before its ranks are killed")
    ap.add_argument("--profile", action="store_true", help="profile mp_toolkit's 1F1B per rank instead")
    ap.add_argument("--side-by-side", type=int, default=0, metavar="N",
                    help="issue 23: N separate runs of our defaults, 1F1B, DeepSpeed's defaults and torch's "
                         "schedules, and a table of the ratios per run (implies --no-time-cut)")
    ap.add_argument("--control", action="store_true",
                    help="with --side-by-side: also the control row, our defaults with the peers' foreach AdamW "
                         "on the default heap")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        raise SystemExit("--steps and --rounds must be at least 1, --warmup at least 0")
    head = header("bench_pipeline")
    w = Workload(precision=args.precision, threads=args.threads)
    if args.side_by_side:
        args.no_time_cut = True
        mode, result = "side_by_side", side_by_side(args, w, args.side_by_side, bench)
    elif args.profile:
        tcut = None if args.no_time_cut else planner_cut(w, "time")
        mode, result = "profile", pipeline_profile.run(args, w, default_cut(w), tcut)
    else:
        mode, result = "table", bench(args, w)
    json_line("bench_pipeline", head, mode=mode, workload=w.__dict__, rounds=args.rounds, steps=args.steps,
              warmup=args.warmup, **result)
    if result.get("check") is not None and not result["check"]["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
