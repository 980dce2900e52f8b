"""Context parallelism's step time: ``mpt train --cp 2`` on 2 ranks of one thread against one process on
2 threads, the same model, tokens and steps (issue 37's goal: at most 1.3x).

The model is a GPT (``--layers`` x ``--width``, ``--width`` / 64 heads, vocabulary 8192, 4096 positions,
no dropout) trained on synthetic tokens, one sequence of ``--seq`` tokens per micro-batch, 2 micro-
batches, AdamW fp32, for ``--steps`` steps; the step time is the median of the steps after the first
(``step_time_s`` of the metrics rows). The two runs alternate for ``--rounds`` rounds; the ratio is of
the medians over the rounds.

    python -m tools.bench_context [--layers 4 --width 512 --seq 2048 --steps 4 --rounds 3 --attention ring]

``--attention ulysses`` times ``--cp-attention ulysses`` (all-to-all attention) instead of the ring.

Prints the machine header (`tools.report`), the figures and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from tools.predict import model_file
from tools.ranks import mpt
from tools.report import header, json_line


def step_times(model: str, seq: int, steps: int, out: Path, name: str, *extra: str) -> list[float]:
    metrics = out / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    mpt("train", "--model", model, "--data", "synthetic", "--pp", "1", "--seq-len", str(seq), "--micro-batch", "1",
        "--microbatches", "2", "--steps", str(steps), "--optimizer", "adamw", "--no-progress",
        "--metrics", str(metrics), *extra, timeout_s=3600)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["step_time_s"] for r in rows[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--attention", choices=("ring", "ulysses"), default="ring", help="mpt train --cp-attention")
    a = ap.parse_args()
    head = header("bench_context")
    out = Path(tempfile.mkdtemp(prefix="bench_context-"))
    model = model_file({"model_type": "gpt2", "vocab_size": 8192, "n_positions": 4096, "n_embd": a.width,
                        "n_layer": a.layers, "n_head": a.width // 64}, out, "gpt.json")
    one, two = [], []
    for _ in range(a.rounds):
        one.append(statistics.median(step_times(model, a.seq, a.steps, out, "one", "--threads", "2")))
        two.append(statistics.median(step_times(model, a.seq, a.steps, out, "cp2", "--cp", "2", "--threads", "1",
                                                "--cp-attention", a.attention)))
    t1, t2 = statistics.median(one), statistics.median(two)
    print(f"GPT {a.layers} x {a.width}, 1 x {a.seq} tokens per micro-batch, 2 micro-batches, fp32, AdamW")
    print(f"one process, 2 threads: {t1 * 1e3:.0f} ms per step (rounds {[round(x * 1e3) for x in one]})")
    print(f"--cp 2 --cp-attention {a.attention}, 1 thread per rank: {t2 * 1e3:.0f} ms per step "
          f"(rounds {[round(x * 1e3) for x in two]})")
    print(f"cp 2 / one process: {t2 / t1:.2f}x")
    json_line("bench_context", head, layers=a.layers, width=a.width, seq=a.seq, steps=a.steps, attention=a.attention,
              one_process_s=one, cp2_s=two, ratio=t2 / t1)


if __name__ == "__main__":
    main()
