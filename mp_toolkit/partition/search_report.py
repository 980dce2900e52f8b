"""What ``mpt plan --search`` prints and writes (`search.SearchResult`): the top layouts with their
predicted step time, tokens/s, MFU, per-rank peak memory and bubble; the layouts ruled out, counted per
first reason; how the search pruned; and the JSON ``mpt train --plan FILE[:K]`` reads."""
from __future__ import annotations

from dataclasses import asdict

from .cluster import profile_to_dict
from .planner import GB
from .search import SearchResult

__all__ = ["format_search", "search_json"]


def format_search(result: SearchResult) -> str:
    req = result.request
    lines = [f"{req.model}: {req.devices} devices, global batch {req.global_batch} x {req.seq_len} tokens, "
             f"{req.precision}, {req.optimizer}", req.cluster.describe(), ""]
    if result.best:
        rows = [("#", "pp", "tp", "cp", "dp", "m x mb", "schedule", "recompute", "ZeRO", "step ms", "tokens/s", "MFU",
                 "peak GB", "bubble")]
        for k, (lay, plan) in enumerate(result.best, 1):
            sched = lay.schedule + (f" x{lay.chunks}" if lay.chunks > 1 else "")
            mfu = f"{plan.mfu:.1%}" if plan.mfu is not None else "-"
            tp = f"{lay.tp}{'+sp' if lay.sequence_parallel else ''}"
            rows.append((str(k), str(lay.pp), tp, str(lay.cp), str(lay.dp), f"{lay.microbatches} x {lay.micro_batch}",
                         sched, lay.recompute, str(lay.zero), f"{plan.step_time_ms:.2f}",
                         f"{plan.tokens_per_s:,.0f}", mfu, f"{max(plan.rank_bytes) / GB:.3g}",
                         f"{plan.bubble_fraction:.3f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        cap = result.best[0][1].rates.capacity
        lines.append(f"(peak GB: the busiest rank's device memory with the runtime and allocator, of {cap / GB:.3g}; "
                     "+sp: sequence parallel)")
    else:
        lines.append("no layout fits" + (f": one needs at least {result.least_memory_gb:.3g} GB per rank "
                                         f"(--memory-gb, or a larger device)"
                                         if result.least_memory_gb is not None else ""))
    if result.rejected:
        lines += ["", "ruled out:"] + [f"  {n:5d}  {why}" for why, n in result.rejected.most_common()]
    lines += ["", f"searched {result.considered} layouts in {result.seconds:.2f} s: {result.planned} planned in "
                  f"full, {result.bounded} never planned (a lower bound on their step time above the "
                  f"{req.top}-th best), {result.same_as_none} recompute auto the same as recompute none"]
    return "\n".join(lines)


def search_json(result: SearchResult) -> dict:
    """``--search --json``: the request, the profile, and per layout its flags and prediction."""
    req = result.request
    layouts = []
    for lay, plan in result.best:
        layouts.append({**asdict(lay), "seq_len": req.seq_len, "global_batch": req.global_batch,
                        "boundaries": plan.boundaries,
                        "recompute_stages": [{"mode": c.mode, "layers": c.layers} for c in plan.recompute],
                        "step_time_ms": plan.step_time_ms, "tokens_per_s": plan.tokens_per_s, "mfu": plan.mfu,
                        "rank_memory_bytes": plan.rank_bytes, "bubble_fraction": plan.bubble_fraction})
    return {"model": req.model, "devices": req.devices, "global_batch": req.global_batch, "seq_len": req.seq_len,
            "precision": req.precision, "optimizer": req.optimizer, "hf": req.hf,
            "profile": profile_to_dict(req.cluster), "layouts": layouts,
            "rejected": dict(result.rejected.most_common()), "considered": result.considered,
            "planned": result.planned, "bounded": result.bounded, "seconds": result.seconds,
            "least_memory_gb": result.least_memory_gb}
