"""One rank of `profile_here.measure_links`: joins the measurement's process group, times its
messages, prints one JSON line and exits.

    python -m mp_toolkit.partition.link_rank RANK WORLD PORT BACKEND DEVICE LARGE_BYTES TIMEOUT_S

PORT is the parent's store (`torch.distributed.TCPStore` on 127.0.0.1, which the parent serves);
BACKEND ``gloo`` (CPU tensors) or ``nccl`` (rank r on ``cuda:r``); DEVICE ``cpu`` or ``cuda``, the
kind the profile describes: on ``cuda`` rank 0 also reports its device's used bytes once its
context and communicator exist. Every wait is bounded by TIMEOUT_S (the process group's timeout).

Rank 0 reports, in seconds: the median round trip of a 1-element and of a LARGE_BYTES message to
rank 1 and back (ranks past 1 take no part), and the mean of one all-reduce of each size over all
ranks, each after a millisecond of compute on every rank (`after_compute_s`), as a run's layers
reach their all-reduces: what a rank waits for includes waking its peers' threads. Every rank reports its resident
memory right after joining: the interpreter, torch and the process group, no tensor yet.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from mp_toolkit.partition.memstats import anon_bytes, release_free_memory, rss_bytes

WARMUP, SMALL_REPEATS, LARGE_REPEATS = 3, 30, 8
"""Discarded first calls (gloo's and NCCL's connection set-up), then the timed ones per size."""
BUSY_S = 1e-3
"""Compute before each timed all-reduce (`computing`): about a small model's layer."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(step, device: torch.device, repeats: int, before=lambda: None, center=statistics.median) -> float:
    """The median (or ``center``) time of ``step`` (``before`` it, untimed, each time) after `WARMUP` calls."""
    times = []
    for i in range(WARMUP + repeats):
        before()
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return center(times)


def round_trip_s(x: torch.Tensor, rank: int, repeats: int) -> float:
    """Rank 0: the median time of sending ``x`` to rank 1 and receiving it back (0 elsewhere).

    Each receive is posted before its message arrives, as a pipeline posts its receives
    (`mp_toolkit.parallel.p2p`). A blocking ``recv`` called after the message arrived costs gloo
    a handshake: on a 2-core VM that made the 1-element round trip ~4 ms instead of ~0.3 ms."""
    bufs = [torch.empty_like(x), torch.empty_like(x)]  # rank 1's next receive lands beside the one it sends back
    total, times = WARMUP + repeats, []
    if rank == 1:
        pending = dist.irecv(bufs[0], 0)
        for i in range(total):
            pending.wait()
            if i + 1 < total:
                pending = dist.irecv(bufs[(i + 1) % 2], 0)
            dist.send(bufs[i % 2], 0)
    elif rank == 0:
        for _ in range(total):
            reply = dist.irecv(bufs[0], 1)
            _sync(x.device)
            t0 = time.perf_counter()
            dist.send(x, 1)
            reply.wait()
            _sync(x.device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:]) if times else 0.0


def computing(device: torch.device, seconds: float = BUSY_S):
    """A fixed amount of work, about ``seconds`` of small matrix products here (the device
    synchronised after): a layer's compute before its all-reduce."""
    a = torch.ones(64, 64, device=device)
    t0, count = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds / 4:
        a @ a
        count += 1
    count *= 4

    def work() -> None:
        for _ in range(count):
            a @ a
        _sync(device)
    return work


def after_compute_s(x: torch.Tensor, device: torch.device, repeats: int) -> float:
    """What an all-reduce of ``x`` adds to a loop of compute + all-reduce over every rank (seconds,
    mean per call): the loop's time less the same compute's alone. The time includes waiting for
    the ranks that finish their compute later and waking the threads of those that wait."""
    work = computing(device)
    alone = _median_s(work, device, repeats)

    def both() -> None:
        work()
        dist.all_reduce(x)
    return max(0.0, _median_s(both, device, repeats, center=statistics.mean) - alone)


def measure(rank: int, device: torch.device, large_bytes: int) -> dict:
    small, large = torch.ones(1, device=device), torch.ones(large_bytes // 4, device=device)
    return {"small_bytes": small.numel() * 4, "large_bytes": large.numel() * 4,
            "p2p_round_trip_s": [round_trip_s(x, rank, n) for x, n in ((small, SMALL_REPEATS), (large, LARGE_REPEATS))],
            # the mean over calls that follow compute, as a run's layers reach theirs (after an idle
            # barrier instead: ~0.2 ms here for a small message, against the ~2 ms each of a
            # tensor-parallel run's all-reduces costs it)
            "allreduce_s": [after_compute_s(x, device, n) for x, n in ((small, SMALL_REPEATS), (large, LARGE_REPEATS))]}


def main(argv: list[str]) -> None:
    rank, world, port = int(argv[0]), int(argv[1]), int(argv[2])
    backend, kind, large_bytes, timeout_s = argv[3], argv[4], int(argv[5]), float(argv[6])
    torch.set_num_threads(1)  # one thread per rank, as the profile's per-core rates are
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    out = {"rank": rank, "rss_bytes": rss_bytes(), "anon_bytes": anon_bytes()}
    try:
        dist.all_reduce(torch.ones(1, device=device))  # NCCL's communicator and its buffers exist from here
        if kind == "cuda" and rank == 0:
            torch.ones(1, device="cuda:0")  # the context (gloo's ranks hold none otherwise)
            free, total = torch.cuda.mem_get_info(0)
            out["cuda_used_bytes"] = total - free
        out.update(measure(rank, device, large_bytes))
        release_free_memory()  # what the round's tensors left in the heap is not the group's
        # the group's buffers and threads after a round of messages (not the code the round paged in)
        out["anon_after_bytes"] = anon_bytes()
    finally:
        dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
