"""Per-rank peak memory and step time with and without ZeRO-1 at dp=2, beside the planner's prediction.

For each shape, `mpt train` runs twice on 2 gloo ranks (pp=1, dp=2, one thread each, fp32, AdamW,
synthetic data): ``--zero 0`` and ``--zero 1``. Each rank reports its peak resident memory of the
steady-state steps above its post-import baseline (`mpt train`'s ``peak_memory_bytes``: model,
gradients, optimizer state, activations), with large blocks mapped one by one
(``MALLOC_MMAP_THRESHOLD_=65536``, as `tools.bench_plan_accuracy` measures memory) so RSS follows
the live tensors; the step time is the median ``step_time_s`` of steps 2..N. The prediction is
`make_plan(PlanRequest(..., zero=...))`'s stage memory (static bytes per parameter from
`bytes_per_param(..., zero_dp=dp)` plus activations) and its step time (FLOPs at a GEMM rate
measured here, the dp all-reduce at --p2p-gbps).

    python -m tools.bench_zero                     # ~3 minutes on 2 quiet cores
    python -m tools.bench_zero --shapes gpt-small-cpu --steps 4

Prints the machine header (`tools.report`), a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from tools.predict import model_file, predict, train_config
from tools.ranks import mpt
from tools.report import header, json_line

MIB = 2**20
WIDE = {"model_type": "gpt2", "vocab_size": 8192, "n_positions": 256, "n_embd": 512, "n_layer": 8, "n_head": 8}
"""A 33M-parameter GPT whose static bytes (16 per parameter) outweigh its activations at this batch."""


def shapes(tmp: Path, names: list[str]) -> dict[str, str]:
    out = {}
    for name in names:
        if name == "gpt-512x8":
            out[name] = model_file(WIDE, tmp, "gpt-512x8.json")
        else:
            out[name] = name
    return out


def run(model: str, zero: int, args, tmp: Path) -> dict:
    metrics = tmp / f"m-{zero}-{abs(hash(model))}.jsonl"
    mpt("train", "--model", model, "--pp", "1", "--dp", "2", "--zero", str(zero), "--threads", "1",
        "--data", "synthetic", "--micro-batch", str(args.micro_batch), "--microbatches", str(args.microbatches),
        "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--optimizer", "adamw", "--no-progress",
        "--metrics", str(metrics), env={"MALLOC_MMAP_THRESHOLD_": "65536"}, timeout_s=1800)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"peak_mib": [b / MIB for b in rows[-1]["peak_memory_bytes"]],
            "step_ms": 1e3 * statistics.median(r["step_time_s"] for r in rows[1:])}


def prediction(model: str, zero: int, args) -> dict:
    """``mpt plan --pp 1 --dp 2 [--zero 1]``: the "parameters" cut, a GEMM timed here on one thread."""
    cfg = train_config(model, pp=1, dp=2, zero=zero, micro_batch=args.micro_batch, microbatches=args.microbatches,
                       seq_len=args.seq_len, optimizer="adamw", threads=1)
    plan = predict(cfg, method="parameters", tflops=None, load=True, threads=1)
    return {"peak_mib": plan.stages[0].memory_bytes / MIB, "step_ms": plan.step_time_ms,
            "params": plan.stages[0].params}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["gpt-small-cpu", "gpt-512x8"])
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    head = header("bench_zero")
    results = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for name, model in shapes(tmp, args.shapes).items():
            for zero in (0, 1):
                got, want = run(model, zero, args, tmp), prediction(model, zero, args)
                results.append({"shape": name, "zero": zero, **{f"measured_{k}": v for k, v in got.items()},
                                **{f"predicted_{k}": v for k, v in want.items()}})
    print(f"{'shape':<14} {'zero':>4} {'params':>8} {'peak MiB rank 0/1':>18} {'predicted MiB':>13} "
          f"{'step ms':>8} {'predicted ms':>12}")
    for r in results:
        peaks = "/".join(f"{x:.0f}" for x in r["measured_peak_mib"])
        print(f"{r['shape']:<14} {r['zero']:>4} {r['predicted_params'] / 1e6:>7.1f}M {peaks:>18} "
              f"{r['predicted_peak_mib']:>13.0f} {r['measured_step_ms']:>8.0f} {r['predicted_step_ms']:>12.0f}")
    json_line("bench_zero", head, micro_batch=args.micro_batch, microbatches=args.microbatches, seq_len=args.seq_len,
              results=results)


if __name__ == "__main__":
    main()
