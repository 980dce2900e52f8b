"""Heartbeats: every rank finds the hung one and the job stops naming it (RELIABILITY.md, issue 22).

Each rank runs two daemon threads once the process group has formed:

    beat    every ~1 s writes this rank's key in the rendezvous store (one small JSON value:
            counter, pid, host, phase, step, whether the main thread waits on communication)
            and reads every rank's key plus ``hung`` in one ``multi_get``
    judge   never touches the store; from what ``beat`` last read it decides:

    rank r's counter stopped for --hang-timeout       r is stopped (SIGSTOP, a frozen host)
    rank r in a step, its step unchanged for longer    r is stuck outside communication (a hung
      than its limit, main thread not communicating   kernel, a deadlock in its own code)
    every rank in a step, all waiting on each other    a communication deadlock: all are named
    the store gave no answer for --hang-timeout       the store's host is stopped (rank 0 under
                                                      mpt, the deepspeed launcher, bare ranks;
                                                      rank 0 never judges the store it serves)

Beats are judged as of the last successful read, so a rank whose own threads were starved of CPU
blames nobody for the gap. A step's limit is max(--hang-timeout, 4 x this rank's longest step so
far), and 5 x --hang-timeout for the first step of a start (start-up costs: compiling, --partition
time measuring). Start-up, saves and evaluation are judged by the counter only. The first rank to decide
writes its line to the ``hung`` key (compare-and-set, so one line is printed), SIGKILLs the hung ranks on its own host
(a stopped process cannot stop itself, and launchers give SIGTERM 30 s before SIGKILL) and exits
EXIT_HUNG; every other rank sees the key within a beat and exits EXIT_HUNG silently. Launchers then
restart as for a dead rank (--restarts, torchrun --max-restarts). --timeout stays the second
line of defence: a rank whose heartbeat thread cannot run (--hang-timeout 0) still times out there.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from mp_toolkit.run.launch import EXIT_HUNG, LaunchEnv, RankStatus, heartbeat_store, host_id

FIRST_STEP_FACTOR = 5
"""The first step of a start may take this many --hang-timeout (start-up, compilation, measuring)."""
STEP_FACTOR = 4
"""A later step may take this many times the rank's longest step so far, when that exceeds --hang-timeout."""
_COMM_FILES = ("torch/distributed/", "mp_toolkit/parallel/p2p.py", "mp_toolkit/parallel/data_parallel.py",
               "mp_toolkit/parallel/zero.py", "mp_toolkit/parallel/tp_comms.py")


def beat_interval(hang_timeout_s: float) -> float:
    """Seconds between beats: a tenth of the timeout, between 0.1 and 1 s."""
    return min(1.0, max(0.1, hang_timeout_s / 10))


def main_thread_communicating() -> bool:
    """Whether the main thread's innermost Python frame is a communication call (a collective,
    a point-to-point wait): a rank stuck there waits on another rank and is not the hung one."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return frame is not None and any(part in frame.f_code.co_filename.replace("\\", "/") for part in _COMM_FILES)


@dataclass
class Seen:
    """What the judge knows of one rank: its last beat and when its counter and step last moved."""

    beat: dict
    counter_at: float
    step_at: float
    longest_step_s: float = 0.0

    def update(self, beat: dict, now: float) -> None:
        if beat.get("n") != self.beat.get("n"):
            self.counter_at = now
        if beat.get("step") != self.beat.get("step"):
            if self.beat.get("step") is not None and not self.beat.get("first"):  # start-up costs aside
                self.longest_step_s = max(self.longest_step_s, now - self.step_at)
            self.step_at = now
        self.beat = beat


@dataclass
class Judge:
    """Decides from beats alone (no I/O, so it is tested without processes)."""

    hang_timeout_s: float
    seen: dict[int, Seen] = field(default_factory=dict)

    def update(self, beats: dict[int, dict], now: float) -> None:
        for rank, beat in beats.items():
            if rank in self.seen:
                self.seen[rank].update(beat, now)
            else:
                self.seen[rank] = Seen(beat, now, now)

    def step_limit(self, s: Seen) -> float:
        if s.beat.get("first"):
            return FIRST_STEP_FACTOR * self.hang_timeout_s
        return max(self.hang_timeout_s, STEP_FACTOR * s.longest_step_s)

    def hung(self, now: float) -> tuple[list[int], str] | None:
        """(the hung ranks, the line naming them), or None while every rank is alive and moving;
        ``now`` is the time of the last read of the beats (what is known, not when it is judged)."""
        live = {r: s for r, s in sorted(self.seen.items()) if not s.beat.get("done")}
        limit = self.hang_timeout_s
        stopped = [r for r, s in live.items() if now - s.counter_at > limit]
        if stopped:
            return self.named(stopped, f"no heartbeat for {now - live[stopped[0]].counter_at:.0f} s")
        stuck = {r: s for r, s in live.items()
                 if s.beat.get("step") is not None and now - s.step_at > self.step_limit(s)}
        busy = [r for r, s in stuck.items() if not s.beat.get("comm")]
        if busy:
            return self.named(busy, f"no progress for {now - live[busy[0]].step_at:.0f} s outside communication")
        if stuck and len(stuck) == len(live):
            return self.named(list(stuck), f"every rank waiting on communication for "
                                           f"{min(now - s.step_at for s in stuck.values()):.0f} s (a deadlock)")
        return None

    def named(self, ranks: list[int], why: str) -> tuple[list[int], str]:
        beats = [self.seen[r].beat if r in self.seen else {} for r in ranks]
        who = ", ".join(f"rank {r} (pid {b.get('pid', '?')})" for r, b in zip(ranks, beats))
        phase = beats[0].get("phase", "during start-up")
        return ranks, f"{who} hung {phase}: {why} (--hang-timeout {self.hang_timeout_s:g}); stopping every rank"


class Heartbeat:
    """This rank's beat and judge threads (module docstring). Creating it writes the first beat;
    ``arm``, once every rank has written its own (after a collective), starts the threads; ``stop``
    writes the last one (``done``)."""

    def __init__(self, env: LaunchEnv, status: RankStatus, hang_timeout_s: float):
        self.env, self.status, self.judge = env, status, Judge(hang_timeout_s)
        self.interval = beat_interval(hang_timeout_s)
        # the judge, not the client, decides when the store is silent: the client's own timeout comes
        # later, so its warnings never precede the line
        self.store, self.rank0_serves = heartbeat_store(env, 2 * hang_timeout_s + 30)
        self.keys = [f"rank{r}" for r in range(env.world_size)]
        self.counter = 0
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.exiting = threading.RLock()  # the judge's decide-print-exit is not cut short by the beat's exit
        self.last_reply = time.monotonic()
        self.store_gone = False
        self.store.compare_set("hung", "", "")  # present from now on, so multi_get never waits for it
        self.beat()
        self.threads: list[threading.Thread] = []

    def beat(self, done: bool = False) -> None:
        self.counter += 1
        step = self.status.step
        self.store.set(self.keys[self.env.rank], json.dumps({
            "n": self.counter, "pid": os.getpid(), "host": host_id(), "phase": self.status.phase, "step": step,
            "first": step is not None and step == self.status.first_step, "comm": main_thread_communicating(),
            "done": done}))

    def arm(self) -> None:
        # every rank wrote its first beat before the collective that precedes this: read them all now,
        # so a rank (or the store's host) that stops before the first beat-loop read is still named
        # with its pid and killed, not "pid ?"
        values = self.store.multi_get(self.keys)
        self.last_reply = now = time.monotonic()  # the store's silence is timed from here
        self.judge.update({r: json.loads(v) for r, v in enumerate(values)}, now)
        for target in (self._beat_loop, self._judge_loop):
            t = threading.Thread(target=target, name=f"mpt-{target.__name__[1:]}", daemon=True)
            t.start()
            self.threads.append(t)

    def stop(self) -> None:
        """This rank is done (finished or failing on its own): the others stop judging it."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        if not self.lock.acquire(timeout=2 * self.interval):
            return  # the beat thread waits on a silent store: nobody is listening for this beat
        try:
            self.beat(done=True)
        except Exception:  # noqa: BLE001 - the store's host may be gone already; nothing to tell
            pass
        finally:
            self.lock.release()

    def _beat_loop(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                with self.lock:
                    if self.stopping.is_set():
                        return
                    self.beat()
                    values = self.store.multi_get([*self.keys, "hung"])
            except Exception:  # noqa: BLE001 - the store closed: its host ended; the failing call says why
                self.store_gone = True
                return
            self.last_reply = now = time.monotonic()
            if values[-1]:
                self._exit(None, [])  # another rank named the hung one and printed the line
            self.judge.update({r: json.loads(v) for r, v in enumerate(values[:-1])}, now)

    def _judge_loop(self) -> None:
        while not self.stopping.wait(self.interval):
            if self.store_gone:
                return
            now = time.monotonic()
            serving = self.rank0_serves and self.env.rank == 0  # its own store is silent only when it is
            if now - self.last_reply > self.judge.hang_timeout_s and not serving:
                self._store_silent(now)
            found = self.judge.hung(self.last_reply)  # as of the last read: a starved beat thread blames nobody
            if found is not None:
                ranks, line = found
                with self.exiting:  # the beat thread may read our own `hung` before we print it
                    self._exit(line if self._claim(line) else None, ranks)

    def _claim(self, line: str) -> bool:
        """Whether this rank is the one to print ``line`` (the first to set ``hung``). Bounded: when the
        store does not answer within a few beats (its host is the hung one), this rank says it."""
        wait_s = 2 * self.interval + 1
        if not self.lock.acquire(timeout=wait_s):
            return True  # the beat thread waits on the store
        answer: list = []

        def ask():
            try:
                answer.append(self.store.compare_set("hung", "", line).decode())
            except Exception:  # noqa: BLE001 - no answer: say it ourselves
                pass

        try:
            asking = threading.Thread(target=ask, daemon=True)
            asking.start()
            asking.join(timeout=wait_s)
            return not answer or answer[0] == line
        finally:
            self.lock.release()

    def _store_silent(self, now: float) -> None:
        silent = f"gave no answer for {now - self.last_reply:.0f} s"
        if self.rank0_serves:
            self._exit(*reversed(self.judge.named([0], f"the rendezvous store it serves {silent}")))
        self._exit(f"the rendezvous store {silent} (--hang-timeout {self.judge.hang_timeout_s:g}); stopping "
                   "this rank", [])

    def _exit(self, line: str | None, hung: list[int]) -> None:
        """Print ``line`` (when this rank is the one to say it), SIGKILL the hung ranks on this host, exit."""
        self.exiting.acquire()  # held until the process ends
        if self.stopping.is_set():
            self.exiting.release()
            return
        if line is not None:
            sys.stderr.write(f"mpt train: error: {line}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        for r in hung:  # then at once out: the main thread would fail talking to them
            beat = self.judge.seen[r].beat if r in self.judge.seen else {}
            if beat.get("host") == host_id() and beat.get("pid") not in (None, os.getpid()):
                try:
                    os.kill(beat["pid"], signal.SIGKILL)
                except OSError:
                    pass
        os._exit(EXIT_HUNG)
