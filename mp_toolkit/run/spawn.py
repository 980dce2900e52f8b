"""`mpt train` starting its own ranks on this machine (no launcher): `spawn_local`, the watchdog
over them, and how each rank process begins.

A rank begins one of two ways, with the same environment a launcher would give it (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and ``MPT_STATUS_FD`` /
``MPT_STORE_FD`` for the pipe and socket below):

    forked      `mpt` run as a command on Linux with a CPU build of torch: each rank is a fork of
                the launcher, which has imported torch and the toolkit once for all of them and
                has run no kernel, thread pool or process group (each rank would otherwise spend
                ~6 s of CPU on its own imports). The rank then calls the CLI's ``main`` and leaves
                with ``os._exit`` (it never returns into the launcher's frames). Its name is
                ``mpt rank N`` (``ps -o comm``, ``/proc/PID/comm``); its environment exists in
                ``os.environ`` only, not in ``/proc/PID/environ``, which a fork cannot change.
    a fresh     ``python -m mp_toolkit.cli <argv>``: with a CUDA / ROCm build of torch (a process
    interpreter that has touched the device runtime cannot fork), off Linux, and when ``main`` is
                called from Python (the caller may hold threads or an OpenMP pool a fork would
                break).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from mp_toolkit.checkpoint import CheckpointError, latest_step
from mp_toolkit.run.launch import EXIT_CONFIG, EXIT_HUNG, FORWARDED_SIGNALS, NOT_RESTARTED, QUIET_EXITS, proc_state

Entry = Callable[[list[str]], int]
"""The CLI's ``main``: what a forked rank runs."""
RANK_NAME = "mpt rank "
"""A forked rank's process name (``/proc/PID/comm``) is this and its global rank."""


def rank_of(pid: int) -> int | None:
    """The global rank of training process ``pid`` on this machine: from its name when the mpt command
    forked it, else from RANK in the environment of a ``mp_toolkit.cli`` interpreter (started fresh,
    or by torchrun); None for any other process, or one that is gone."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        if name.startswith(RANK_NAME):
            return int(name.removeprefix(RANK_NAME))
        if b"mp_toolkit.cli" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return None
        env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        return int(env[b"RANK"]) if b"RANK" in env else None
    except (OSError, ValueError):
        return None


def loopback_listener() -> socket.socket:
    """A TCP socket listening on 127.0.0.1 at a port the kernel picks, for spawn_local's rendezvous
    store: handed to rank 0 open (``TCPStore(master_listen_fd=...)``), so no other process can take
    the port between its choice and its use, and nothing listens beyond this machine."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


def loopback_env() -> dict[str, str]:
    """gloo's own sockets on the loopback interface too, unless the user chose one (GLOO_SOCKET_IFNAME)."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    interfaces = socket.if_nameindex() if hasattr(socket, "if_nameindex") else []
    names = [name for _, name in interfaces if name.startswith("lo")]
    return {"GLOO_SOCKET_IFNAME": names[0]} if names else {}


def can_fork_ranks() -> bool:
    """Whether this process may fork its ranks: Linux, a torch build without a GPU runtime, and no
    thread of ours besides this one (the caller also vouches that no kernel has run here)."""
    return (sys.platform == "linux" and torch.version.cuda is None and torch.version.hip is None
            and threading.active_count() == 1)


class ForkedRank:
    """A rank forked from this process, behind the part of `subprocess.Popen` the watchdog uses."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N for signal N, as Popen says
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _fork_rank(entry: Entry, argv: list[str], rank: int, env: dict[str, str], keep: tuple[int, ...],
               close: list[int], handlers: dict) -> ForkedRank:
    """Fork rank ``rank``: the child takes ``env``, closes ``close`` (fds meant for other ranks or
    for the launcher), gets the signal handlers a fresh interpreter has, runs ``entry(argv)`` and
    exits with its code; an exception escaping it is printed and exits 1, like an interpreter's."""
    sys.stdout.flush()  # else the child would write the launcher's buffered output again
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedRank(pid)
    code = 1
    try:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for fd in close:
            if fd not in keep:
                os.close(fd)
        os.environ.update(env)
        try:
            ctypes.CDLL(None).prctl(15, f"{RANK_NAME}{rank}".encode()[:15], 0, 0, 0)  # PR_SET_NAME
        except (OSError, AttributeError):
            pass
        code = entry(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen | ForkedRank
    status: int  # read end of the rank's status pipe (non-blocking)
    phase: str = "during start-up"
    pending: bytes = b""

    def read_status(self) -> None:
        try:
            while chunk := os.read(self.status, 4096):
                *lines, self.pending = (self.pending + chunk).split(b"\n")
                if lines:
                    self.phase = lines[-1].decode()
        except BlockingIOError:
            pass


def spawn_local(argv: list[str], nprocs: int, restarts: int = 0, save_dir: Path | None = None,
                poll_s: float = 0.1, grace_s: float = 5.0, fork_with: Entry | None = None,
                run_env: dict[str, str] | None = None) -> int:
    """Run ``nprocs`` ranks of ``mpt <argv>`` on this machine; restart them up to ``restarts`` times
    after a rank dies, resuming from ``save_dir``'s latest checkpoint (--resume auto).

    ``fork_with``: the CLI's ``main``, given only by a process that may fork its ranks (see the
    module's docstring and `can_fork_ranks`); otherwise each rank is ``python -m mp_toolkit.cli``.
    Returns 0 when every rank succeeds, else the failing rank's exit code (128 + N for signal N).
    When one rank fails the others get ``grace_s`` to exit on their own (ranks that agreed on a
    failure all stop, and the one reporting it must finish its line), then are terminated, so no
    process is left behind; Ctrl-C stops them all. A failure that a restart would repeat (a refused
    value or checkpoint, exit 2; --max-skips, exit 3) is not restarted, nor is a preempted run
    (SIGTERM or SIGUSR1 to this process is forwarded to every rank, which save and exit 5).
    ``run_env``: more variables for every rank (``MPT_RUN_PLAN``: the run plan resolved here).
    """
    for attempt in range(restarts + 1):
        code, line = _run_ranks(argv, nprocs, attempt, poll_s, grace_s, fork_with, run_env or {})
        if code == 0:
            return 0
        if line:
            sys.stderr.write(f"mpt train: {line}\n")
        if code in NOT_RESTARTED or attempt == restarts:
            return code
        try:
            step = latest_step(save_dir) if save_dir is not None else None
        except CheckpointError as e:
            sys.stderr.write(f"mpt train: error: cannot restart: {e}\n")
            return EXIT_CONFIG
        if step is not None:
            argv = [*argv, "--resume", "auto"]  # the last --resume wins
        where = f"step-{step:08d} in {save_dir}" if step is not None else "the start (no checkpoint yet)"
        sys.stderr.write(f"mpt train: restart {attempt + 1} of {restarts}: resuming from {where}\n")
        sys.stderr.flush()
    return 1


def _run_ranks(argv: list[str], nprocs: int, attempt: int, poll_s: float, grace_s: float,
               fork_with: Entry | None, run_env: dict[str, str]) -> tuple[int, str | None]:
    """One attempt: (exit code, the watchdog's line or None)."""
    listener = loopback_listener()
    port = listener.getsockname()[1]
    ranks: list[_Rank] = []

    def forward(signum, _frame):  # preemption: every rank finishes its step, the job saves and stops
        for r in ranks:
            if r.proc.poll() is None:
                r.proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        for rank in range(nprocs):
            read, write = os.pipe()
            env = dict(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       MPT_STATUS_FD=str(write), MPT_RESTART_COUNT=str(attempt),
                       MPT_STORE_FD=str(listener.fileno()), **loopback_env(), **run_env)
            try:
                fds = (write, listener.fileno()) if rank == 0 else (write,)
                if fork_with is not None:
                    close = [read, listener.fileno(), *(r.status for r in ranks)]
                    proc = _fork_rank(fork_with, argv, rank, env, fds, close, previous)
                else:
                    proc = subprocess.Popen([sys.executable, "-m", "mp_toolkit.cli", *argv],
                                            env=dict(os.environ, **env), pass_fds=fds)
            finally:
                os.close(write)
            os.set_blocking(read, False)
            ranks.append(_Rank(rank, proc, read))
        listener.close()  # rank 0's now: the port closes with it
        return _watch(ranks, poll_s, grace_s)
    except KeyboardInterrupt:
        return 130, None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        listener.close()
        _terminate([r.proc for r in ranks])
        for r in ranks:
            os.close(r.status)


def _watch(ranks: list[_Rank], poll_s: float, grace_s: float) -> tuple[int, str | None]:
    exits: list[tuple[_Rank, int]] = []  # in the order seen
    deadline = None
    while len(exits) < len(ranks):
        for r in ranks:
            r.read_status()
            if r.proc.returncode is None and r.proc.poll() is not None:
                r.read_status()  # what it said last, before it died
                exits.append((r, r.proc.returncode))
                if r.proc.returncode != 0 and deadline is None:
                    deadline = time.monotonic() + grace_s
        if deadline is not None and (time.monotonic() > deadline or all(
                proc_state(r.proc.pid) == "T" for r in ranks if r.proc.returncode is None)):
            break  # the rest have exited, or are stopped (a hung rank cannot exit on its own)
        time.sleep(poll_s)
    failed = [(r, rc) for r, rc in exits if rc != 0]
    if not failed:
        return 0, None
    if any(rc == EXIT_HUNG for _, rc in failed):
        return EXIT_HUNG, None  # a rank named the hung one in its line (and SIGKILLed it)
    # the root cause: a rank killed by a signal (the others then fail talking to it), else the first failure
    cause, rc = next(((r, rc) for r, rc in failed if rc < 0), failed[0])
    others = ", ".join(str(r.rank) for r in ranks if r is not cause)
    stopping = f"; stopping ranks {others}" if others else ""
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.valid_signals() else "?"
        return 128 - rc, f"rank {cause.rank} died (signal {-rc}, {name}) {cause.phase}{stopping}"
    if rc in QUIET_EXITS:
        return rc, None  # the rank said why in its own line
    return rc, f"rank {cause.rank} failed (exit code {rc}) {cause.phase}{stopping}"


def _terminate(procs: list[subprocess.Popen | ForkedRank], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:  # a stopped rank holds SIGTERM pending (its handler cannot run): SIGKILL
            p.send_signal(signal.SIGKILL if proc_state(p.pid) == "T" else signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
