"""Tensor parallelism per transformer block: TP=2 against TP=1, time and bytes communicated.

One GPT block (width 256, 8 heads, MLP 1024; 4 sequences of 128 tokens by default) runs
forward + backward on one process (TP=1) and sharded over two gloo ranks (TP=2, Megatron's
column/row split via `apply_tensor_parallel`), one thread per rank, in alternation. Every
all-reduce the block issues is counted on the way through `torch.distributed.all_reduce`, and
compared with the analytic volume of Shoeybi et al. 2019: two all-reduces of the block's (B, T, C)
activations in the forward (after the attention and MLP row-parallel projections) and two in the
backward (the gradients entering the column-parallel QKV and MLP inputs).

    python -m tools.bench_tp [--width 256 --heads 8 --batch 4 --seq 128 --steps 10]

Prints the machine header (`tools.report`), the figures and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from model_zoo.gpt import GPTBlock, GPTConfig
from mp_toolkit.layers import LayerList
from mp_toolkit.parallel.context import build_context
from mp_toolkit.parallel.tensor_parallel import apply_tensor_parallel
from mp_toolkit.run.launch import init_distributed, launcher_env
from tools.ranks import run_ranks
from tools.report import header, json_line

BLOCK_PLAN = {"attn.qkv": "qkv", "attn.proj": "row", "mlp.fc": "column", "mlp.proj": "row"}


def _block(width: int, heads: int) -> LayerList:
    torch.manual_seed(0)
    return LayerList([("h.0", GPTBlock(GPTConfig(vocab_size=64, n_embd=width, n_head=heads)))])


def _time_block(layers, x, steps: int) -> list[float]:
    times = []
    for _ in range(steps + 2):
        inp = x.detach().requires_grad_(True)
        t0 = time.perf_counter()
        layers(inp).sum().backward()
        times.append(time.perf_counter() - t0)
        for p in layers.parameters():
            p.grad = None
    return times[2:]


def tp2_rank(spec: dict) -> dict:
    """One of the two TP ranks (`tools.ranks.run_ranks`): the block sharded over both, one counted step
    (every all-reduce it issues, on the way through ``torch.distributed.all_reduce``), then timed ones."""
    init_distributed(launcher_env(), spec["timeout_s"] / 2)
    torch.set_num_threads(1)
    ctx = build_context(pp=1, tp=dist.get_world_size())
    layers = apply_tensor_parallel(_block(spec["width"], spec["heads"]), ctx, BLOCK_PLAN)
    torch.manual_seed(1)
    x = torch.randn(spec["batch"], spec["seq"], spec["width"])
    calls: list[int] = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):  # counts what the block really sends, then sends it
        calls.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        layers(x.detach().requires_grad_(True)).sum().backward()  # one counted step
    finally:
        dist.all_reduce = original
    return {"times": _time_block(layers, x, spec["steps"]), "allreduce_bytes": calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="TP=1 / TP=2 alternations")
    a = ap.parse_args()
    head = header("bench_tp")
    torch.set_num_threads(1)
    one, two, sent = [], [], None
    x = torch.randn(a.batch, a.seq, a.width)
    for _ in range(a.rounds):
        one += _time_block(_block(a.width, a.heads), x, a.steps)
        spec = {"width": a.width, "heads": a.heads, "batch": a.batch, "seq": a.seq, "steps": a.steps}
        result = run_ranks("tools.bench_tp:tp2_rank", spec, 2, timeout_s=300)
        two += result[0]["times"]
        sent = result[0]["allreduce_bytes"]
    t1, t2 = statistics.median(one) * 1e3, statistics.median(two) * 1e3
    activation = a.batch * a.seq * a.width * 4
    analytic = [activation] * 4
    print(f"GPT block width {a.width}, {a.heads} heads, {a.batch} x {a.seq} tokens, fp32, 1 thread per rank")
    print(f"TP=1 forward+backward {t1:.2f} ms   TP=2 {t2:.2f} ms   speed-up {t1 / t2:.2f}x")
    print(f"all-reduces per step: {len(sent)} of {[b // 1024 for b in sent]} KiB "
          f"(analytic: 4 of {activation // 1024} KiB = {sum(analytic) / 2**20:.2f} MiB; measured "
          f"{sum(sent) / 2**20:.2f} MiB); ring traffic per rank {sum(sent) * 2 * (2 - 1) / 2 / 2**20:.2f} MiB")
    json_line("bench_tp", head, width=a.width, heads=a.heads, batch=a.batch, seq=a.seq, tp1_ms=t1, tp2_ms=t2,
              speedup=t1 / t2, allreduce_bytes=sent, analytic_bytes=analytic,
              matches_analytic=sorted(sent) == sorted(analytic))


if __name__ == "__main__":
    main()
