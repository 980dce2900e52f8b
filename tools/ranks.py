"""How every tool starts processes: ``run_ranks`` for a function on N ranks, ``mpt`` for the ``mpt``
command (which starts its own ranks, `mp_toolkit.run.spawn`). Every rank started here is in its own
session and is killed (with its children) when the run fails or times out, and when the parent is
stopped (Ctrl-C, SIGTERM, SIGHUP).

A rank is ``python -m tools.ranks MODULE:FUNCTION SPEC_FILE OUT_DIR`` run from the repository
root with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT); it calls ``FUNCTION(spec)``, which joins the process group itself
(`mp_toolkit.run.launch.init_distributed`, or its peer library's own), and pickles what it returns
to ``OUT_DIR/rank{R}.pkl``::

    run_ranks("tools.peers:train", {"peer": "mpt", ...}, nprocs=2)   # -> [rank 0's result, rank 1's]

Not imported by the library.
"""
from __future__ import annotations

import importlib
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from mp_toolkit.run.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
"""The repository root: the working directory of every rank (where ``-m tools.*`` resolves)."""


class RunError(RuntimeError):
    """A run that failed or timed out; the message carries the tail of the failing process's log."""


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the process's own session: it and whatever it started
        except (ProcessLookupError, PermissionError):
            p.kill()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _stop(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through run_ranks, which kills its ranks on the way out


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_ranks(target: str, spec: dict, nprocs: int, timeout_s: float = 600.0, threads: int = 1,
              env: dict[str, str] | None = None) -> list:
    """``target(spec)`` (``"module:function"``) on ``nprocs`` ranks on 127.0.0.1; the results in rank order.

    Each rank gets the launcher variables torchrun sets, ``threads`` OpenMP threads, ``env`` on top of
    this process's environment, and ``spec`` with ``timeout_s`` added (for its process group's own
    timeout). Raises RunError with the log tail of the first rank that failed, or when the run
    exceeds ``timeout_s``.
    """
    with tempfile.TemporaryDirectory(prefix="tools_ranks_") as tmp:
        out = Path(tmp)
        spec_file = out / "spec.json"
        spec_file.write_text(json.dumps({**spec, "timeout_s": timeout_s}))
        port = free_port()
        procs: list[subprocess.Popen] = []
        logs = [out / f"rank{rank}.log" for rank in range(nprocs)]
        previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP)}  # this run only
        try:
            for rank, log in enumerate(logs):
                rank_env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
                            "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                            "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
                            **(env or {})}
                with open(log, "w") as f:
                    procs.append(subprocess.Popen([sys.executable, "-m", "tools.ranks", target, str(spec_file), tmp],
                                                  env=rank_env, stdout=f, stderr=subprocess.STDOUT,
                                                  start_new_session=True, cwd=ROOT))
            _wait(procs, logs, timeout_s)
        finally:  # also on Ctrl-C, SIGTERM and SIGHUP (`_stop`): no rank outlives the run
            for p in procs:
                _kill(p)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(nprocs)]


def _wait(procs: list[subprocess.Popen], logs: list[Path], timeout_s: float) -> None:
    """Until every rank exited 0; RunError at the first that did not, or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            r = failed[0]
            raise RunError(f"rank {r} exited with {codes[r]}:\n{_tail(logs[r])}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise RunError(f"timed out after {timeout_s:.0f}s; rank 0 log:\n{_tail(logs[0])}")
        time.sleep(0.1)


def mpt_argv(*args: str) -> list[str]:
    """The ``mpt`` command as this interpreter runs it (``python -m mp_toolkit.cli``)."""
    return [sys.executable, "-m", "mp_toolkit.cli", *args]


def mpt(*args: str, env: dict[str, str] | None = None, timeout_s: float = 900.0) -> subprocess.CompletedProcess:
    """``mpt ARGS`` with one OpenMP thread (and ``env``), its output captured; RunError with the tail
    of its stderr when it exits non-zero."""
    try:
        r = subprocess.run(mpt_argv(*args), capture_output=True, text=True, timeout=timeout_s,
                           env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    except subprocess.TimeoutExpired:
        raise RunError(f"mpt {' '.join(args)}: timed out after {timeout_s:.0f}s") from None
    if r.returncode != 0:
        raise RunError(f"mpt {' '.join(args)} exited with {r.returncode}:\n{r.stderr[-2000:]}")
    return r


def rank_main(target: str, spec_file: str, out_dir: str) -> None:
    """One rank: ``target(spec)``, its result pickled to ``out_dir/rank{RANK}.pkl``; the process group,
    if the target joined one, left at the end."""
    module, function = target.split(":")
    spec = json.loads(Path(spec_file).read_text())
    try:
        result = getattr(importlib.import_module(module), function)(spec)
        Path(out_dir, f"rank{os.environ['RANK']}.pkl").write_bytes(pickle.dumps(result))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    rank_main(*sys.argv[1:])
