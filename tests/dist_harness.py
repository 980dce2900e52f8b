"""Run a function on N gloo ranks on 127.0.0.1 with a bounded time, cleaning up every process.

Ranks are forked from one server process per test session that has imported torch and the
toolkit already (multiprocessing's ``forkserver`` with a preload): a rank starts in milliseconds
instead of the seconds a fresh interpreter needs to import torch, and still starts from a clean
state, since the server never runs a kernel, a thread pool or a process group. The environment a
rank sees is the test's at the moment it starts (the server's own is that of its first use).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from datetime import timedelta

from mp_toolkit.run.launch import free_port

PRELOAD = ["torch", "torch.distributed", "mp_toolkit.run.loop", "mp_toolkit.engine.pipeline",
           "mp_toolkit.parallel.tensor_parallel", "mp_toolkit.cli", "mp_toolkit.commands.train",
           "mp_toolkit.commands.plan", "mp_toolkit.commands.simulate", "tests.dist_harness", "tests.mpt_command"]
"""What the fork server imports once, so that no rank imports it again."""

_CONTEXT: list = []


def fork_context():
    """The session's forkserver context, its preload set before the server first starts."""
    if not _CONTEXT:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def _entry(fn, rank, world, port, args, results, timeout_s, environ):
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the test's environment now, not the fork server's from its start
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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


def _collect(results, procs: list, timeout_s: float) -> tuple[dict, list[str]]:
    """({rank: result}, errors): every rank's report, the first failure, a rank that exited without
    reporting (e.g. it could not unpickle its function: its stderr says why), or the timeout."""
    out, errors = {}, []
    deadline = time.monotonic() + timeout_s
    exited_at: dict[int, float] = {}
    while len(out) < len(procs) and not errors:
        try:
            rank, ok, value = results.get(timeout=0.5)
        except queue.Empty:
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r not in out and p.exitcode is not None:
                    exited_at.setdefault(r, now)
            # 2 s after a rank exits, a report it sent at exit has arrived
            silent = [r for r, at in exited_at.items() if r not in out and now - at > 2.0]
            if silent:
                errors.append(f"rank {silent[0]} exited with code {procs[silent[0]].exitcode} without reporting "
                              "(see its stderr)")
            elif now > deadline:
                errors.append(f"timed out after {timeout_s}s waiting for {len(procs) - len(out)} rank(s)")
            continue
        if ok:
            out[rank] = pickle.loads(value)
        else:
            errors.append(f"rank {rank}:\n{value}")
    return out, errors


def run_world(fn, world: int, *args, timeout_s: float = 120.0) -> list:
    """fn(rank, world, *args) on ``world`` processes; returns the results by rank."""
    ctx = fork_context()
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, results, timeout_s / 2, environ),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    errors = ["interrupted"]
    try:
        out, errors = _collect(results, procs, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world)]
