"""The figures of a planner certification (`tools.certify_plan`): how far the planner's predictions
are from what the runs measured, and whether it orders and picks layouts as the runs do.

Each row is one layout's record (`tools.certify_plan.Record` as a dict): its ``group`` (model x
world size x global batch: layouts that do the same work, so their step times compare), the
predicted and measured step time (``pred_step_ms``, ``meas_step_ms``, ``round_step_ms``: one
measurement per round), the layout's peak bytes (the largest rank's: ``pred_peak_bytes``,
``meas_peak_bytes``; per rank ``pred_rank_bytes``, ``meas_rank_bytes``, all above the pre-model
baseline) and the predicted device bytes of its largest rank (``pred_device_bytes``: the tensor
bytes plus the profile's runtime). What `summarize` returns:

* ``step_mape`` / ``mem_mape``: mean |predicted - measured| / measured over the layouts (memory: of
  the layout's largest rank; ``mem_mape_ranks`` over every rank);
* ``tau_groups``: Kendall's tau-b between predicted and measured step time over the pairs of
  layouts in the same group; ``tau_pooled`` over all pairs (mixing models: an easier order);
* ``regret_max`` / ``regret_median``: per group of two or more, the measured time of the layout
  the planner predicts fastest over the fastest measured, minus 1;
* ``false_fits``: layouts predicted to fit under ``cap_bytes`` (their largest rank's device bytes)
  whose measured device bytes (measured peak + the same runtime) exceed it;
* ``noise_rounds``: median over layouts of (max - min) / mean of the per-round step times (None
  with one round); ``noise_steps``: median over layouts of the median absolute deviation of the
  timed steps of one run over their median;
* ``by``: per dimension (schedule, world size, ...) and value: n, step and memory MAPE, and the
  median signed error (predicted / measured - 1: negative means the planner predicts too little);
* ``baseline_bound_bytes``: the median over ranks of an upper bound of a run's pre-model baseline
  (its peak RSS since the start less the steps' peak above the baseline), to set beside the
  profile's ``runtime_gb``; ``train_plan_mismatches``: layouts whose run printed other planned
  bytes (``planned_memory_bytes``) than the plan compared here (0 unless the two plans differ).

Not imported by the library.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict

__all__ = ["DIMENSIONS", "kendall_tau_b", "mape", "pair_counts", "regret", "summarize", "tau_from_counts"]

DIMENSIONS = ("model", "world", "pp", "tp", "dp", "microbatches", "schedule", "recompute", "zero")
"""The layout fields the error is broken down by."""


def pair_counts(x: list[float], y: list[float]) -> tuple[int, int, int, int, int]:
    """(concordant, discordant, tied in x only, tied in y only, tied in both) over all pairs."""
    c = d = tx = ty = txy = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                txy += 1
            elif dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                c += 1
            else:
                d += 1
    return c, d, tx, ty, txy


def tau_from_counts(c: int, d: int, tx: int, ty: int, txy: int) -> float | None:
    """Kendall's tau-b: (C - D) / sqrt((C + D + Ty) (C + D + Tx)), the pairs tied in x (resp. y)
    left out of x's (resp. y's) side; None where either side has no untied pair."""
    den = (c + d + ty) * (c + d + tx)
    return (c - d) / math.sqrt(den) if den > 0 else None


def kendall_tau_b(x: list[float], y: list[float]) -> float | None:
    """Kendall's tau-b of ``x`` and ``y`` (ties handled as tau-b does); None when undefined."""
    return tau_from_counts(*pair_counts(x, y))


def mape(pred: list[float], meas: list[float]) -> float | None:
    """Mean absolute percentage error, as a fraction; None for no pairs."""
    errs = [abs(p - m) / m for p, m in zip(pred, meas) if m > 0]
    return sum(errs) / len(errs) if errs else None


def regret(pred: list[float], meas: list[float]) -> float:
    """The measured time of the predicted-fastest (the first on a tie) over the fastest measured, minus 1."""
    pick = min(range(len(pred)), key=lambda i: pred[i])
    return meas[pick] / min(meas) - 1


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _signed(pred: list[float], meas: list[float]) -> float | None:
    return _median(p / m - 1 for p, m in zip(pred, meas) if m > 0)


def groups_of(rows: list[dict]) -> list[dict]:
    """Per group: its layouts, tau-b, regret, the planner's pick and the fastest measured."""
    by = defaultdict(list)
    for r in rows:
        by[r["group"]].append(r)
    out = []
    for name, members in sorted(by.items()):
        members = sorted(members, key=lambda r: r["label"])  # the tie rule of `regret`: the first label
        pred = [r["pred_step_ms"] for r in members]
        meas = [r["meas_step_ms"] for r in members]
        many = len(members) >= 2
        out.append({"group": name, "n": len(members), "counts": pair_counts(pred, meas),
                    "tau": kendall_tau_b(pred, meas) if many else None,
                    "regret": regret(pred, meas) if many else None,
                    "pick": members[min(range(len(pred)), key=pred.__getitem__)]["label"],
                    "best": members[min(range(len(meas)), key=meas.__getitem__)]["label"]})
    return out


def breakdown(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """Per dimension of `DIMENSIONS` and value: n, step / memory MAPE and median signed error."""
    out = {}
    for dim in DIMENSIONS:
        by = defaultdict(list)
        for r in rows:
            by[str(r[dim])].append(r)
        out[dim] = {}
        for value, members in sorted(by.items(), key=lambda kv: (len(kv[0]), kv[0])):
            ps, ms = [r["pred_step_ms"] for r in members], [r["meas_step_ms"] for r in members]
            pm, mm = [r["pred_peak_bytes"] for r in members], [r["meas_peak_bytes"] for r in members]
            out[dim][value] = {"n": len(members), "step_mape": mape(ps, ms), "step_bias": _signed(ps, ms),
                               "mem_mape": mape(pm, mm), "mem_bias": _signed(pm, mm)}
    return out


def noise_of(rows: list[dict]) -> tuple[float | None, float | None]:
    """(between rounds, within one run): see the module docstring."""
    rounds = [(max(t) - min(t)) / statistics.mean(t) for t in (r["round_step_ms"] for r in rows) if len(t) >= 2]
    return _median(rounds), _median(r["step_spread"] for r in rows)


def default_cap(rows: list[dict], runtime: int) -> int:
    """The geometric mean of the smallest and largest measured device peaks."""
    peaks = [r["meas_peak_bytes"] + runtime for r in rows]
    return int(math.sqrt(min(peaks) * max(peaks)))


def summarize(rows: list[dict], runtime: int, cap_bytes: int | None = None) -> dict:
    """The certification's figures over ``rows`` (the measured layouts; see the module docstring).
    ``runtime``: the profile's bytes per process, added to both sides of the cap comparison;
    ``cap_bytes``: the cap on a rank's device bytes (None: `default_cap`)."""
    cap = default_cap(rows, runtime) if cap_bytes is None else cap_bytes
    groups = groups_of(rows)
    counts = [sum(g["counts"][k] for g in groups) for k in range(5)]
    regrets = [g["regret"] for g in groups if g["regret"] is not None]
    pred_fit = [r["pred_device_bytes"] <= cap for r in rows]
    meas_fit = [r["meas_peak_bytes"] + runtime <= cap for r in rows]
    noise_rounds, noise_steps = noise_of(rows)
    ps, ms = [r["pred_step_ms"] for r in rows], [r["meas_step_ms"] for r in rows]
    pm, mm = [r["pred_peak_bytes"] for r in rows], [r["meas_peak_bytes"] for r in rows]
    ranks = [(p, m) for r in rows for p, m in zip(r["pred_rank_bytes"], r["meas_rank_bytes"])]
    return {
        "layouts": len(rows), "step_mape": mape(ps, ms), "step_bias": _signed(ps, ms),
        "mem_mape": mape(pm, mm), "mem_mape_ranks": mape([p for p, _ in ranks], [m for _, m in ranks]),
        "mem_bias": _signed(pm, mm),
        "tau_groups": tau_from_counts(*counts), "tau_pooled": kendall_tau_b(ps, ms),
        "groups_ranked": len(regrets),
        "regret_max": max(regrets) if regrets else None, "regret_median": _median(regrets),
        "noise_rounds": noise_rounds, "noise_steps": noise_steps,
        "cap_bytes": cap, "predicted_fits": sum(pred_fit), "measured_fits": sum(meas_fit),
        "false_fits": sum(p and not m for p, m in zip(pred_fit, meas_fit)),
        "false_overs": sum(m and not p for p, m in zip(pred_fit, meas_fit)),
        "baseline_bound_bytes": _median(b for r in rows for b in r["baseline_bound_bytes"]),
        "train_plan_mismatches": sum(r["train_planned_bytes"] != r["pred_rank_bytes"] for r in rows),
        "groups": groups, "by": breakdown(rows),
    }
