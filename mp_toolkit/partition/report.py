"""What ``mpt plan`` and ``mpt simulate`` print and write: a stage table, JSON, a Gantt chart."""
from __future__ import annotations

import json
import os

from mp_toolkit.recompute import stage_blocks
from mp_toolkit.schedule import draw_gantt
from mp_toolkit.user_files import write_output

from .planner import GB, Plan


def _human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def format_plan(plan: Plan) -> str:
    """The stage table, then bubble, step time and tokens/s, then the warnings."""
    r = plan.request
    head = (f"{r.model}: pp={r.pp} tp={r.tp}{' +sp' if r.sequence_parallel else ''}"
            + (f" cp={r.cp}" if r.cp > 1 else "") + f" dp={r.dp}, {r.schedule}"
            + (f" x{r.chunks} chunks" if r.chunks > 1 else "")
            + (" ZeRO-1" if r.zero and r.dp > 1 else "")
            + f", {r.microbatches} micro-batches of {r.micro_batch} x {r.seq_len} tokens, {r.precision}, "
            f"{r.optimizer}, "
            f"method {r.method}; times {plan.time_source}")
    rows = [("stage", "layers", "params", "fwd+bwd ms", "peak memory")]
    for s in plan.stages:
        first, last = plan.layers[s.first_layer].name, plan.layers[s.last_layer].name
        span = first if first == last else f"{first}..{last}"
        rows.append((str(s.index), span, _human(s.params), f"{s.time_ms:.3f}", f"{s.memory_bytes / GB:.3f} GB"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [head] + ([plan.rates.profile] if plan.rates is not None else []) + [""]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) if i == 1 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))))
    lines += recompute_lines(plan)
    lines += ["", f"bubble fraction {plan.bubble_fraction:.3f}   step time {plan.step_time_ms:.2f} ms   "
                  f"{plan.tokens_per_s:,.0f} tokens/s   slowest stage {plan.max_stage_time_ms:.3f} ms"
                  + (f"   MFU {plan.mfu:.1%}" if plan.mfu is not None else "")]
    if r.cluster is not None:
        cap = plan.rates.capacity
        lines.append("per rank on its device (runtime and allocator included): "
                     + ", ".join(f"{b / GB:.3g}" for b in plan.rank_bytes) + " GB"
                     + (f" of {cap / GB:.3g} GB" if cap is not None else ""))
    lines += plan.warnings
    return "\n".join(lines)


def recompute_lines(plan: Plan) -> list[str]:
    """One line per stage saying which of its blocks recompute (none when the plan recomputes nothing)."""
    if not plan.recompute:
        return []
    names = [c.name for c in plan.layers]
    blocks = stage_blocks(names, plan.boundaries)
    return [""] + [f"stage {j} recomputes: {c.describe(len(b))}"
                    for j, (c, b) in enumerate(zip(plan.recompute, blocks))]


def write_json(obj: dict, path: str | os.PathLike) -> None:
    """``--json``: ``obj`` indented, written whole or not at all (`write_output`)."""
    write_output("--json", path, json.dumps(obj, indent=2) + "\n")


def draw_plan_gantt(plan: Plan, path: str | os.PathLike) -> None:
    """The simulated schedule with predicted durations (ms) on the time axis."""
    r = plan.request
    title = (f"{r.model} {r.schedule} pp={r.pp}: predicted step {plan.timeline.step_time:.1f} ms "
             f"(+ optimizer), bubble {plan.bubble_fraction:.1%}")
    draw_gantt(plan.timeline, path, title=title, xlabel="predicted time (ms)")
