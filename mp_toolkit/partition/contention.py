"""The load a run's other ranks put on this machine, reproduced while ``mpt plan`` times layers.

A pipeline's ranks compute at the same time, one per core (or per group of ``threads`` cores),
and they share the memory bandwidth and the last-level cache. A layer timed in a process of its
own on an otherwise idle machine gets all of both: on this machine's 2 cores a GPT block took
17% longer with a memory-bound loop beside it than alone, a matrix product beside it cost
nothing, and the LM head + loss (a softmax over B x T x V logits, memory bound) was timed ~35%
under what the last stage of a real 1F1B run spends on it. So while the layers are timed,
`concurrent_load` keeps ``count`` helper processes running the same model's forward and backward
on the same micro-batch shape, each with the run's threads per rank: the neighbours a rank has.

A helper is ``python -m mp_toolkit.partition.load_helper MODEL MICRO_BATCH SEQ DTYPE THREADS``;
it prints ``ready`` after its first forward + backward and stops when its standard input closes
(so it never outlives the planner), or when it is terminated.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from contextlib import contextmanager

READY_TIMEOUT_S = 120.0


def helpers_for(ranks: int, threads: int, cpus: int | None = None) -> int:
    """How many other ranks of a ``ranks``-process run compute beside the measured one on this
    machine: as many as its cores hold at ``threads`` each, less the measured one."""
    cpus = cpus or os.cpu_count() or 1
    return max(0, min(ranks, cpus // max(1, threads)) - 1)


def default_threads(ranks: int, cpus: int | None = None) -> int:
    """Threads per rank as ``mpt train`` picks them without ``--threads``: the cores shared out."""
    return max(1, (cpus or os.cpu_count() or 1) // max(1, ranks))


@contextmanager
def concurrent_load(model: str, micro_batch: int, seq_len: int, dtype: str, threads: int, count: int):
    """Run ``count`` helper processes (see the module docstring) for the duration of the block;
    yields them (``subprocess.Popen``), each past its first forward + backward. A helper that
    fails to start is an error, not ignored: the timings would be an idle machine's."""
    procs: list[subprocess.Popen] = []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    argv = [sys.executable, "-m", "mp_toolkit.partition.load_helper", model, str(micro_batch), str(seq_len),
            dtype, str(threads)]
    try:
        for _ in range(count):
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env))
        for p in procs:
            _wait_ready(p)
        yield procs
    finally:
        for p in procs:
            _stop(p)


def _wait_ready(p: subprocess.Popen) -> None:
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(p.stdout.readline()), daemon=True)
    reader.start()
    reader.join(READY_TIMEOUT_S)
    if not box or box[0].strip() != "ready":
        _stop(p)
        err = (p.stderr.read() or "").strip().splitlines()
        raise RuntimeError("a load helper for the layer timings did not start"
                           + (f": {err[-1]}" if err else f" within {READY_TIMEOUT_S:.0f} s"))


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            p.stdin.close()  # the helper's cue to stop
        except OSError:
            pass
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
