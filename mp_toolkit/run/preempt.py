"""Graceful preemption: SIGTERM or SIGUSR1 stops every rank after the same step, saved (RELIABILITY.md).

Schedulers ask a job to stop with SIGTERM (Kubernetes, SLURM at the end of a time limit) or a
signal of the job's choosing (SLURM ``--signal=USR1@120``), then kill it after a grace period::

    signal on any rank (or on the mpt launcher, which forwards it to every rank)
      -> that rank notes it and finishes the step in flight
      -> at the end of every step one MAX all-reduce of the flag: every rank agrees on the same step
      -> the job saves that step (with --save-dir; not a step that counts toward --max-skips)
      -> rank 0 prints one line, every rank exits EXIT_PREEMPTED (5); `--resume auto` continues
         bitwise, as after a restart
    a second signal, more than DEBOUNCE_S after the first -> the rank exits at once (128 + signal)
    a signal before the first step (building, loading, reading the data: nothing to save yet)
      -> the rank exits at once (128 + signal), rank 0 saying so in one line

The flag is set by a thread reading CPython's signal wakeup fd, not by the Python-level handler:
that one runs only when the main thread is between bytecodes, so a second signal would wait for a
blocked collective. Duplicates within DEBOUNCE_S are one request: a scheduler that signals every
process and a launcher that forwards the signal deliver it twice.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from mp_toolkit.run.launch import FORWARDED_SIGNALS

DEBOUNCE_S = 1.0


class Preempted(Exception):
    """Every rank agreed to stop after a step because of a signal; the message is rank 0's line."""


class PreemptSignals:
    """Catches FORWARDED_SIGNALS in this process from ``install`` to ``restore`` (main thread only)."""

    def __init__(self, speak: bool = True):
        self.speak = speak
        """This rank says why it stops (rank 0)."""
        self.training = False
        """Set by `begin` before the first step; until then a signal stops the rank at once."""
        self.received: signal.Signals | None = None
        self.first_at = 0.0
        self.previous: dict = {}
        self.wakeup_fd: int | None = None
        self.reader: socket.socket | None = None

    def install(self) -> "PreemptSignals":
        if threading.current_thread() is not threading.main_thread():
            return self  # an in-process caller's thread (tests): nothing to catch
        self.reader, writer = socket.socketpair()
        writer.setblocking(False)
        self.writer = writer
        self.wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for sig in FORWARDED_SIGNALS:
            self.previous[sig] = signal.signal(sig, lambda *_: None)  # the reader thread acts
        threading.Thread(target=self._read, name="mpt-signals", daemon=True).start()
        return self

    def _read(self) -> None:
        while True:
            try:
                data = self.reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in FORWARDED_SIGNALS:
                    self._got(signal.Signals(signum))

    def _got(self, sig: signal.Signals) -> None:
        now = time.monotonic()
        if not self.training:
            self._exit(sig, "before the first step: stopping at once (nothing trained, nothing saved)")
        if self.received is None:
            self.received, self.first_at = sig, now
        elif now - self.first_at > DEBOUNCE_S:
            self._exit(sig, "again: stopping at once")

    def _exit(self, sig: signal.Signals, why: str) -> None:
        if self.speak:
            sys.stderr.write(f"mpt train: {sig.name} {why}\n")
            sys.stderr.flush()
        os._exit(128 + sig)

    def begin(self) -> None:
        """The first step starts: from here a signal stops every rank after the same step, saved."""
        self.training = True

    def restore(self) -> None:
        if self.reader is None:
            return
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self.wakeup_fd if self.wakeup_fd is not None else -1)
        self.reader.close()
        self.writer.close()
        self.reader = None

    def agreed(self, device: torch.device) -> signal.Signals | None:
        """The signal any rank received so far, agreed by every rank (one MAX all-reduce), else None."""
        flag = torch.tensor([int(self.received or 0)], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        return signal.Signals(value) if value else None
