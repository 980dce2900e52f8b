"""Draw `tools.bench_pipeline`'s result as a PNG: tokens/s of every peer, the 1F1B bound and T1.

    .venv/bin/python -m tools.bench_pipeline | tee runs/bench_pipeline.txt
    .venv/bin/python -m tools.bench_chart runs/bench_pipeline.txt --out benchmarks/pipeline.png

The input is bench_pipeline's output (its last JSON line is read; the header and table above it
are skipped); the title names the machine and date of its header (`tools.report`).
One horizontal bar per peer, coloured by toolkit, labelled with tokens/s and the fraction of the
1F1B bound `p * T1 * m / (m + p - 1)`; dashed lines mark T1 and the bound.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLOURS = {"mpt": "#1f77b4", "deepspeed": "#d62728", "torch": "#2ca02c", "single": "#7f7f7f"}


def last_json(text: str) -> dict:
    """The last line of ``text`` that parses as a JSON object with a ``peers`` table."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(doc, dict) and isinstance(doc.get("peers"), list):
                return doc
    raise ValueError("no bench_pipeline JSON line (a {...} line with a 'peers' list) in the input")


def toolkit(label: str) -> str:
    low = label.lower()
    for key in ("mpt", "deepspeed", "torch"):
        if low.startswith(key):
            return key
    return "single"


def draw(doc: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    rows = sorted(doc["peers"], key=lambda r: r["tokens_per_s"])
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.6))
    ys = range(len(rows))
    ax.barh(list(ys), [r["tokens_per_s"] for r in rows], color=[COLOURS[toolkit(r["label"])] for r in rows])
    ax.set_yticks(list(ys), [r["label"] for r in rows], fontsize=8)
    for y, r in zip(ys, rows):
        eff = r.get("efficiency")
        text = f" {r['tokens_per_s']:,.0f}" + (f"  ({eff:.2f} of bound)" if eff else "")
        ax.text(r["tokens_per_s"], y, text, va="center", fontsize=7)
    for value, name in ((doc.get("t1_tokens_per_s"), "T1"), (doc.get("bound_tokens_per_s"), "1F1B bound")):
        if value and value == value:  # NaN when the single process did not run
            ax.axvline(value, ls="--", lw=1, color="black")
            ax.text(value, len(rows) - 0.4, f" {name}", fontsize=7)
    w = doc.get("workload", {})
    machine = doc.get("machine", {})
    ax.set_xlabel("tokens/s (median step)")
    ax.set_title(f"bench_pipeline {doc.get('date', '')}: {machine.get('cpu', '?')}, "
                 f"{machine.get('nproc', '?')} CPUs, "
                 f"{w.get('precision', '')}, pp={w.get('pp', '?')}, m={w.get('microbatches', '?')}", fontsize=9)
    top = max([r["tokens_per_s"] for r in rows] + [v for v in (doc.get("bound_tokens_per_s"),) if v and v == v])
    ax.set_xlim(0, 1.3 * top)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input", type=Path, help="bench_pipeline.py's saved output ('-' for stdin)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/pipeline.png"))
    args = ap.parse_args()
    text = sys.stdin.read() if str(args.input) == "-" else args.input.read_text()
    try:
        doc = last_json(text)
    except ValueError as e:
        raise SystemExit(f"{args.input}: {e}") from None
    print(draw(doc, args.out))


if __name__ == "__main__":
    main()
