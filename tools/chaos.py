"""Chaos run: SIGKILL random ranks of a 2-rank `mpt train --restarts N` job and measure the recoveries.

    python -m tools.chaos --kills 3                      # gpt-tiny, pp 2, 60 steps saved every 5
    python -m tools.chaos --kills 5 --steps 120 --save-every 10 --seed 7 --json runs/chaos.json

1. an uninterrupted reference run of the same command;
2. the chaos run with ``--restarts`` (kills + 1): ``--kills`` times, at a random step (uniform over
   the next 2 x --save-every steps) and a random moment inside it, one random rank gets SIGKILL from
   here; its launcher stops the other rank and restarts both from the latest checkpoint;
3. for each kill: the step it hit, the checkpoint the restart resumed from, the steps redone, and the
   time to recover (seconds from the kill to the end of the first step of the restarted ranks, read
   off the ``time`` field of the metrics rows);
4. every tensor (parameters and optimizer state) of both final checkpoints, read with
   `mp_toolkit.checkpoint.open_checkpoint`, compared bit for bit, and the per-step losses.

Prints the machine header (`tools.report`), a table, then one JSON line (also written to --json).
Results with date and machine go into RELIABILITY.md. Not imported by the library.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from mp_toolkit.checkpoint import open_checkpoint
from mp_toolkit.run.spawn import rank_of
from tools.ranks import RunError, mpt, mpt_argv
from tools.report import header, json_line


def train_args(a: argparse.Namespace, root: Path) -> list[str]:
    return ["train", "--model", a.model, "--data", "synthetic", "--pp", "2", "--micro-batch", "2", "--seq-len", "16",
            "--microbatches", "3", "--threads", "1", "--no-progress", "--lr", "1e-2", "--steps", str(a.steps),
            "--save-every", str(a.save_every), "--save-dir", str(root / "ck"), "--metrics", str(root / "m.jsonl")]


def rows(path: Path) -> list[dict]:
    """The metrics file's complete rows (a line being written is skipped)."""
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def rank_pids(parent: int) -> dict[int, int]:
    """{RANK: pid} of the training processes the launcher ``parent`` started (`run.spawn.rank_of`)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == parent and stat[0] != "Z" and (rank := rank_of(int(entry.name))) is not None:
            out[rank] = int(entry.name)
    return out


class Lines(threading.Thread):
    """Reads a pipe in the background; keeps (arrival time, line) and echoes each line."""

    def __init__(self, stream, echo):
        super().__init__(daemon=True)
        self.stream, self.echo, self.lines = stream, echo, []

    def run(self):
        for line in self.stream:
            self.lines.append((time.time(), line.rstrip("\n")))
            self.echo.write(line)
            self.echo.flush()

    def first(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line), None)


def run_reference(a, root: Path) -> float:
    t0 = time.time()
    try:
        mpt(*train_args(a, root), timeout_s=a.timeout)
    except RunError as e:
        sys.exit(f"chaos: the reference run failed: {str(e)[-500:]}")
    return time.time() - t0


def wait_for(predicate, timeout: float, what: str, job: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if job.poll() is not None:
            sys.exit(f"chaos: the job ended (exit {job.returncode}) while waiting for {what}")
        time.sleep(0.01)
    sys.exit(f"chaos: timed out after {timeout:.0f} s waiting for {what}")


def one_kill(a, rng: random.Random, i: int, job: subprocess.Popen, err: Lines, metrics: Path) -> dict:
    """Kill a random rank at a random step, then wait until the restarted ranks finish a step."""
    done = max((r["step"] for r in rows(metrics)), default=0)
    target = min(a.steps - 2, done + rng.randint(1, 2 * a.save_every))
    wait_for(lambda: max((r["step"] for r in rows(metrics)), default=0) >= target, a.timeout, f"step {target}", job)
    step_times = [r["step_time_s"] for r in rows(metrics)[1:]] or [0.05]
    time.sleep(rng.uniform(0, 1.5 * statistics.median(step_times)))  # somewhere inside a step (or its save)
    pids = rank_pids(job.pid)
    rank = rng.choice(sorted(pids))
    before = max((r["step"] for r in rows(metrics)), default=0)
    t_kill = time.time()
    os.kill(pids[rank], signal.SIGKILL)
    restart = f"restart {i + 1} of {a.restarts}"
    wait_for(lambda: err.first(restart), a.timeout, f"'{restart}'", job)
    t_restart = err.first(restart)
    row = wait_for(lambda: next((r for r in rows(metrics) if r.get("time", 0) > t_restart), None), a.timeout,
                   "the first step after the restart", job)
    return {"kill": i + 1, "rank": rank, "last_step_done": before, "resumed_from": row["step"] - 1,
            "steps_redone": before - (row["step"] - 1), "restart_after_s": round(t_restart - t_kill, 2),
            "recover_s": round(row["time"] - t_kill, 2)}


def compare(ref: Path, got: Path) -> dict:
    """Every tensor of both final checkpoints: how many differ, and the largest absolute difference."""
    a, b = open_checkpoint(ref / "ck"), open_checkpoint(got / "ck")
    names, differ, worst = 0, [], 0.0
    for layer in a.layer_names:
        ta, tb = dict(a.read_layer(layer)), dict(b.read_layer(layer))
        for which, ck in ((ta, a), (tb, b)):
            for param, state in ck.read_optimizer(layer)[0].items():
                which.update({f"{param}:{k}": v for k, v in state.items()})
        for name in sorted(ta.keys() | tb.keys()):
            names += 1
            if name not in ta or name not in tb or not torch.equal(ta[name], tb[name]):
                differ.append(name)
                if name in ta and name in tb:
                    worst = max(worst, float((ta[name].double() - tb[name].double()).abs().max()))
    losses_equal = [r["loss"] for r in rows(ref / "m.jsonl")] == [r["loss"] for r in rows(got / "m.jsonl")]
    return {"tensors": names, "tensors_differing": len(differ), "max_abs_diff": worst, "first_differing": differ[:5],
            "final_steps": [a.step, b.step], "losses_equal": losses_equal}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--seed", type=int, default=0, help="seeds the choice of ranks, steps and moments")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any one wait may take")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--work-dir", type=Path, default=None, help="default: a temporary directory")
    a = p.parse_args()
    a.restarts = a.kills + 1
    head = header("chaos")
    rng = random.Random(a.seed)
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="mpt-chaos-"))
    ref, got = work / "reference", work / "chaos"
    print(f"chaos: work dir {work}; reference run ...", flush=True)
    ref_s = run_reference(a, ref)
    cmd = mpt_argv(*train_args(a, got), "--restarts", str(a.restarts))
    t0 = time.time()
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    err = Lines(job.stderr, sys.stderr)
    err.start()
    kills = []
    try:
        for i in range(a.kills):
            kills.append(one_kill(a, rng, i, job, err, got / "m.jsonl"))
        code = job.wait(timeout=a.timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    err.join(timeout=5)
    chaos_s = time.time() - t0
    result = {"model": a.model, "steps": a.steps, "save_every": a.save_every, "seed": a.seed, "exit_code": code,
              "recoveries": len(kills) if code == 0 else 0,
              "kills": kills, "reference_s": round(ref_s, 1), "chaos_s": round(chaos_s, 1),
              **compare(ref, got)}
    print(f"\n{'kill':>4} {'rank':>4} {'step hit':>8} {'resumed':>7} {'redone':>6} {'restart s':>9} {'recover s':>9}")
    for k in kills:
        print(f"{k['kill']:>4} {k['rank']:>4} {k['last_step_done'] + 1:>8} {k['resumed_from']:>7} "
              f"{k['steps_redone']:>6} {k['restart_after_s']:>9.2f} {k['recover_s']:>9.2f}")
    print(f"exit {code}; {result['recoveries']} of {a.kills} recovered; final tensors differing: "
          f"{result['tensors_differing']} of {result['tensors']} (max abs diff {result['max_abs_diff']:g}); "
          f"losses equal: {result['losses_equal']}; reference {ref_s:.1f} s, chaos run {chaos_s:.1f} s")
    json_line("chaos", head, path=a.json, **result)
    return 0 if code == 0 and result["tensors_differing"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
