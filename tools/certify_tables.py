"""The tables `tools.certify_plan` prints: one row per layout, one per group, the error per value of
each dimension, and the summary beside issue 36's goals (`tools.certify_stats` computes them).

Not imported by the library.
"""
from __future__ import annotations

from collections import Counter

MB = 1e6
GOALS = "goals (issue 36): step MAPE <= 5%, memory MAPE <= 10%, tau >= 0.8, regret <= max(3%, noise), 0 false fits"


def _pct(v: float | None, signed: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.1%}" if signed else f"{v:.1%}"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:+.2f}"


def layout_table(rows: list[dict], cap: int, runtime: int) -> None:
    print(f"\n{'layout':52s} {'cut':>14s} {'pred ms':>8s} {'meas ms':>8s} {'err':>7s} {'rounds':>6s} "
          f"{'pred MB':>8s} {'meas MB':>8s} {'err':>7s} {'fits p/m':>8s}")
    for r in rows:
        t = r["round_step_ms"]
        spread = (max(t) - min(t)) / (sum(t) / len(t)) if len(t) > 1 else None
        fits = ("y" if r["pred_device_bytes"] <= cap else "n") + "/" + (
            "y" if r["meas_peak_bytes"] + runtime <= cap else "n")
        print(f"{r['label']:52s} {','.join(map(str, r['boundaries'])):>14s} {r['pred_step_ms']:8.1f} "
              f"{r['meas_step_ms']:8.1f} {_pct(r['pred_step_ms'] / r['meas_step_ms'] - 1, True):>7s} "
              f"{_pct(spread):>6s} {r['pred_peak_bytes'] / MB:8.1f} {r['meas_peak_bytes'] / MB:8.1f} "
              f"{_pct(r['pred_peak_bytes'] / r['meas_peak_bytes'] - 1, True):>7s} {fits:>8s}")
    print("err: predicted / measured - 1; rounds: (max - min) / mean of the rounds' step times; MB: the largest "
          "rank's tensor bytes (measured: peak RSS above the pre-model baseline); fits p/m: predicted / measured "
          "under the cap")


def group_table(groups: list[dict]) -> None:
    print(f"\n{'group (model, world size, global batch)':40s} {'n':>3s} {'tau-b':>6s} {'regret':>7s}  "
          "planner's pick -> fastest measured")
    for g in groups:
        same = "(the same)" if g["pick"] == g["best"] else g["best"]
        print(f"{g['group']:40s} {g['n']:3d} {_num(g['tau']):>6s} {_pct(g['regret']):>7s}  {g['pick']} -> {same}")


def breakdown_table(by: dict[str, dict[str, dict]]) -> None:
    print(f"\n{'dimension = value':28s} {'n':>4s} {'step MAPE':>10s} {'step bias':>10s} {'mem MAPE':>9s} "
          f"{'mem bias':>9s}")
    for dim, values in by.items():
        for value, b in values.items():
            print(f"{dim + ' = ' + value:28s} {b['n']:4d} {_pct(b['step_mape']):>10s} "
                  f"{_pct(b['step_bias'], True):>10s} {_pct(b['mem_mape']):>9s} {_pct(b['mem_bias'], True):>9s}")
    print("bias: median of predicted / measured - 1 (negative: the planner predicts too little)")


def summary_lines(s: dict) -> None:
    noise = s["noise_rounds"] if s["noise_rounds"] is not None else s["noise_steps"]
    print(f"\n{s['layouts']} layouts: step-time MAPE {_pct(s['step_mape'])} (median error "
          f"{_pct(s['step_bias'], True)}), peak-memory MAPE {_pct(s['mem_mape'])} (every rank: "
          f"{_pct(s['mem_mape_ranks'])}; median error {_pct(s['mem_bias'], True)})")
    print(f"Kendall's tau-b within groups {_num(s['tau_groups'])}, pooled over all layouts {_num(s['tau_pooled'])}; "
          f"top-1 regret over {s['groups_ranked']} groups: max {_pct(s['regret_max'])}, median "
          f"{_pct(s['regret_median'])}")
    print(f"noise: between rounds {_pct(s['noise_rounds'])}, within a run {_pct(s['noise_steps'])} "
          f"(regret goal: at most {_pct(max(0.03, noise or 0))})")
    print(f"cap {s['cap_bytes'] / 1e9:.4g} GB per rank: predicted to fit {s['predicted_fits']}, measured to fit "
          f"{s['measured_fits']}, false fits {s['false_fits']}, false overs {s['false_overs']}")
    if s["baseline_bound_bytes"] is not None:
        print(f"a run's pre-model baseline is at most {s['baseline_bound_bytes'] / 1e9:.3g} GB (median over ranks); "
              f"layouts whose run planned other bytes than this plan: {s['train_plan_mismatches']}")
    print(GOALS)


def print_tables(rows: list[dict], summary: dict, refused: Counter, failed: dict[str, str], runtime: int) -> None:
    """Every table, then the refusals and failures."""
    layout_table(rows, summary["cap_bytes"], runtime)
    group_table(summary["groups"])
    breakdown_table(summary["by"])
    summary_lines(summary)
    if refused:
        print("\nrefused while choosing (count, first reason):")
        for why, count in refused.most_common():
            print(f"  {count:4d}  {why}")
    for label, why in failed.items():
        print(f"failed: {label}: {why}")
