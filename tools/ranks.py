"""Start one run of ``tools/peers.py`` as N ranks on 127.0.0.1, with a bounded time, and collect
each rank's JSON result. Every process started here is in its own session and is killed (with its
children) when the run fails, times out, or the parent exits.

Used by ``tools/bench_pipeline.py`` and ``tools/bench_memory.py``; not imported by the library.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mp_toolkit.run.launch import free_port

PEERS_PY = Path(__file__).with_name("peers.py")
_LIVE: list[subprocess.Popen] = []  # processes this module started and has not reaped


class RunError(RuntimeError):
    """A run that failed or timed out; the message carries the tail of the failing rank's log."""


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the rank's own session: it and whatever it started
        except (ProcessLookupError, PermissionError):
            p.kill()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def kill_all() -> None:
    while _LIVE:
        _kill(_LIVE.pop())


def _on_signal(signum, _frame):
    kill_all()
    raise SystemExit(128 + signum)


atexit.register(kill_all)
for _sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, _on_signal)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_ranks(spec: dict, nprocs: int, timeout_s: float = 600.0, threads: int = 1) -> list[dict]:
    """Run ``python tools/peers.py SPEC`` on ``nprocs`` ranks; return the rank results in rank order.

    Ranks get the launcher variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT), ``threads`` OpenMP threads each, and DS_ACCELERATOR=cpu. Raises RunError with
    the log tail of the first rank that failed, or when the run exceeds ``timeout_s``.
    """
    with tempfile.TemporaryDirectory(prefix="bench_run_") as tmp:
        out = Path(tmp)
        spec = {**spec, "out_dir": str(out), "timeout_s": timeout_s}
        port = free_port()
        procs, logs = [], []
        for rank in range(nprocs):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu",
                       PYTHONUNBUFFERED="1")
            log = out / f"rank{rank}.log"
            logs.append(log)
            with open(log, "w") as f:
                p = subprocess.Popen([sys.executable, str(PEERS_PY), json.dumps(spec)], env=env, stdout=f,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=PEERS_PY.parent.parent)
            procs.append(p)
            _LIVE.append(p)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                codes = [p.poll() for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    r = failed[0]
                    raise RunError(f"rank {r} exited with {codes[r]}:\n{_tail(logs[r])}")
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    raise RunError(f"timed out after {timeout_s:.0f}s; rank 0 log:\n{_tail(logs[0])}")
                time.sleep(0.1)
        finally:
            for p in procs:
                _kill(p)
                if p in _LIVE:
                    _LIVE.remove(p)
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nprocs)]
