"""The jobs of tests/test_fault_tolerance.py: `mpt train`, torchrun or bare ranks as real processes.

Every process of a job (the launcher, its ranks, torchrun's agent and workers) inherits a marker in
its environment, so the test can find each one through /proc whatever session it runs in, assert
that none outlives the job, and SIGKILL any that would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

from mp_toolkit.checkpoint import open_checkpoint
from mp_toolkit.run.launch import free_port
from mp_toolkit.run.spawn import rank_of

MARK = "MPT_FAULT_TEST_JOB"
TRAIN = ["train", "--model", "gpt-tiny", "--data", "synthetic", "--micro-batch", "2", "--seq-len", "16",
         "--microbatches", "3", "--threads", "1", "--no-progress", "--lr", "1e-2", "--pp", "2", "--steps", "8"]
"""Eight AdamW steps of gpt-tiny on two pipeline stages (the planner's default schedule: ZB-V here), fp32."""


def processes_with(mark: str) -> list[int]:
    """Pids of the live (not zombie) processes whose environment holds ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def rank_pid(mark: str, rank: int) -> int | None:
    """The pid of the training process of global rank ``rank`` (`run.spawn.rank_of`; not torchrun's agent)."""
    for pid in processes_with(mark):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"torchrun" not in cmdline and rank_of(pid) == rank:
            return pid
    return None


class Job:
    """One command run as its own session; stdout and stderr go to files (no pipe can fill up)."""

    def __init__(self, cmd: list[str], tmp: Path, env: dict | None = None, name: str = "job"):
        self.mark = uuid.uuid4().hex
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        full_env = dict(os.environ, OMP_NUM_THREADS="1", **{MARK: self.mark}, **(env or {}))
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=full_env, start_new_session=True)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    @property
    def stdout(self) -> str:
        return self.out.read_text()

    @property
    def stderr(self) -> str:
        return self.err.read_text()

    def survivors(self, settle_s: float = 5.0) -> list[int]:
        """Processes of this job still alive ``settle_s`` after the job's first process ended."""
        deadline = time.monotonic() + settle_s
        while (left := processes_with(self.mark)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def kill(self) -> None:
        """SIGKILL every process of the job (the finally of each test)."""
        for pid in processes_with(self.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def mpt_job(tmp: Path, *args: str, faults: dict | None = None, name: str = "job") -> Job:
    env = {"MPT_FAULTS": json.dumps(faults)} if faults else {}
    return Job([sys.executable, "-m", "mp_toolkit.cli", *TRAIN, *args], tmp, env, name)


def torchrun_job(tmp: Path, *args: str, faults: dict | None = None, max_restarts: int = 1) -> Job:
    env = {"MPT_FAULTS": json.dumps(faults)} if faults else {}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(max_restarts), "--monitor-interval", "0.2", "-m", "mp_toolkit.cli", *TRAIN, *args]
    return Job(cmd, tmp, env, "torchrun")


def bare_ranks(tmp: Path, *args: str, faults: dict | None = None) -> list[Job]:
    """Two ranks started with only the variables a launcher sets (no watchdog, no agent)."""
    port = str(free_port())
    jobs = []
    for rank in range(2):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, **({"MPT_FAULTS": json.dumps(faults)} if faults else {})}
        jobs.append(Job([sys.executable, "-m", "mp_toolkit.cli", *TRAIN, *args], tmp, env, f"rank{rank}"))
    return jobs


def proc_state(pid: int) -> str:
    """/proc's state letter of ``pid`` (T: stopped); X when it is gone, Z a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def watch_hang(job: Job, ranks: tuple[int, ...], hung: int, timeout: float) -> dict[str, float]:
    """Seconds from the moment rank ``hung`` is seen stopped (state T) to its job's line naming a
    hung rank (``named_s``) and to every one of ``ranks``' processes of that start being gone
    (``stopped_s``). Polls /proc every 20 ms; ``timeout`` bounds the whole watch."""
    deadline = time.monotonic() + timeout
    pids: dict[int, int] = {}
    while len(pids) < len(ranks) and time.monotonic() < deadline:
        pids.update({r: p for r in ranks if r not in pids and (p := rank_pid(job.mark, r)) is not None})
        time.sleep(0.02)
    while proc_state(pids[hung]) != "T" and time.monotonic() < deadline:
        time.sleep(0.02)
    t0 = time.monotonic()
    named = None
    while time.monotonic() < deadline:
        if named is None and " hung " in job.stderr:
            named = time.monotonic() - t0
        if all(proc_state(p) in ("X", "Z") for p in pids.values()):
            break
        time.sleep(0.02)
    return {"named_s": named if named is not None else float("nan"), "stopped_s": time.monotonic() - t0,
            "pid": pids[hung]}


def log_hang(figures: dict, scenario: str) -> None:
    """Append one JSON line of ``watch_hang``'s figures to $MPT_HANG_LOG (the 20-run spread), when set."""
    if os.environ.get("MPT_HANG_LOG"):
        with open(os.environ["MPT_HANG_LOG"], "a") as f:
            f.write(json.dumps({"scenario": scenario, **figures, "time": time.time()}) + "\n")


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tensors(root: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of a checkpoint (``latest`` when ``step`` is None)."""
    ck = open_checkpoint(root if step is None else root / f"step-{step:08d}")
    out = {}
    for layer in ck.layer_names:
        out.update(ck.read_layer(layer))
        for param, state in ck.read_optimizer(layer)[0].items():
            out.update({f"{param}:{key}": value for key, value in state.items()})
    return out


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bitwise equal (or present in one only)."""
    return sorted(set(a) ^ set(b)) + [k for k in sorted(a.keys() & b.keys()) if not torch.equal(a[k], b[k])]
