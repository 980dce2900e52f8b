"""Forward + backward of one model in fp32, bf16 and fp16 in one process on this CPU: how much the low
precisions cost where the CPU multiplies them only by emulation (no AMX / AVX512-BF16), the reason
``mpt train --precision auto`` picks bf16 only where it is fast (`mp_toolkit.optim.master.fast_bf16`).

    python -m tools.bench_precision                           # gpt-small-cpu on 8 x 128 tokens, ~1 minute
    python -m tools.bench_precision --model gpt-tiny --batch 2 --seq 32 --steps 2 --threads 1

The model (a `model_zoo.gpt` preset, built once from one seed) is cast to each precision, as ``mpt
train --precision P`` computes in P (its fp32 master weights take no part in forward and backward);
the loss is taken on fp32 logits, as our executor does. Each pass is one forward and backward of
``--batch`` sequences of ``--seq`` tokens; the precisions take turns pass by pass (fp32, fp16, bf16,
fp32, ...) after one untimed pass each, so a change in machine load hits all of them alike.
``--threads`` 0 (the default) keeps torch's own thread count.

Prints the machine header (`tools.report`), a table (median seconds per pass, and over fp32's) and,
last, one JSON line. A timing tool: nothing else should run on the machine meanwhile.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from model_zoo.gpt import GPT, PRESETS, lm_loss
from mp_toolkit.optim.master import PRECISIONS, resolve_precision
from tools.report import header, json_line


def pass_s(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Seconds of one forward and backward (the loss on fp32 logits); the gradients are dropped."""
    t0 = time.perf_counter()
    lm_loss(model(x).float(), y).backward()
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return dt


def run(model_name: str, batch: int, seq: int, steps: int) -> dict[str, list[float]]:
    """Seconds of each timed pass, per precision."""
    torch.manual_seed(0)
    base = GPT(PRESETS[model_name])
    models = {name: copy.deepcopy(base).to(dtype) for name, dtype in PRECISIONS.items()}  # the same weights, rounded
    ids = torch.randint(0, PRESETS[model_name].vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(steps + 1):
        for name, model in models.items():
            dt = pass_s(model, x, y)
            if i > 0:  # the first pass of each warms its kernels up
                times[name].append(dt)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-small-cpu", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="timed passes per precision (after one untimed)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's own choice")
    args = ap.parse_args()
    head = header("bench_precision")
    if args.threads:
        torch.set_num_threads(args.threads)
    times = run(args.model, args.batch, args.seq, args.steps)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    auto = resolve_precision("auto", torch.device("cpu"))
    threads = torch.get_num_threads()
    print(f"\n{args.model}, {args.batch} x {args.seq} tokens, forward + backward, {threads} thread"
          f"{'s' * (threads > 1)}; median of {args.steps} passes; --precision auto picks {auto} on this CPU")
    print(f"{'precision':9s} {'s / pass':>9s} {'x fp32':>7s}")
    for name, s in median.items():
        print(f"{name:9s} {s:9.3f} {s / median['fp32']:7.2f}")
    json_line("bench_precision", head, model=args.model, batch=args.batch, seq=args.seq, steps=args.steps,
              threads=threads, auto_picks=auto, median_s=median,
              x_fp32={name: s / median["fp32"] for name, s in median.items()}, times_s=times)


if __name__ == "__main__":
    main()
