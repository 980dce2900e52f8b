"""Memory a gloo collective holds beyond its own input and output, on 2 CPU ranks: why ZeRO-1 under gloo
all-reduces in place and gathers by broadcasts instead of calling gloo's reduce-scatter and
all-gather (`mp_toolkit.parallel.zero`, its module docstring).

    python -m tools.bench_collectives              # one 128 MiB fp32 tensor, about 30 s
    python -m tools.bench_collectives --mib 32

Each rank (`tools.ranks.run_ranks`, gloo over 127.0.0.1) maps every large block on its own so that
its resident memory follows the live tensors (`mp_toolkit.partition.memstats.map_large_blocks`),
pays torch's one-time costs and runs each collective once on a small tensor first. Then, per
collective: the input and output are allocated and written (their pages resident), the peak is
reset and the baseline taken, the collective runs, and the rank reports its peak resident memory
above that baseline -- what the call itself held. The calls, as ZeRO-1 makes them on a bucket of
``--mib`` MiB over the ranks:

* ``reduce_scatter_single``: the whole bucket in, this rank's range out;
* ``all_gather_single``: this rank's range in, the whole bucket out;
* ``all_reduce``: the whole bucket, in place (ZeRO-1's reduce-scatter under gloo);
* ``broadcast``: each rank's range of the whole bucket from its owner, in place (its all-gather under gloo).

Prints the machine header (`tools.report`), a table and, last, one JSON line. Resident memory does
not depend on the machine's load.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from mp_toolkit.partition import memstats
from mp_toolkit.run.launch import init_distributed, launcher_env
from tools.ranks import run_ranks
from tools.report import header, json_line

MIB = 2**20
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch 2.13's name first
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def collectives(whole: int, world: int) -> dict:
    """name -> (make the tensors: (input, output), run the collective on them), for a bucket of
    ``whole`` fp32 elements split into ``world`` ranges."""
    part = whole // world

    def broadcast_ranges(x, _):
        for r in range(world):
            dist.broadcast(x[r * part:(r + 1) * part], src=r)

    return {
        "reduce_scatter_single": (lambda: (torch.rand(whole), torch.zeros(part)),
                                  lambda x, out: REDUCE_SCATTER(out, x, op=dist.ReduceOp.SUM)),
        "all_gather_single": (lambda: (torch.rand(part), torch.zeros(whole)), lambda x, out: ALL_GATHER(out, x)),
        "all_reduce": (lambda: (torch.rand(whole), None), lambda x, _: dist.all_reduce(x)),
        "broadcast": (lambda: (torch.rand(whole), None), broadcast_ranges),
    }


def held_bytes(make, run) -> dict:
    """The collective's input and output bytes, and the peak resident memory above them during it."""
    x, out = make()
    memstats.release_free_memory()
    dist.barrier()
    reset = memstats.reset_peak()
    base = memstats.anon_bytes()
    run(x, out)
    held = memstats.peak_anon_bytes() - base  # not the library code the collective pages in
    sizes = {"input_bytes": x.numel() * 4, "output_bytes": out.numel() * 4 if out is not None else 0}
    del x, out
    memstats.release_free_memory()
    return {**sizes, "held_bytes": held, "peak_reset": reset}


def collective_rank(spec: dict) -> dict:
    """One rank: every collective of `collectives` on a small bucket (warm-up), then on ``spec["mib"]``."""
    init_distributed(launcher_env(), spec["timeout_s"] / 2)
    memstats.map_large_blocks()
    memstats.warm_runtime()
    rank, world = dist.get_rank(), dist.get_world_size()
    for make, run in collectives(1024 * world, world).values():  # gloo's one-time buffers, not the figure
        run(*make())
    whole = spec["mib"] * MIB // 4 // world * world
    return {"rank": rank, "rows": {name: held_bytes(make, run)
                                   for name, (make, run) in collectives(whole, world).items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128, help="the bucket: MiB of fp32 over all ranks")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    head = header("bench_collectives")
    ranks = run_ranks("tools.bench_collectives:collective_rank", {"mib": args.mib}, args.ranks,
                      timeout_s=args.timeout)
    print(f"\ngloo, {args.ranks} ranks, a bucket of {args.mib} MiB fp32; MiB per rank")
    held_by = "held beyond them, rank " + "/".join(map(str, range(args.ranks)))
    print(f"{'collective':22s} {'input':>7s} {'output':>7s} {held_by:>34s}")
    for name, row in ranks[0]["rows"].items():
        held = " / ".join(f"{r['rows'][name]['held_bytes'] / MIB:.1f}" for r in ranks)
        print(f"{name:22s} {row['input_bytes'] / MIB:7.1f} {row['output_bytes'] / MIB:7.1f} {held:>34s}")
    if not all(row["peak_reset"] for r in ranks for row in r["rows"].values()):
        print("warning: /proc/self/clear_refs refused a peak reset: the figures are peaks since the start")
    json_line("bench_collectives", head, mib=args.mib, ranks=ranks)


if __name__ == "__main__":
    main()
