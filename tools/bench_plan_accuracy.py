"""Does `mpt plan` predict what `mpt train` does? And does its cut win?

For each configuration: ``mpt plan --method time`` (layers measured here) predicts the cut, the
step time and each stage's peak memory; ``mpt train`` then runs that very cut on 2 gloo ranks
(one thread each, synthetic data) and reports its step times (median of the steps after the
first two) and each rank's peak resident memory above its pre-model baseline. Then, on a GPT
with a large vocabulary, the uniform, parameters and time cuts are trained side by side and
their measured tokens/s compared.

    python -m tools.bench_plan_accuracy            # prints two tables and a JSON line
    python -m tools.bench_plan_accuracy --quick    # fewer steps, for a smoke run
    python -m tools.bench_plan_accuracy --only accuracy --rows v8192   # the issue-8 workload's rows

Prints the machine header (`tools.report`) first. Nothing else should run on the machine meanwhile
(two ranks use both cores here).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
from pathlib import Path

from mp_toolkit.names import stages_per_rank
from tools.predict import model_file
from tools.ranks import mpt
from tools.report import header, json_line

WORKLOAD_8192 = {"model_type": "gpt2", "vocab_size": 8192, "n_embd": 256, "n_layer": 8, "n_head": 8,
                 "n_positions": 128}
# The LM head costs about five blocks here (2*N*h*V against 24*N*h^2 per block, plus its softmax),
# while its parameters equal the embedding's: `parameters` balances embedding against head and
# leaves the head with half the blocks, `uniform` splits the layer count; only `time` sees the head.
LARGE_VOCAB = {"model_type": "gpt2", "vocab_size": 16384, "n_embd": 256, "n_layer": 8, "n_head": 8,
               "n_positions": 128}

# (label, model, schedule, micro-batch, micro-batches, seq)
ACCURACY = [
    ("small 1f1b", "gpt-small-cpu", "1f1b", 8, 4, 128),
    ("small gpipe", "gpt-small-cpu", "gpipe", 8, 4, 128),
    ("small zbh1", "gpt-small-cpu", "zbh1", 8, 4, 128),
    ("8x256 v8192 1f1b", "workload", "1f1b", 4, 8, 128),
    ("8x256 v8192 interleaved", "workload", "interleaved", 4, 8, 128),
    ("8x256 v8192 zbh1", "workload", "zbh1", 4, 8, 128),
    ("8x256 v8192 zbdrain", "workload", "zbdrain", 4, 8, 128),
]


def common(model: str, schedule: str, mb: int, m: int, seq: int) -> list[str]:
    out = ["--model", model, "--pp", "2", "--schedule", schedule, "--micro-batch", str(mb),
           "--microbatches", str(m), "--seq-len", str(seq)]
    return out + (["--chunks", str(stages_per_rank(schedule))] if stages_per_rank(schedule) > 1 else [])


def predict(tmp: Path, args: list[str], method: str = "time") -> dict:
    path = tmp / "plan.json"
    mpt("plan", *args, "--method", method, "--measure", "--json", str(path))
    return json.loads(path.read_text())


def train_rows(tmp: Path, args: list[str], boundaries: list[int], steps: int, env: dict | None = None) -> list:
    path = tmp / "metrics.jsonl"
    mpt("train", *args, "--partition", ",".join(map(str, boundaries)), "--steps", str(steps),
        "--data", "synthetic", "--threads", "1", "--no-progress", "--metrics", str(path), "--optimizer", "adamw",
        env=env)
    return [json.loads(line) for line in path.read_text().splitlines()]


def measure(tmp: Path, args: list[str], boundaries: list[int], steps: int, memory: bool = True) -> dict:
    """Step times from a run with the default allocator; peak memory from a second, short run
    in which glibc maps every block above 64 KiB on its own, so RSS follows the live tensors
    (that mode slows CPU kernels, hence two runs)."""
    rows = train_rows(tmp, args, boundaries, steps)
    out = {"step_time_ms": statistics.median(r["step_time_s"] * 1e3 for r in rows[2:]),
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[2:])}
    if memory:
        mem = train_rows(tmp, args, boundaries, 3, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
        out["peak_memory_bytes"] = mem[-1]["peak_memory_bytes"]
    return out


def boundaries_of(plan: dict) -> list[int]:
    return [s["first_layer"] for s in plan["stages"]] + [plan["stages"][-1]["last_layer"] + 1]


def rank_memory(plan: dict, pp: int = 2) -> list[int]:
    """Per rank: the sum of its stages (the plan's ``rank`` of each: the schedule's placement)."""
    out = [0] * pp
    for s in plan["stages"]:
        out[s["rank"]] += s["memory_bytes"]
    return out


def accuracy(tmp: Path, steps: int, rows_re: str = "") -> list[dict]:
    rows = []
    for label, model, schedule, mb, m, seq in ACCURACY:
        if not re.search(rows_re, label):
            continue
        args = common(model, schedule, mb, m, seq)
        plan = predict(tmp, args)
        got = measure(tmp, args, boundaries_of(plan), steps)
        pred_mem = rank_memory(plan)
        rows.append({"config": label, "cut": boundaries_of(plan),
                     "pred_step_ms": plan["step_time_ms"], "meas_step_ms": got["step_time_ms"],
                     "step_err": plan["step_time_ms"] / got["step_time_ms"] - 1,
                     "pred_mem_mb": [b / 1e6 for b in pred_mem],
                     "meas_mem_mb": [b / 1e6 for b in got["peak_memory_bytes"]],
                     "mem_err": [p / g - 1 for p, g in zip(pred_mem, got["peak_memory_bytes"])]})
        r = rows[-1]
        print(f"{label:26s} cut {r['cut']}  step pred {r['pred_step_ms']:7.1f} ms  meas {r['meas_step_ms']:7.1f} ms"
              f"  ({r['step_err']:+.1%})   memory pred {r['pred_mem_mb'][0]:6.1f} / {r['pred_mem_mb'][1]:6.1f} MB"
              f"  meas {r['meas_mem_mb'][0]:6.1f} / {r['meas_mem_mb'][1]:6.1f} MB"
              f"  ({r['mem_err'][0]:+.1%} / {r['mem_err'][1]:+.1%})", flush=True)
    return rows


def winning_cut(tmp: Path, steps: int) -> list[dict]:
    args = common("large", "1f1b", 4, 8, 128)
    rows = []
    for method in ("uniform", "parameters", "time"):
        plan = predict(tmp, args, method)
        got = measure(tmp, args, boundaries_of(plan), steps, memory=False)
        rows.append({"method": method, "cut": boundaries_of(plan), "pred_tokens_per_s": plan["tokens_per_s"],
                     "meas_tokens_per_s": got["tokens_per_s"]})
        print(f"{method:10s} cut {rows[-1]['cut']}  predicted {plan['tokens_per_s']:8.0f} tokens/s  "
              f"measured {got['tokens_per_s']:8.0f} tokens/s", flush=True)
    best = max(rows, key=lambda r: r["meas_tokens_per_s"])
    for r in rows:
        r["ratio_to_time_cut"] = r["meas_tokens_per_s"] / rows[-1]["meas_tokens_per_s"]
    print(f"fastest measured: {best['method']}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 steps per run instead of 10")
    ap.add_argument("--only", choices=("accuracy", "win"), help="run one of the two parts")
    ap.add_argument("--rows", default="", help="regex over the accuracy rows' labels (e.g. 'v8192')")
    args = ap.parse_args()
    head = header("bench_plan_accuracy")
    steps = 4 if args.quick else 10
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, config in (("workload", WORKLOAD_8192), ("large", LARGE_VOCAB)):
            (tmp / name).mkdir()
            model_file(config, tmp / name)
        os.chdir(tmp)  # "workload" and "large" resolve as model directories
        acc = win = None
        if args.only != "win":
            print("predicted (mpt plan --method time) vs measured (mpt train, 2 gloo ranks, 1 thread each)")
            acc = accuracy(tmp, steps, args.rows)
        if args.only != "accuracy":
            print("\nthe cut that wins: GPT 8 x 256, vocabulary 16384, 8 micro-batches of 4 x 128, 1F1B")
            win = winning_cut(tmp, steps)
    json_line("bench_plan_accuracy", head, accuracy=acc, winning_cut=win)


if __name__ == "__main__":
    main()
