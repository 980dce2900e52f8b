"""Launching: the only module that reads the launcher's environment.

`torchrun` and the `deepspeed` launcher set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT (torchrun also LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE; the ranks on this node).
The deepspeed launcher also passes ``--local_rank=N``, which the CLI accepts and ignores. Run without a
launcher, `mpt train` starts the ranks itself on this machine with exactly those variables
(`run.spawn.spawn_local`), so both paths run the same training code.

When a rank dies (RELIABILITY.md)::

    gloo            a dead peer's sockets close: the others' collective or p2p call fails at once;
                    a hung (stopped) peer: every wait ends after --timeout (init_process_group)
    each survivor   one line naming the lost rank(s) when they ran on this host (pid table, `Peers`)
    spawn_local     the watchdog sees the child die, names it and its step (each rank reports its
                    phase through a pipe, `RankStatus`), stops the others; --restarts N starts the
                    ranks again with --resume auto
    torchrun        its elastic agent stops the other workers; --max-restarts N restarts them (use
                    --resume auto); `init_distributed` keeps each restart's rendezvous keys apart
    a hung rank     the other ranks' heartbeat judges name it within --hang-timeout (`run.watchdog`,
                    over `heartbeat_store`), SIGKILL it when on their host and exit EXIT_HUNG
    SIGTERM/SIGUSR1 spawn_local forwards them; every rank stops after the same step (`run.preempt`)

    torchrun --nproc_per_node 2 --max-restarts 3 -m mp_toolkit.cli train --model gpt-tiny --pp 2 \\
             --seq-len 64 --data synthetic --save-dir runs/x --save-every 50 --resume auto
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mp_toolkit.run.faults import Faults

_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
EXIT_CONFIG = 2
"""A value, a layout or a checkpoint was refused (one line said why): a restart would fail the same way."""
EXIT_DIVERGED = 3
"""--max-skips consecutive steps were skipped for non-finite values: a restart would repeat them."""
EXIT_HUNG = 4
"""A rank was found hung by the heartbeats (`run.watchdog`) and named; restarted like a dead rank."""
EXIT_PREEMPTED = 5
"""SIGTERM / SIGUSR1: every rank finished the step in flight and the job saved it (`run.preempt`)."""
EXIT_REPLICAS = 6
"""--check-replicas found data-parallel replicas that differ (one line named the tensor); nothing was saved.
Restarted by --restarts / --max-restarts: the latest checkpoint was checked before it was written."""
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_SIGNALLED = tuple(128 + sig for sig in FORWARDED_SIGNALS)
"""A forwarded signal before the first step (`run.preempt`): the rank stopped at once, nothing to save."""
QUIET_EXITS = (EXIT_CONFIG, EXIT_DIVERGED, EXIT_PREEMPTED, EXIT_REPLICAS, 130, *EXIT_SIGNALLED)
"""Exits whose rank already said why in one line: the mpt launcher adds nothing."""
NOT_RESTARTED = (EXIT_CONFIG, EXIT_DIVERGED, EXIT_PREEMPTED, 130, *EXIT_SIGNALLED)
"""Signals that ask a run to stop after the step in flight (schedulers' preemption; SLURM --signal)."""


class PeerLost(RuntimeError):
    """A collective or point-to-point call failed because another rank died or stopped answering."""


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    attempt: int = 0
    """Restarts before this one (spawn_local's MPT_RESTART_COUNT, torchrun's TORCHELASTIC_RESTART_COUNT)."""
    status_fd: int | None = None
    """Write end of the pipe to spawn_local's watchdog; None under another launcher."""
    store_fd: int | None = None
    """spawn_local: rank 0's rendezvous store serves this listening socket (bound to 127.0.0.1)."""
    faults: Faults = field(default_factory=Faults)
    """Test-only fault injection (``MPT_FAULTS``)."""
    run_plan: str | None = None
    """spawn_local: the run plan its process resolved, as JSON (``MPT_RUN_PLAN``, `run.plan.RunPlan.to_json`);
    None under another launcher: each rank resolves the run itself."""

    @property
    def started_by_mpt(self) -> bool:
        return self.status_fd is not None


def launcher_env() -> LaunchEnv | None:
    """The launcher's view of this process, or None when no launcher started it."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    fd = os.environ.get("MPT_STATUS_FD")
    return LaunchEnv(
        rank=int(os.environ["RANK"]), world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world))),
        attempt=int(os.environ.get("MPT_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))),
        status_fd=int(fd) if fd else None, faults=Faults.parse(os.environ.get("MPT_FAULTS")),
        store_fd=int(os.environ["MPT_STORE_FD"]) if os.environ.get("MPT_STORE_FD") else None,
        run_plan=os.environ.get("MPT_RUN_PLAN") if fd else None,
    )


def local_faults() -> Faults:
    """``MPT_FAULTS`` for a one-process run (no launcher environment)."""
    return Faults.parse(os.environ.get("MPT_FAULTS"))


def device_and_backend(local_rank: int, local_world_size: int, gpus: int) -> tuple[torch.device, str]:
    """(this rank's device, the process group's backend) on a machine with ``gpus`` CUDA devices.

    No GPU: CPU and gloo. A GPU for each local rank: ``cuda:LOCAL_RANK`` and NCCL. Fewer GPUs than
    local ranks (e.g. a pipeline of 2 ranks on one GPU): ranks share ``cuda:LOCAL_RANK % gpus``
    and join gloo, since NCCL refuses two ranks on one device ("Duplicate GPU detected"); their
    pipeline messages go through host memory (`mp_toolkit.parallel.host_staging`)."""
    if gpus == 0:
        return torch.device("cpu"), "gloo"
    return torch.device("cuda", local_rank % gpus), "nccl" if gpus >= local_world_size else "gloo"


def init_distributed(env: LaunchEnv, timeout_s: float) -> torch.device:
    """Join the default process group: NCCL when every local rank has a GPU of its own, gloo
    otherwise (CPU, or ranks sharing a GPU: `device_and_backend`). Returns the device.

    ``timeout_s`` bounds every gloo collective and point-to-point wait (and NCCL's watchdog).
    Under torchrun's agent store each restart gets its own key prefix: torch 2.13's agent reuses one
    store across restarts, and a restarted rank otherwise reads the dead attempt's gloo addresses
    ("Gloo connectFullMesh failed ... Connection refused", observed with --max-restarts).
    """
    device, backend = device_and_backend(env.local_rank, env.local_world_size, torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.world_size > 1 and not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        store = None
        if env.store_fd is not None:  # spawn_local: rank 0 serves the launcher's loopback socket
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                                  is_master=env.rank == 0, timeout=timeout,
                                  master_listen_fd=env.store_fd if env.rank == 0 else None)
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                                   is_master=False, timeout=timeout)
            store = dist.PrefixStore(f"mpt/attempt_{env.attempt}", client)
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout, store=store)
    return device


class RankStatus:
    """What this rank is doing ("during start-up", "during step 5", "while saving step 4"), for the
    lines that report a failure; under spawn_local each change also goes down the pipe to the watchdog.
    ``step`` is the step in flight (None outside a step), ``first_step`` the first one of this start:
    the heartbeats (`run.watchdog`) read both."""

    def __init__(self, env: LaunchEnv):
        self.fd, self.phase = env.status_fd, "during start-up"
        self.step: int | None = None
        self.first_step: int | None = None
        if self.fd is not None:
            _die_with_parent()

    def set(self, phase: str, step: int | None = None) -> None:
        if step is not None and self.first_step is None:
            self.first_step = step
        self.phase, self.step = phase, step
        if self.fd is not None:
            try:
                os.write(self.fd, (phase + "\n").encode())
            except BrokenPipeError:  # the mpt launcher is gone: nobody will stop or restart this rank
                sys.stderr.write("mpt train: error: the mpt launcher of this rank is gone, stopping\n")
                os._exit(1)


def _die_with_parent() -> None:
    """Linux: SIGHUP this rank when the mpt launcher dies, even by SIGKILL (prctl PR_SET_PDEATHSIG).
    Not SIGTERM, which now asks for a graceful stop (`run.preempt`): with its launcher gone nobody
    would report or restart the rank, so SIGHUP's default action ends it at once."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGHUP)
    except (OSError, AttributeError):
        pass  # elsewhere the pipe's EPIPE at the next step stops the rank


@dataclass(frozen=True)
class Peers:
    """(host id, pid) of every rank, exchanged once after the process group forms, so that a survivor
    can tell which ranks on its host are gone when a call fails."""

    rank: int
    table: tuple[tuple[int, int], ...]

    @classmethod
    def exchange(cls, rank: int, world_size: int, device: torch.device) -> "Peers":
        mine = torch.tensor([host_id(), os.getpid()], dtype=torch.int64, device=device)
        rows = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(rows, mine)
        return cls(rank, tuple((int(r[0]), int(r[1])) for r in rows))

    def lost(self, wait_s: float = 3.0) -> list[tuple[int, int]]:
        """(rank, pid) of this host's ranks whose process has ended; waits a little, as a peer's
        sockets close a moment before its process is gone."""
        deadline = time.monotonic() + wait_s
        while True:
            gone = [(r, pid) for r, (host, pid) in enumerate(self.table)
                    if r != self.rank and host == host_id() and not _running(pid)]
            if gone or time.monotonic() > deadline:
                return gone
            time.sleep(0.1)


def host_id() -> int:
    return zlib.crc32(socket.gethostname().encode())


def proc_state(pid: int) -> str:
    """/proc's one-letter state of ``pid`` (R, S, T stopped, Z zombie, ...); X when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def _running(pid: int) -> bool:
    return proc_state(pid) not in ("Z", "X")  # a zombie is dead, only not yet reaped


def heartbeat_store(env: LaunchEnv, timeout_s: float) -> tuple[dist.Store, bool]:
    """(a connection of this rank's own to the rendezvous store, whether rank 0 serves that store): the
    heartbeats' side channel (`run.watchdog`). Under torchrun its agent serves the store, which outlives
    a restart, so the keys are per attempt; under mpt, the deepspeed launcher, bare ranks and torchrun
    with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 rank 0 serves a store of this start's own (the agents of an
    elastic job count their restarts apart, so no attempt number is in the keys)."""
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timedelta(seconds=max(timeout_s, 1.0)), wait_for_workers=False)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.PrefixStore(f"mpt/heartbeat/attempt_{env.attempt}" if agent else "mpt/heartbeat", client), not agent


def is_comm_failure(e: BaseException) -> bool:
    """A failed gloo / NCCL call (a peer died, closed its connection or timed out)."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("gloo" in text or "nccl" in text or isinstance(e, dist.DistError))


def comm_failure_line(e: BaseException, peers: Peers | None, rank: int, phase: str) -> str:
    """One line for a survivor: which rank it lost (when known), during what, and the backend's words."""
    detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    detail = detail.split("] ", 1)[-1].split(". This is typically")[0]  # drop the C++ source location
    gone = peers.lost() if peers is not None else []
    if gone:
        who = ", ".join(f"rank {r} (pid {pid})" for r, pid in gone)
        return f"rank {rank} lost {who} {phase} ({detail}); stopping"
    return (f"rank {rank}: communication with another rank failed {phase} ({detail}); the rank that "
            "stopped is named by its launcher")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
