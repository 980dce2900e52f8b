"""Where mp_toolkit's pipeline step spends its time, per rank (``python -m tools.bench_pipeline --profile``).

Each profiled run is a `tools.peers` run whose ranks time the engine's own functions
(`tools.profiler.Profiler`: compute per stage and micro-batch, p2p posts and waits, the optimizer
step's parts, the loss broadcast, executor bookkeeping). Here the parent prints each rank's
breakdown; a ping-pong of one activation message gives the transfer cost of a message on its
own, and our simulator (`mp_toolkit.schedule.simulate`) replays the schedule with the measured
per-stage F and B costs and free communication: the step the cut and schedule allow. Each
figure comes in wall time and in CPU time (the thread's for an action, the process's for a
step): CPU time counts work rather than waiting, so load from other processes moves it less.

Profiled runs: our 1F1B on the "parameters" and "time" cuts, 1F1B with ``map_large_blocks()``
as ``mpt train`` calls it, ZB-H1, interleaved 1F1B, and DeepSpeed's engine on the same cut
(each of its schedule instructions timed through ``PipelineEngine._INSTRUCTION_MAP``). The
last step of each run runs under torch.profiler instead, for the top operators per rank.
"""
from __future__ import annotations

import re
import statistics
from collections import defaultdict

from mp_toolkit.schedule import get_schedule, simulate
from tools.peers import Workload, run_peer
from tools.ranks import RunError

STEP_PARTS = ("step: grads_to_master", "step: grad 2-norms (inf/nan + norm)", "step: inf/nan scan",
              "step: overflow all-reduce", "step: grad norm + all-reduce", "step: AdamW", "step: zero_grad")


def breakdown(prof: dict, step_ms: float) -> dict[str, float]:
    """ms per step by category for one rank; the parts sum to ``step_ms``."""
    t = defaultdict(float, prof["ms_per_step"])
    compute = {k: v for k, v in t.items() if k[:2] in ("F ", "B ", "I ", "W ")}
    rows = {}
    for kind in "FBIW":
        v = sum(ms for k, ms in compute.items() if k.startswith(kind + " "))
        if v:
            rows[f"compute {kind}"] = v
    rows["p2p post (batch_isend_irecv)"] = t["p2p post"]
    if "p2p recv wait" in prof["ms_per_step"]:
        rows["p2p post: buffers, bookkeeping"] = t["p2p exchange"] - t["p2p post"]
        rows["p2p wait for receives"] = t["p2p recv wait"]
    else:  # before issue 23 (exchange waited for its receives itself)
        rows["p2p wait for receives (+ buffers)"] = t["p2p exchange"] - t["p2p post"]
    rows["p2p wait_sends (freed outputs + end)"] = t["p2p wait_sends"]
    run = t["schedule (Executor.run)"]
    rows["executor bookkeeping"] = (run - sum(compute.values()) - t["p2p exchange"] - t["p2p recv wait"]
                                    - t["p2p wait_sends"])
    rows["loss broadcast"] = t["loss broadcast"]
    for part in STEP_PARTS:
        rows[part] = t[part]
    rows["step: other (copy_back, ...)"] = t["optimizer step (all)"] - sum(t[p] for p in STEP_PARTS)
    rows["train_batch outside the above"] = step_ms - run - t["loss broadcast"] - t["optimizer step (all)"]
    return rows


def simulated_step_ms(schedule_name: str, pp: int, m: int, chunks: int,
                      action_ms: dict[str, float]) -> tuple[float, list[float]]:
    """Our simulator's step (ms) and per-rank idle (ms) with the measured per-stage action medians
    and free communication."""
    sched = get_schedule(schedule_name, pp, m, chunks=chunks)
    costs: dict[int, dict[str, float]] = defaultdict(dict)
    for key, ms in action_ms.items():
        kind, stage = key.split(" s")
        costs[int(stage)][kind] = ms
    tl = simulate(sched, dict(costs))
    return tl.step_time, [tl.step_time - b for b in tl.busy]


def run(args, w: Workload, pcut: list[int], tcut: list[int] | None) -> dict:
    configs = [("mpt 1F1B", {"schedule": "1f1b"}),
               ("mpt 1F1B, with map_large_blocks() (memory-measurement mode)",
                {"schedule": "1f1b", "map_large_blocks": True}),
               ("mpt ZBH1", {"schedule": "zbh1"}),
               ("mpt ZBDrain", {"schedule": "zbdrain"}),
               ("mpt Interleaved1F1B x2", {"schedule": "interleaved", "chunks": 2})]
    if tcut is not None and tcut != pcut:
        configs.insert(1, ("mpt 1F1B time cut", {"schedule": "1f1b", "boundaries": tcut}))
    configs.insert(1, ("deepspeed parameters", {"peer": "deepspeed", "partition": "parameters", "schedule": "1f1b"}))
    out = {}
    for label, extra in configs:
        if args.only and not re.search(args.only, label):
            continue
        spec = {"peer": "mpt", **extra, "workload": w.__dict__, "warmup": args.warmup, "steps": args.steps,
                "profile": True}
        try:
            results = run_peer(spec, w.pp, timeout_s=args.timeout, threads=w.threads)
        except RunError as e:
            print(f"{label}: FAILED\n{e}")
            continue
        report = report_deepspeed if extra.get("peer") == "deepspeed" else report_run
        out[label] = report(label, results, w, extra, args.warmup)
    return {"profiles": out}


def report_run(label: str, results: list[dict], w, extra: dict, warmup: int) -> dict:
    steps = [max(r["times"][i] for r in results) for i in range(warmup, len(results[0]["times"]))]
    step_ms = 1e3 * statistics.median(steps)
    # the parts are sums over the timed steps, so the total they add up to is the mean step
    rank_ms = [1e3 * statistics.mean(r["times"][warmup:]) for r in results]
    rows = [breakdown(r["profile"], ms) for r, ms in zip(results, rank_ms)]
    action_ms = {}
    for r in results:
        action_ms.update(r["profile"]["action_median_ms"])
    sim_ms, sim_idle = simulated_step_ms(extra["schedule"], w.pp, w.microbatches, extra.get("chunks", 1), action_ms)
    what_if = None
    if any(k.startswith("I ") for k in action_ms):  # W re-walks I's path: what if it did only B - I?
        lean = {k: (v - action_ms.get("I" + k[1:], 0.0) if k.startswith("W ") else v) for k, v in action_ms.items()}
        what_if = simulated_step_ms(extra["schedule"], w.pp, w.microbatches, 1, lean)[0]
    p2p = results[0]["profile"]["p2p_one_way_ms"]
    exchanges = [r["profile"]["calls_per_step"].get("p2p exchange", 0) for r in results]
    print(f"\n{label}, cut {results[0]['boundaries']}: median step {step_ms:.0f} ms (slowest rank); "
          f"ms per step by rank")
    print(f"  {'':34s}" + "".join(f"{'rank ' + str(r['rank']):>10s}" for r in results))
    for key in rows[0]:
        print(f"  {key:34s}" + "".join(f"{row.get(key, 0.0):10.1f}" for row in rows))
    print(f"  {'total (mean step of this rank)':34s}" + "".join(f"{ms:10.1f}" for ms in rank_ms))
    per_mb = ", ".join(f"{k} {v:.1f}" for k, v in sorted(action_ms.items(), key=lambda kv: (kv[0][2:], kv[0])))
    print(f"  per micro-batch (median ms): {per_mb}")
    measured = ", ".join(f"{r['profile']['ms_per_step'].get('schedule (Executor.run)', 0):.0f}" for r in results)
    idle = ", ".join(f"{i:.0f}" for i in sim_idle)
    print(f"  simulated step with these costs and free p2p: {sim_ms:.0f} ms (idle per rank {idle} ms); "
          f"measured Executor.run {measured} ms")
    if what_if is not None:
        print(f"  simulated step if W cost only (its measured time - I), i.e. did not redo the input-gradient "
              f"path: {what_if:.0f} ms")
    cpu = print_cpu(results)
    if results[0]["profile"].get("receives"):
        print("  receives per rank (buffers allocated / reused, posted ahead): " + ", ".join(
            f"{r['profile']['receives']['buffers_allocated']} / {r['profile']['receives']['buffers_reused']}, "
            f"{r['profile']['receives']['posted_ahead']}" for r in results))
    print("  p2p one-way: " + ", ".join(f"{k} ({v['bytes'] / 1024:.0f} KiB) {v['ms']:.3f} ms" for k, v in p2p.items())
          + f"; batched exchanges per step {', '.join(f'{e:.0f}' for e in exchanges)}")
    for r in results:
        ops = r["profile"]["torch_ops"] or []
        print(f"  torch.profiler, rank {r['rank']} (one step, self CPU ms): "
              + ", ".join(f"{o['op']} {o['self_ms']:.0f}" for o in ops[:8]))
    return {"boundaries": results[0]["boundaries"], "step_ms": step_ms, "rank_mean_step_ms": rank_ms,
            "breakdown_ms": rows, "action_median_ms": action_ms, "simulated_step_ms": sim_ms,
            "simulated_idle_ms": sim_idle, "simulated_lean_w_step_ms": what_if, "p2p_one_way_ms": p2p,
            "exchanges_per_step": exchanges, **cpu,
            "torch_ops": [r["profile"]["torch_ops"] for r in results]}


def report_deepspeed(label: str, results: list[dict], w, extra: dict, warmup: int) -> dict:
    """DeepSpeed's instructions, ms per step by rank, and the same simulation as ours."""
    steps = [max(r["times"][i] for r in results) for i in range(warmup, len(results[0]["times"]))]
    rank_ms = [1e3 * statistics.mean(r["times"][warmup:]) for r in results]
    per_rank = [{k.rsplit(" s", 1)[0]: v for k, v in r["profile"]["ms_per_step"].items()} for r in results]
    names = sorted({k for row in per_rank for k in row}, key=lambda k: -max(row.get(k, 0) for row in per_rank))
    print(f"\n{label}, cut {results[0]['boundaries']}: median step {1e3 * statistics.median(steps):.0f} ms "
          f"(slowest rank); ms per step by rank")
    print(f"  {'':34s}" + "".join(f"{'rank ' + str(r['rank']):>10s}" for r in results))
    for name in names:
        print(f"  {name:34s}" + "".join(f"{row.get(name, 0.0):10.1f}" for row in per_rank))
    print(f"  {'outside the instructions':34s}" + "".join(f"{ms - sum(row.values()):10.1f}"
                                                        for ms, row in zip(rank_ms, per_rank)))
    print(f"  {'total (mean step of this rank)':34s}" + "".join(f"{ms:10.1f}" for ms in rank_ms))
    action_ms = {}
    for r in results:
        for k, v in r["profile"]["action_median_ms"].items():
            kind = {"ForwardPass": "F", "BackwardPass": "B"}.get(k.rsplit(" s", 1)[0])
            if kind:
                action_ms[f"{kind} s{k.rsplit(' s', 1)[1]}"] = v
    sim_ms, sim_idle = simulated_step_ms("1f1b", w.pp, w.microbatches, 1, action_ms)
    per_mb = ", ".join(f"{k} {v:.1f}" for k, v in sorted(action_ms.items(), key=lambda kv: (kv[0][2:], kv[0])))
    print(f"  per micro-batch (median ms): {per_mb}")
    print(f"  simulated 1F1B with these costs and free p2p: {sim_ms:.0f} ms")
    cpu = print_cpu(results, {"ForwardPass": "F", "BackwardPass": "B"})
    return {"boundaries": results[0]["boundaries"], "step_ms": 1e3 * statistics.median(steps),
            "rank_mean_step_ms": rank_ms, "instructions_ms": per_rank, "action_median_ms": action_ms,
            "simulated_step_ms": sim_ms, "simulated_idle_ms": sim_idle, **cpu}


def print_cpu(results: list[dict], names: dict[str, str] | None = None) -> dict:
    """CPU time: per step (process, every thread) and per micro-batch action (its thread): unlike
    wall time, it barely moves when other processes share the cores."""
    cpu = {}
    for r in results:
        for k, v in r["profile"]["action_median_cpu_ms"].items():
            kind, stage = k.rsplit(" s", 1)
            kind = (names or {}).get(kind, kind)
            if kind in "FBIW":
                cpu[f"{kind} s{stage}"] = v
    steps = [r["profile"]["cpu_ms_per_step"] for r in results]
    per_mb = ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: (kv[0][2:], kv[0])))
    print(f"  CPU time per step (process): {', '.join(f'{c:.0f}' for c in steps)} ms; "
          f"per micro-batch (thread CPU, median ms): {per_mb}")
    return {"cpu_ms_per_step": steps, "action_median_cpu_ms": cpu}
