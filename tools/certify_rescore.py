"""Score a certification run's measurements against another profile's predictions, without training again.

    python -m tools.certify_rescore RUN.json [RUN.json ...] --profile PROFILE.json
    python -m tools.certify_rescore RUN.json --profile gpt-tiny=A.json --profile bert-tiny=B.json ...

``RUN.json``: what ``python -m tools.certify_plan --json RUN.json`` wrote (its layouts and what each
measured). Each layout is planned again under ``--profile`` (`tools.certify_plan.Layout.request`, the
planner's flops cut: the same boundaries the run trained, checked) and the figures of
`tools.certify_stats.summarize` are printed for the run's own predictions and for the new ones,
side by side: a change of the profile's figures (or of the planner) scored on the same measurements.
The memory cap is the run's. Prints a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from mp_toolkit.partition.cluster import ClusterError, read_profile
from mp_toolkit.partition.planner import make_plan
from tools.certify_plan import Layout, profile_files, record
from tools.certify_stats import summarize
from tools.report import header, json_line

FIGURES = ("step_mape", "step_bias", "mem_mape", "mem_bias", "tau_groups", "tau_pooled", "regret_median",
           "regret_max", "false_fits")
LAYOUT_FIELDS = ("model", "pp", "tp", "dp", "microbatches", "schedule", "chunks", "recompute", "zero")


def rescored(run: dict, profile) -> list[dict]:
    """The run's rows with their predictions replaced by ``profile``'s (a `ClusterProfile`, or one per
    model in a dict), the measurements kept."""
    out = []
    for row in run["rows"]:
        layout = Layout(*(row[k] for k in LAYOUT_FIELDS))
        plan = make_plan(layout.request(profile[layout.model] if isinstance(profile, dict) else profile))
        if list(plan.boundaries) != row["boundaries"]:
            raise SystemExit(f"{row['label']}: planned on {plan.boundaries}, trained on {row['boundaries']}")
        new = record(layout, plan)
        out.append({**row, **{k: new[k] for k in ("pred_step_ms", "pred_rank_bytes", "pred_peak_bytes",
                                                  "pred_device_bytes")}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--profile", action="append", required=True, metavar="FILE|MODEL=FILE",
                    help="a profile for every model, or MODEL=FILE for each (repeat)")
    args = ap.parse_args()
    head = header("certify_rescore")
    rows = []
    for path in args.runs:
        run = json.loads(path.read_text())
        models = sorted({r["model"] for r in run["rows"]})
        try:
            profile = {m: read_profile(f) for m, f in profile_files(args.profile, models).items()}
        except ClusterError as e:
            raise SystemExit(f"certify_rescore: {e}") from None
        for m, p in profile.items():
            print(f"{path.name} {m}: {p.describe()}")
        runtime, cap = int(run["profile"]["device"].get("runtime_gb", 0) * 1e9), run["summary"]["cap_bytes"]
        before, after = run["summary"], summarize(rescored(run, profile), runtime, cap)
        rows.append({"run": str(path), "before": {k: before[k] for k in FIGURES},
                     "after": {k: after[k] for k in FIGURES}})
    print(f"{'run':28s} {'figure':14s} {'run profile':>12s} {'--profile':>10s}")
    for r in rows:
        for k in FIGURES:
            b, a = r["before"][k], r["after"][k]
            fmt = (lambda v: "-" if v is None else f"{v:+.3f}" if isinstance(v, float) else str(v))
            print(f"{Path(r['run']).name:28s} {k:14s} {fmt(b):>12s} {fmt(a):>10s}")
    json_line("certify_rescore", head, profile=args.profile, rows=rows)


if __name__ == "__main__":
    main()
