"""Launching: the only module that reads the launcher's environment.

`torchrun` and the `deepspeed` launcher set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT (torchrun also LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE; the ranks on this node).
The deepspeed launcher also passes ``--local_rank=N``, which the CLI accepts and ignores. Run without a launcher, `mpt train` starts the ranks itself on this machine with
exactly those variables (`spawn_local`), so both paths run the same training code.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def launcher_env() -> LaunchEnv | None:
    """The launcher's view of this process, or None when no launcher started it."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    return LaunchEnv(
        rank=int(os.environ["RANK"]), world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world))),
    )


def init_distributed(env: LaunchEnv, timeout_s: float) -> torch.device:
    """Join the default process group: NCCL when CUDA is available, else gloo. Returns the device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if env.world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s))
    return device


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(argv: list[str], nprocs: int, poll_s: float = 0.2, grace_s: float = 5.0) -> int:
    """Run ``python -m mp_toolkit.cli <argv>`` as ``nprocs`` ranks on this machine.

    Returns the first non-zero exit code (0 when all succeed). When one rank fails, the others get
    ``grace_s`` to exit on their own (ranks that agreed on a failure all stop, and the one reporting
    it must finish its line), then are terminated, so no process is left behind; Ctrl-C stops them all.
    """
    port = free_port()
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "mp_toolkit.cli", *argv], env=env))
    code, deadline = 0, None
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc != 0 and code == 0:
                    code, deadline = rc, time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                _terminate(procs)
                procs = []
            time.sleep(poll_s)
    except KeyboardInterrupt:
        code = 130
    finally:
        _terminate(procs)
    return code


def _terminate(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
