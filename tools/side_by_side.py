"""``python -m tools.bench_pipeline --side-by-side N`` (issue 23): N separate runs of our defaults, 1F1B,
ZB-H1 and interleaved as ``mpt train`` runs them, DeepSpeed's defaults and every torch.distributed.pipelining
schedule, and per run the ratios the issue sets goals for, beside the no-bubble ceiling of that run
(`ceiling_ratios`): how far any schedule of any peer could go with the kernels the single process uses.

Our rows run as ``mpt train`` does, with fused AdamW and the heap that keeps freed pages; the
peers' rows step torch's AdamW (foreach) on glibc's default heap. ``--control`` adds the control
row (`CONTROL`): our defaults' run with the peers' optimizer and heap, and per run
its ratios over DeepSpeed and the best torch schedule.
"""
from __future__ import annotations

import os
from typing import Callable

from tools.peers import Workload

DEEPSPEED_GOAL, TORCH_GOAL, ONE_F_ONE_B_GOAL = 1.25, 1.1, 0.95
"""Issue 23 item 4: the defaults over DeepSpeed's defaults and over the best torch schedule, and 1F1B
as ``mpt train`` runs it against its bound, in each run."""
SIDE_BY_SIDE = ("^(mpt defaults|mpt [^ ]+ (x2 )?(flops|V) cut, as mpt train|mpt (ZBVZeroBubble|DualPipeV) V cut|"
                "deepspeed parameters|torch |single process, heap kept)")
"""Issue 23's rows: our defaults, 1F1B, ZB-H1 and interleaved as mpt train runs them, DeepSpeed's defaults,
every torch schedule (`peers.TORCH_SCHEDULES`, the several-stages-per-rank ones on our chunk cut or V cut);
issue 38's: every candidate of the planner's default as mpt train runs it (ZB-drain, ZB-V and DualPipeV too),
and our ZB-V and DualPipeV on torch's V cut with the peers' optimizer and heap."""
V_PAIRS = (("mpt ZBVZeroBubble V cut", "torch ScheduleZBVZeroBubble V cut"),
           ("mpt DualPipeV V cut", "torch ScheduleDualPipeV V cut"))
"""Issue 38: our V schedule over torch's, the same cut, optimizer and heap: at least 1.0 in every run."""
DEFAULT_WITHIN = 0.03
"""Issue 38: the planner's default at most 3% slower than the fastest candidate as mpt train runs it."""
CONTROL = "mpt control"
"""The control row's label: our defaults' run (schedule, chunks, cut) stepping the peers' torch AdamW
(foreach) on glibc's default heap, where our other rows run as ``mpt train`` does."""


def ceiling_ratios(r: dict, w: Workload, ours: dict, ds: dict, torch_best: dict) -> dict:
    """The no-bubble ceiling of one side-by-side run, ``pp`` x the single process on the heap our
    defaults run on (T1, heap kept): what a pipeline reaches when every rank computes the whole step
    with the kernels the single process uses, so no schedule of any peer passes it but through
    kernels of its own or less contention between ranks. Each peer's share of it, and the
    ratios over DeepSpeed and the best torch schedule no schedule could exceed in this run.

    Two ranks on one machine slow each other, so a tighter floor is the work of a rank: the step
    each goal asks for (``*_goal_step_ms``) beside the least CPU time per step of the busiest rank
    of any pipelined row (``least_busiest_rank_ms``), the step that row would take with no waiting."""
    ceiling = w.pp * r["t1_heap_kept_tokens_per_s"]
    piped = [row for row in r["peers"] if len(row["cpu_ms_per_rank"]) > 1]
    least_busy = min(piped, key=lambda row: max(row["cpu_ms_per_rank"]))
    return {"ceiling_tokens_per_s": ceiling, "deepspeed_goal_step_ms": ds["step_ms"] / DEEPSPEED_GOAL,
            "torch_goal_step_ms": torch_best["step_ms"] / TORCH_GOAL,
            "least_busiest_rank_ms": max(least_busy["cpu_ms_per_rank"]), "least_busiest_rank_row": least_busy["label"],
            "defaults_of_ceiling": ours["tokens_per_s"] / ceiling,
            "torch_best_of_ceiling": torch_best["tokens_per_s"] / ceiling,
            "deepspeed_of_ceiling": ds["tokens_per_s"] / ceiling,
            "ceiling_vs_deepspeed": ceiling / ds["tokens_per_s"],
            "ceiling_vs_torch_best": ceiling / torch_best["tokens_per_s"]}


def v_ratios(rows: dict[str, dict], ours: dict) -> dict:
    """Issue 38's figures of one run: each of our V schedules over torch's on the same cut (`V_PAIRS`), and
    our defaults over the fastest candidate of the planner's default as mpt train runs it."""
    out = {"v_vs_torch": {a: rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"]
                          for a, b in V_PAIRS if a in rows and b in rows}}
    candidates = [row for label, row in rows.items() if label.endswith(" cut, as mpt train")]
    if candidates:
        fastest = max(candidates, key=lambda row: row["tokens_per_s"])
        out.update(fastest_candidate=fastest["label"],
                   defaults_vs_fastest=ours["tokens_per_s"] / fastest["tokens_per_s"])
    return out


def control_ratios(rows: dict[str, dict], ds: dict, torch_best: dict) -> dict:
    """The control row's tokens/s and its ratios over DeepSpeed's defaults and the best torch
    schedule, where the run has it (``--control``); else nothing."""
    control = next((row for label, row in rows.items() if label.startswith(CONTROL)), None)
    if control is None:
        return {}
    return {"control": control["label"], "control_tokens_per_s": control["tokens_per_s"],
            "control_vs_deepspeed": control["tokens_per_s"] / ds["tokens_per_s"],
            "control_vs_torch_best": control["tokens_per_s"] / torch_best["tokens_per_s"]}


def side_by_side(args, w: Workload, n: int, bench: Callable[..., dict]) -> dict:
    """``n`` separate runs of the issue-23 rows (each its own ``bench(args, w)``: `bench_pipeline.bench`),
    and per run the ratios the issue sets goals for (`DEEPSPEED_GOAL`, `TORCH_GOAL`, `ONE_F_ONE_B_GOAL`):
    defaults / DeepSpeed's defaults, defaults / the best torch row, and 1F1B as ``mpt train`` runs it
    against its bound on the same heap."""
    args.only = SIDE_BY_SIDE + (f"|^{CONTROL}" if args.control else "")
    runs = []
    for i in range(n):
        print(f"\n=== side-by-side run {i + 1} of {n} ===", flush=True)
        r = bench(args, w)
        rows = {row["label"]: row for row in r["peers"]}
        ours = next(row for label, row in rows.items() if label.startswith("mpt defaults"))
        torch_best = max((row for label, row in rows.items() if label.startswith("torch")),
                         key=lambda row: row["tokens_per_s"])
        ds = rows["deepspeed parameters"]
        runs.append({"defaults": ours["label"], "defaults_tokens_per_s": ours["tokens_per_s"],
                     "deepspeed_defaults_tokens_per_s": ds["tokens_per_s"],
                     "torch_best": torch_best["label"], "torch_best_tokens_per_s": torch_best["tokens_per_s"],
                     "vs_deepspeed": ours["tokens_per_s"] / ds["tokens_per_s"],
                     "vs_torch_best": ours["tokens_per_s"] / torch_best["tokens_per_s"],
                     "one_f_one_b_efficiency": rows["mpt 1F1B flops cut, as mpt train"]["efficiency"],
                     "defaults_efficiency": ours["efficiency"], "load_avg": os.getloadavg()[0], "bench": r,
                     **ceiling_ratios(r, w, ours, ds, torch_best), **control_ratios(rows, ds, torch_best),
                     **v_ratios(rows, ours)})
    print_runs(runs)
    checks = [r["bench"]["check"] for r in runs if r["bench"]["check"] is not None]
    return {"side_by_side": runs, "check": {"ok": all(c["ok"] for c in checks)} if checks else None}


def print_runs(runs: list[dict]) -> None:
    """The side-by-side table (one row per run), each run's floors, and the control rows when run."""
    print(f"\n| run | defaults tokens/s | DeepSpeed defaults | best torch | defaults / DeepSpeed "
          f"(goal {DEEPSPEED_GOAL}) | defaults / torch (goal {TORCH_GOAL}) | 1F1B of its bound "
          f"(goal {ONE_F_ONE_B_GOAL}) | no-bubble ceiling | defaults / "
          "torch / DeepSpeed of it | ceiling / DeepSpeed | ceiling / torch | load avg |\n"
          "|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for i, r in enumerate(runs, 1):
        print(f"| {i} | {r['defaults_tokens_per_s']:,.0f} | {r['deepspeed_defaults_tokens_per_s']:,.0f} | "
              f"{r['torch_best']} {r['torch_best_tokens_per_s']:,.0f} | {r['vs_deepspeed']:.2f}x | "
              f"{r['vs_torch_best']:.2f}x | {r['one_f_one_b_efficiency']:.2f} | {r['ceiling_tokens_per_s']:,.0f} | "
              f"{r['defaults_of_ceiling']:.2f} / {r['torch_best_of_ceiling']:.2f} / {r['deepspeed_of_ceiling']:.2f} | "
              f"{r['ceiling_vs_deepspeed']:.2f}x | {r['ceiling_vs_torch_best']:.2f}x | {r['load_avg']:.1f} |")
    print("no-bubble ceiling: pp x the single process's tokens/s on the same heap (T1, heap kept): every rank "
          "busy all step with the same kernels; ceiling / x: the largest ratio over x any pp-stage schedule "
          "could show in this run")
    for i, r in enumerate(runs, 1):
        print(f"run {i}: {DEEPSPEED_GOAL}x DeepSpeed needs a step of {r['deepspeed_goal_step_ms']:,.0f} ms, "
              f"{TORCH_GOAL}x "
              f"{r['torch_best']} one of {r['torch_goal_step_ms']:,.0f} ms; the least busy busiest rank of any "
              f"row works {r['least_busiest_rank_ms']:,.0f} ms a step ({r['least_busiest_rank_row']})")
    print(f"\nissue 38: our V schedules over torch's on the same cut (goal >= 1.0), our defaults over the fastest "
          f"candidate as mpt train runs it (goal >= {1 - DEFAULT_WITHIN:.2f})")
    print("| run | " + " | ".join(a for a, _ in V_PAIRS) + " | defaults | fastest candidate | defaults / fastest |\n"
          "|---|" + "---:|" * len(V_PAIRS) + "---|---|---:|")
    for i, r in enumerate(runs, 1):
        cells = " | ".join(f"{r['v_vs_torch'][a]:.3f}x" if a in r["v_vs_torch"] else "-" for a, _ in V_PAIRS)
        print(f"| {i} | {cells} | {r['defaults']} | {r.get('fastest_candidate', '-')} | "
              f"{r.get('defaults_vs_fastest', float('nan')):.3f} |")
    if any("control" in r for r in runs):
        print("\ncontrol row: our defaults with the peers' optimizer and heap (torch's AdamW foreach, glibc's default "
              "heap), beside the same run as mpt train runs it (fused AdamW, kept heap)")
        print("| run | defaults as mpt train | control | control / DeepSpeed | control / best torch |\n"
              "|---|---:|---:|---:|---:|")
        for i, r in enumerate(runs, 1):
            if "control" in r:
                print(f"| {i} | {r['defaults_tokens_per_s']:,.0f} | {r['control_tokens_per_s']:,.0f} | "
                      f"{r['control_vs_deepspeed']:.2f}x | {r['control_vs_torch_best']:.2f}x |")
