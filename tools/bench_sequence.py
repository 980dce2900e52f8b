"""Sequence parallelism per transformer block: what a tp rank keeps, and its time, with and without it.

One GPT-2-medium-shaped block (width 1024, 16 heads, MLP 4096; 1 sequence of 1024 tokens by default,
fp32; ``--dropout P`` on the residuals and the attention probabilities, GPT-2's 0.1 by default: CPU
attention then keeps its (heads, s, s) tensors, which selective recomputation drops) on two gloo
ranks at tp 2, four ways: plain tp, tp with selective recomputation, tp + sequence parallelism, and
tp + sequence parallelism + selective recomputation (`model_zoo.gpt.SP_PLAN`,
`mp_toolkit.parallel.sequence_parallel`). For each, the bytes autograd keeps on a rank for one
micro-batch are counted with ``saved_tensors_hooks`` (one count per storage, parameters left out: what
``mpt plan``'s activation bytes model, `mp_toolkit.partition.measure`), next to the planner's
(`layer_costs(..., tp=2, sp=...)`, less what selective recomputation drops); and the block's forward +
backward is timed (median of ``--steps``, one thread per rank).

    python -m tools.bench_sequence [--width 1024 --heads 16 --batch 1 --seq 1024 --dropout 0.1 --steps 3]

Prints the machine header (`tools.report`), a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from model_zoo.gpt import SP_PLAN, TP_PLAN, GPTBlock, GPTConfig
from mp_toolkit.layers import LayerList
from mp_toolkit.parallel.context import build_context
from mp_toolkit.parallel.sequence_parallel import apply_sequence_parallel
from mp_toolkit.parallel.tensor_parallel import apply_tensor_parallel
from mp_toolkit.partition.cost import ACT_BYTES, layer_costs, model_shape
from mp_toolkit.partition.recompute import recompute_costs
from mp_toolkit.run.launch import init_distributed, launcher_env
from tools.ranks import run_ranks
from tools.report import header, json_line

MODES = (("tp", False, "none"), ("tp + selective", False, "selective"), ("tp + sp", True, "none"),
         ("tp + sp + selective", True, "selective"))
BLOCK_TP = {k: v for k, v in TP_PLAN.items() if k.startswith(("attn.", "mlp."))}
BLOCK_SP = {k: v for k, v in SP_PLAN.items() if k.startswith(("attn", "mlp"))}


def _block(spec: dict, ctx, sp: bool, recompute: str) -> LayerList:
    torch.manual_seed(0)
    p = spec["dropout"]
    config = GPTConfig(vocab_size=64, n_embd=spec["width"], n_head=spec["heads"], n_positions=spec["seq"],
                       resid_pdrop=p, attn_pdrop=p)
    layers = apply_tensor_parallel(LayerList([("h.0", GPTBlock(config))]), ctx, BLOCK_TP)
    if sp:
        apply_sequence_parallel(layers, ctx, BLOCK_SP)
    layers.layers[0].recompute = recompute
    return layers


def _kept_bytes(layers: LayerList, x: torch.Tensor) -> int:
    params = {p.untyped_storage().data_ptr() for p in layers.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    layers.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layers(x.detach().requires_grad_(True))
    y.sum().backward()
    return sum(seen.values())


def sp_rank(spec: dict) -> dict:
    """One of the two tp ranks (`tools.ranks.run_ranks`): each mode's kept bytes and times."""
    init_distributed(launcher_env(), spec["timeout_s"] / 2)
    torch.set_num_threads(1)
    ctx = build_context(pp=1, tp=dist.get_world_size())
    torch.manual_seed(1)
    x = torch.randn(spec["batch"], spec["seq"], spec["width"])
    out = {}
    for name, sp, recompute in MODES:
        layers = _block(spec, ctx, sp, recompute)
        mine = x.chunk(ctx.tp, dim=1)[ctx.tp_rank].clone() if sp else x  # its own storage, as a message has
        kept = _kept_bytes(layers, mine)
        times = []
        for _ in range(spec["steps"]):
            dist.barrier()
            t0 = time.perf_counter()
            layers(mine.detach().requires_grad_(True)).sum().backward()
            times.append(time.perf_counter() - t0)
        out[name] = {"kept_bytes": kept, "ms": 1e3 * statistics.median(times)}
    return out


def planned(spec: dict) -> dict[str, int]:
    """The planner's kept bytes of one block at tp 2 in each mode."""
    shape = model_shape("gpt2-medium")
    shape = replace(shape, hidden=spec["width"], heads=spec["heads"], ffn=4 * spec["width"],
                    attn_dropout=spec["dropout"], hidden_dropout=spec["dropout"])
    out = {}
    for name, sp, recompute in MODES:
        costs = layer_costs(shape, spec["batch"], spec["seq"], "fp32", tp=2, sp=sp)
        kept = costs[1].activation_bytes
        if recompute == "selective":
            rc = recompute_costs(shape, costs, [(0.0, 0.0)] * len(costs), spec["batch"], spec["seq"],
                                 ACT_BYTES["fp32"], 2)
            kept -= rc.selective_saved[1]
        out[name] = kept
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dropout", type=float, default=0.1, help="residual and attention dropout (GPT-2's 0.1)")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    head = header("bench_sequence")
    spec = {"width": a.width, "heads": a.heads, "batch": a.batch, "seq": a.seq, "steps": a.steps, "dropout": a.dropout}
    ranks = run_ranks("tools.bench_sequence:sp_rank", spec, 2, timeout_s=600)
    plan = planned(spec)
    base = ranks[0]["tp"]["kept_bytes"]
    print(f"GPT block width {a.width}, {a.heads} heads, {a.batch} x {a.seq} tokens, fp32, dropout {a.dropout}, tp 2, "
          "1 thread per rank")
    print(f"{'mode':22s} {'kept MiB':>9s} {'/ plain tp':>10s} {'planned MiB':>12s} {'fwd+bwd ms':>11s}")
    rows = {}
    for name, _, _ in MODES:
        kept = max(r[name]["kept_bytes"] for r in ranks)
        ms = statistics.median(r[name]["ms"] for r in ranks)
        rows[name] = {"kept_bytes": kept, "ratio": kept / base, "planned_bytes": plan[name], "ms": ms}
        print(f"{name:22s} {kept / 2**20:9.2f} {kept / base:10.3f} {plan[name] / 2**20:12.2f} {ms:11.1f}")
    json_line("bench_sequence", head, **spec, modes=rows)


if __name__ == "__main__":
    main()
