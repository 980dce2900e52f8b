"""Run a function on N gloo ranks on 127.0.0.1 with a bounded time, cleaning up every process."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback
from datetime import timedelta

from mp_toolkit.run.launch import free_port


def _entry(fn, rank, world, port, args, results, timeout_s):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        # Plain pickle bytes: tensors sent through the queue as they are would travel as shared-memory
        # handles that die with this process before the parent reads them.
        results.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # report every failure to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn, world: int, *args, timeout_s: float = 120.0) -> list:
    """fn(rank, world, *args) on ``world`` processes; returns the results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, results, timeout_s / 2), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out, errors = {}, []
    try:
        for _ in range(world):
            rank, ok, value = results.get(timeout=timeout_s)
            (out.__setitem__(rank, pickle.loads(value)) if ok else errors.append(f"rank {rank}:\n{value}"))
            if errors:
                break
    except queue.Empty:
        errors.append(f"timed out after {timeout_s}s waiting for {world - len(out)} rank(s)")
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world)]
