"""Per-rank peak memory of GPipe, 1F1B, ZB-H1, ZB-drain, interleaved 1F1B, ZB-V and DualPipeV in our
PipelineEngine, beside the
planner's prediction (issue 8, item 2); DeepSpeed's and torch.distributed.pipelining's 1F1B on the
same cut for comparison.

The workload is `tools.bench_pipeline`'s (GPT 8 x 256, vocabulary 8192 untied, 8 micro-batches
of 4 x 128, 2 stages, one thread per rank, AdamW, no clipping). For each schedule the planner
(`make_plan(PlanRequest(..., method="parameters", schedule=...))`) gives the cut -- our default,
the one `mpt train` uses -- and each stage's ``memory_bytes``, from its formulas and, unless
``--no-measure``, from layers measured on this machine (``measure=True``). The engine then
trains that very cut on 2 gloo ranks, and each rank reports its peak resident memory measured
with `mp_toolkit.partition.memstats`: large blocks mapped on their own (``map_large_blocks``), torch's
one-time costs paid (``warm_runtime``), the baseline ``anon_bytes()`` (resident memory less file
pages: library code is not counted) taken before the model is built, ``reset_peak()`` after the
first step, ``peak_anon_bytes()`` after the last. A rank that
holds two stages (interleaved; the V schedules, rank r: stages r and 2p-1-r) is compared with the
planner's prediction of the rank (its stages at once, placed by the schedule).

    python -m tools.bench_memory                # ~3 minutes on 2 quiet cores
    python -m tools.bench_memory --precision bf16 --no-measure --ours-only
    python -m tools.bench_memory --compare-free-sent --shape gpt-small-cpu   # issue 18, item 5

``--compare-recompute`` runs only our 1F1B with activation recomputation none, full and selective
(every block of each stage; issue 19), and ``auto`` under a cap 5% below the least the planner says
any cut fits without recomputation: per rank the peak resident memory (a ``memory`` run) and the
step time (a second run without the memory instrumentation, which slows kernels), beside the
planner's predictions (layers measured here unless ``--no-measure``).

    python -m tools.bench_memory --compare-recompute --shape gpt-small-cpu

``--no-free-sent`` runs our engine with ``free_sent_outputs=False`` (every stage output kept whole
until its backward). ``--compare-free-sent`` instead runs only our 1F1B, with the switch on and
then off, and reports per rank the peak RSS and the peak bytes held for stage outputs (stored
outputs plus in-flight send buffers, `tools.held_outputs`).

Prints a table and, last, one JSON line. Peak RSS is what the kernel saw, so other processes do
not change it; the timings of ``--measure`` do not enter the memory figures.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from mp_toolkit.partition import PartitionError
from mp_toolkit.partition.rates import gemm_tflops
from tools.peers import Workload, run_peer
from tools.predict import predict, rank_bytes, workload_config
from tools.ranks import RunError
from tools.report import header, json_line

MB = 1e6
SCHEDULES = [("GPipe", "gpipe", 1), ("1F1B", "1f1b", 1), ("ZBH1", "zbh1", 1), ("ZBDrain", "zbdrain", 1),
             ("Interleaved1F1B x2", "interleaved", 2), ("ZBVZeroBubble", "zbv", 2), ("DualPipeV", "dualpipev", 2)]


def plan_of(w: Workload, folder: Path, schedule: str, chunks: int, measure: bool, **request):
    """``mpt plan``'s plan of our engine on ``w``: the "parameters" cut unless ``request`` names another
    method; a GEMM timed here (``tflops`` None) beside a helper for the other rank (``load``)."""
    torch.set_num_threads(w.threads)
    cfg = workload_config(w, folder, schedule=schedule, chunks=chunks)
    return predict(cfg, **{"method": "parameters", "tflops": None, "load": True, "measure": measure, **request})


SHAPES = {  # --shape: the workload's model and micro-batch; bench is Workload's default
    "bench": {},
    # mpt train's defaults
    "gpt-small-cpu": dict(n_layer=4, n_embd=128, n_head=4, vocab=4096, seq_len=128, micro_batch=8),
}


def measure(w: Workload, spec: dict, steps: int, timeout: float) -> list[dict]:
    full = {**spec, "workload": w.__dict__, "warmup": 1, "steps": steps, "memory": True}
    return run_peer(full, w.pp, timeout_s=timeout, threads=w.threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=2, help="steps after the first (the peak is taken over them)")
    ap.add_argument("--no-measure", action="store_true", help="only the planner's formula prediction")
    ap.add_argument("--ours-only", action="store_true", help="skip the DeepSpeed and torch rows")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--free-sent", action=argparse.BooleanOptionalAction, default=True,
                    help="free_sent_outputs of our engine (default on)")
    ap.add_argument("--compare-free-sent", action="store_true",
                    help="only our 1F1B, free_sent_outputs on then off: peak RSS and peak bytes held for stage outputs")
    ap.add_argument("--compare-recompute", action="store_true",
                    help="only our 1F1B with --recompute none / full / selective / auto: peak memory and step time "
                         "beside the planner's predictions")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    args = ap.parse_args()
    head = header("bench_memory")
    w = Workload(precision=args.precision, **SHAPES[args.shape])
    if args.compare_free_sent:
        compare_free_sent(w, args.steps, args.timeout, head)
        return
    if args.compare_recompute:
        compare_recompute(w, args.steps, args.timeout, head, measure_layers=not args.no_measure)
        return
    rows, errors = [], {}
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        cut_1f1b = None
        for label, schedule, chunks in SCHEDULES:
            formula = plan_of(w, folder, schedule, chunks, measure=False)
            measured_plan = None if args.no_measure else plan_of(w, folder, schedule, chunks, measure=True)
            cut = list(formula.boundaries)
            cut_1f1b = cut if schedule == "1f1b" else cut_1f1b
            spec = {"peer": "mpt", "schedule": schedule, "chunks": chunks, "boundaries": cut,
                    "free_sent": args.free_sent}
            try:
                got = measure(w, spec, args.steps, args.timeout)
            except RunError as e:
                errors[label] = str(e)
                print(f"mpt {label}: FAILED\n{e}", flush=True)
                continue
            pf = rank_bytes(formula, w.pp)
            pm = rank_bytes(measured_plan, w.pp) if measured_plan else [None] * w.pp
            for r in got:
                rank = r["rank"]
                rows.append({"peer": f"mpt {label}", "rank": rank, "cut": cut,
                             "stages": [s.index for s in formula.stages
                                        if formula.timeline.schedule.stage_to_rank[s.index] == rank],
                             "pred_formula_bytes": pf[rank], "pred_measured_bytes": pm[rank],
                             "measured_bytes": r["peak_bytes"]})
            print(f"mpt {label:20s} cut {cut}: measured " +
                  " / ".join(f"{r['peak_bytes'] / MB:.1f}" for r in got) + " MB", flush=True)
        if not args.ours_only:
            others = (("deepspeed 1F1B (TrainSchedule)", {"peer": "deepspeed", "partition": "parameters"}),
                      ("torch Schedule1F1B", {"peer": "torch", "schedule": "1f1b", "boundaries": cut_1f1b}),
                      ("torch ScheduleGPipe", {"peer": "torch", "schedule": "gpipe", "boundaries": cut_1f1b}))
            for label, spec in others:
                try:
                    got = measure(w, spec, args.steps, args.timeout)
                except RunError as e:
                    errors[label] = str(e)
                    print(f"{label}: FAILED\n{e}", flush=True)
                    continue
                for r in got:
                    rows.append({"peer": label, "rank": r["rank"], "cut": r["boundaries"], "stages": [r["rank"]],
                                 "pred_formula_bytes": None, "pred_measured_bytes": None,
                                 "measured_bytes": r["peak_bytes"]})
                print(f"{label:24s} cut {got[0]['boundaries']}: measured " +
                      " / ".join(f"{r['peak_bytes'] / MB:.1f}" for r in got) + " MB", flush=True)
    print_table(rows, w)
    json_line("bench_memory", head, mode="schedules", workload=w.__dict__, rows=rows, errors=errors)


def compare_free_sent(w: Workload, steps: int, timeout: float, head: dict) -> None:
    """Our 1F1B on the planner's cut, free_sent_outputs on and off: a table and one JSON line."""
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        cut = list(plan_of(w, folder, "1f1b", 1, measure=False).boundaries)
    rows = []
    for free in (True, False):
        spec = {"peer": "mpt", "schedule": "1f1b", "boundaries": cut, "free_sent": free, "held_outputs": True}
        for r in measure(w, spec, steps, timeout):
            rows.append({"free_sent": free, "rank": r["rank"], "cut": cut, "peak_rss_bytes": r["peak_bytes"],
                         "held_outputs_peak_bytes": r["held_outputs_peak_bytes"],
                         "freed_bytes_last_step": r["freed_bytes_last_step"]})
    print(f"\n1F1B, pp={w.pp}, cut {cut}: {w.n_layer} x {w.n_embd}, vocab {w.vocab}, {w.microbatches} micro-batches of "
          f"{w.micro_batch} x {w.seq_len}, {w.precision}; bytes after the first step")
    print(f"{'free_sent':>9s} {'rank':>4s} {'held outputs peak':>18s} {'freed per step':>15s} {'peak RSS MB':>12s}")
    for r in rows:
        print(f"{str(r['free_sent']):>9s} {r['rank']:4d} {r['held_outputs_peak_bytes']:18,d} "
              f"{r['freed_bytes_last_step']:15,d} {r['peak_rss_bytes'] / MB:12.1f}")
    json_line("bench_memory", head, mode="free_sent", workload=w.__dict__, rows=rows)


def compare_recompute(w: Workload, steps: int, timeout: float, head: dict, measure_layers: bool) -> None:
    """Our 1F1B with recomputation none, full, selective and auto (under a cap 5% below the least
    the planner says any cut fits without recomputation): a table and one JSON line."""
    # one rate for every plan (each would measure its own GEMM otherwise, and a busy machine would
    # make the modes' predictions incomparable)
    rate = {} if measure_layers else {"tflops": gemm_tflops(w.precision)}

    rows = []
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        plans = {mode: plan_of(w, folder, "1f1b", 1, measure_layers, recompute=mode, **rate)
                 for mode in ("none", "full", "selective")}
        try:  # the least cap any cut fits without recomputation (the planner names it when asked for less)
            plan_of(w, folder, "1f1b", 1, measure_layers, method="memory", memory_gb=1e-6, **rate)
        except PartitionError as e:
            least_none = e.needed_gb
        cap_gb = 0.95 * least_none  # none cannot fit it, whatever the cut
        plans["auto"] = plan_of(w, folder, "1f1b", 1, measure_layers, recompute="auto", method="memory",
                                memory_gb=cap_gb, **rate)
    for mode, plan in plans.items():
        spec = {"peer": "mpt", "schedule": "1f1b", "boundaries": list(plan.boundaries),
                "recompute": [[c.mode, c.layers] for c in plan.recompute]}
        memory = measure(w, spec, steps, timeout)
        timed = run_peer({**spec, "workload": w.__dict__, "warmup": 1, "steps": steps}, w.pp, timeout_s=timeout,
                          threads=w.threads)
        step_s = [max(r["times"][i] for r in timed) for i in range(1, len(timed[0]["times"]))]  # after warm-up
        for r in memory:
            stage = plan.stages[r["rank"]]
            rows.append({"recompute": mode, "rank": r["rank"], "cut": list(plan.boundaries),
                         "choice": plan.recompute[r["rank"]].describe(
                             sum(n.rsplit(".", 1)[-1].isdigit() for n in
                                 [c.name for c in plan.layers[stage.first_layer:stage.last_layer + 1]]))
                         if plan.recompute else "none",
                         "pred_bytes": stage.memory_bytes, "measured_bytes": r["peak_bytes"],
                         "pred_step_ms": plan.step_time_ms, "measured_step_ms": 1e3 * min(step_s)})
        print(f"{mode:9s} cut {plan.boundaries}: peak " + " / ".join(f"{r['peak_bytes'] / MB:.1f}" for r in memory)
              + f" MB, step {1e3 * min(step_s):.0f} ms (predicted {plan.step_time_ms:.0f} ms)", flush=True)
    print(f"\n1F1B, pp={w.pp}: {w.n_layer} x {w.n_embd}, vocab {w.vocab}, {w.microbatches} micro-batches of "
          f"{w.micro_batch} x {w.seq_len}, {w.precision}, AdamW; auto under a {cap_gb:.3f} GB cap; peak RSS above the "
          f"pre-model baseline; step time: the fastest of {steps} steps after a warm-up")
    print(f"{'recompute':9s} {'rank':>4s} {'choice':>22s} {'pred MB':>8s} {'meas MB':>8s} {'error':>7s} "
          f"{'pred ms':>8s} {'meas ms':>8s} {'error':>7s}")
    for r in rows:
        print(f"{r['recompute']:9s} {r['rank']:4d} {r['choice']:>22s} {r['pred_bytes'] / MB:8.1f} "
              f"{r['measured_bytes'] / MB:8.1f} {r['pred_bytes'] / r['measured_bytes'] - 1:+7.1%} "
              f"{r['pred_step_ms']:8.0f} {r['measured_step_ms']:8.0f} "
              f"{r['pred_step_ms'] / r['measured_step_ms'] - 1:+7.1%}")
    json_line("bench_memory", head, mode="recompute", workload=w.__dict__, cap_gb=cap_gb, rows=rows)


def print_table(rows: list[dict], w: Workload) -> None:
    print(f"\npeak resident memory per rank above its pre-model baseline, MB; {w.n_layer} x {w.n_embd}, vocab "
          f"{w.vocab} (untied), {w.microbatches} micro-batches of {w.micro_batch} x {w.seq_len}, {w.precision}, AdamW")
    print(f"{'peer':32s} {'rank':>4s} {'stages':>7s} {'predicted':>10s} {'(measured':>10s} {'measured':>9s} "
          f"{'error':>7s} {'error)':>7s}")
    fmt = lambda b: f"{b / MB:10.1f}" if b is not None else f"{'-':>10s}"  # noqa: E731
    err = lambda p, m: f"{p / m - 1:+7.1%}" if p is not None and m else f"{'-':>7s}"  # noqa: E731
    for r in rows:
        got = r["measured_bytes"]
        print(f"{r['peer']:32s} {r['rank']:4d} {','.join(map(str, r['stages'])):>7s} {fmt(r['pred_formula_bytes'])} "
              f"{fmt(r['pred_measured_bytes'])} {got / MB:9.1f} "
              f"{err(r['pred_formula_bytes'], got)} {err(r['pred_measured_bytes'], got)}")
    print("predicted: the planner's formulas; (measured: the planner with layers measured here); error = predicted / "
          "measured - 1")


if __name__ == "__main__":
    main()
