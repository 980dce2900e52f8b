"""LAMB step time over ~25M fp32 parameters against a naive per-tensor loop, torch-optimizer's
``Lamb`` (when importable), torch's multi-tensor AdamW, and the memory-bandwidth bound.

The bound: an exact LAMB step must at least read params, grads and both moments and write params
and both moments, 7 x 4 bytes per parameter; divided by the copy bandwidth measured here
(``dst.copy_(src)`` of a params-sized tensor moves 2 x 4 bytes per element). No real LAMB reaches
it: the trust ratio needs the whole tensor's update norm before the first element can be written.
Copy bandwidth is pessimistic on x86 (the destination is read before it is written), so the
table also shows the same bytes over in-place streaming bandwidth (``a.add_(b)``), the rate a
one-pass fused AdamW can reach.

    python -m tools.bench_optim                 # 1 and 2 threads, ~1 minute
    python -m tools.bench_optim --threads 1 --steps 5

Prints the machine header (`tools.report`), a table and, last, one JSON line. The tensors are shaped
like a 4-layer GPT of width 640 (token and position embeddings, 16 matrices, 34 bias / LayerNorm vectors).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from mp_toolkit.optim.lamb import LAMB
from tools.report import header, json_line


def gpt_like_shapes(width: int = 640, layers: int = 4, vocab: int = 8192, positions: int = 512) -> list[tuple]:
    shapes = [(vocab, width), (positions, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    return shapes + [(width,), (width,)]


def timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def copy_fn(numel: int):
    """A params-sized ``dst.copy_(src)``: 2 x 4 bytes moved per element."""
    src, dst = torch.rand(numel), torch.empty(numel)
    return lambda: dst.copy_(src)


def inplace_fn(numel: int):
    """A params-sized ``a.add_(b)``: 3 x 4 bytes moved per element, no write-allocate traffic."""
    a, b = torch.zeros(numel), torch.rand(numel)
    return lambda: a.add_(b)


def candidates() -> dict:
    """name -> optimizer factory (lr and weight decay as BERT's LAMB recipe)."""
    out = {
        "LAMB (ours, multi-tensor)": lambda ps: LAMB(ps, lr=1e-3, weight_decay=0.01),
        "LAMB (ours, per-tensor loop)": lambda ps: LAMB(ps, lr=1e-3, weight_decay=0.01, foreach=False),
        "torch AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
        "torch AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
    }
    try:
        import torch_optimizer
        out["torch-optimizer Lamb"] = lambda ps: torch_optimizer.Lamb(ps, lr=1e-3, weight_decay=0.01)
    except ImportError as e:  # bench-only dependency: pip install --no-deps torch-optimizer
        print(f"torch-optimizer not importable ({e}); its row is skipped")
    return out


def run(threads: list[int], steps: int, warmup: int = 2) -> dict:
    """Median step time of every optimizer over the same tensors. The candidates take turns step
    by step (round robin), so a change in machine load hits all of them alike; the gradients are
    restored (untimed) before each step because LAMB leaves its update direction in them."""
    torch.manual_seed(0)
    shapes = gpt_like_shapes()
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    grads = [torch.randn(s) * 1e-3 for s in shapes]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    numel = sum(p.numel() for p in params)
    results = {"numel": numel, "tensors": len(params), "steps": steps, "threads": {}}
    for n in threads:
        torch.set_num_threads(n)
        fns = {"copy": copy_fn(numel), "inplace": inplace_fn(numel)}
        fns.update({name: make(params).step for name, make in candidates().items()})
        times: dict[str, list[float]] = {name: [] for name in fns}
        for i in range(warmup + steps):
            for name, fn in fns.items():
                for p, g in zip(params, grads):
                    p.grad.copy_(g)
                t = timed_ms(fn)
                if i >= warmup:
                    times[name].append(t)
        bw = 2 * 4 * numel / (statistics.median(times.pop("copy")) / 1e3)
        inplace_bw = 3 * 4 * numel / (statistics.median(times.pop("inplace")) / 1e3)
        row = {"copy_GBps": bw / 1e9, "bound_ms": 1e3 * 7 * 4 * numel / bw,
               "inplace_GBps": inplace_bw / 1e9, "inplace_bound_ms": 1e3 * 7 * 4 * numel / inplace_bw}
        row.update({name: statistics.median(ts) for name, ts in times.items()})
        results["threads"][n] = row
        del fns
    return results


def print_table(results: dict) -> None:
    threads, rows = list(results["threads"]), results["threads"]
    extra = ("copy_GBps", "bound_ms", "inplace_GBps", "inplace_bound_ms")
    names = [k for k in rows[threads[0]] if k not in extra]
    print(f"\n{results['numel'] / 1e6:.1f}M fp32 parameters in {results['tensors']} tensors, median of "
          f"{results['steps']} steps; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"{'':34s}" + "".join(f"| {n} thread{'s' if n > 1 else ' '}: ms  x bound " for n in threads))
    line = lambda label, cells: print(f"{label:34s}" + "".join(cells))  # noqa: E731
    line("copy bandwidth, GB/s", (f"| {rows[n]['copy_GBps']:11.1f}           " for n in threads))
    line("bound: 28 B/param / copy BW", (f"| {rows[n]['bound_ms']:11.1f}    1.00   " for n in threads))
    for name in names:
        line(name, (f"| {rows[n][name]:11.1f} {rows[n][name] / rows[n]['bound_ms']:7.2f}   " for n in threads))
    line("(in-place a.add_(b) BW, GB/s)", (f"| {rows[n]['inplace_GBps']:11.1f}           " for n in threads))
    line("(28 B/param / in-place BW)", (f"| {rows[n]['inplace_bound_ms']:11.1f} "
                                         f"{rows[n]['inplace_bound_ms'] / rows[n]['bound_ms']:7.2f}   "
                                         for n in threads))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=9, help="timed steps per optimizer (after 2 warm-up steps)")
    args = ap.parse_args()
    head = header("bench_optim")
    results = run(args.threads, args.steps)
    print_table(results)
    json_line("bench_optim", head, **results)


if __name__ == "__main__":
    main()
