"""Hung-rank check: SIGSTOP one rank of a 2-rank `mpt train` job, N times, and time the detection.

    python -m tools.hang_check --runs 20 --hang-timeout 10          # gpt-tiny, pp 2, mpt's launcher
    python -m tools.hang_check --runs 3 --hang-timeout 60 --json runs/hang.json

Each run starts `mpt train` (its own launcher; heartbeats on), waits until the metrics file has a
random number (2-6) of rows, then SIGSTOPs a random rank from here (a frozen process: its heartbeat
threads stop too). It records, from the SIGSTOP:

- ``named_s``: the first line naming a hung rank on the job's stderr (it must name the stopped one);
- ``ranks_gone_s``: both ranks' processes gone (the stopped one SIGKILLed by the rank that named it);
- ``stopped_s``: the launcher gone too (exit 4 expected; its interpreter's exit included).

Prints the machine header (`tools.report`), one row per run and min / median / max, then one JSON
line (the summary; --json writes it with every run's row). Results with date and machine go into
RELIABILITY.md. Not imported by the library.
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
import time
from pathlib import Path

from tools.chaos import rank_pids
from tools.ranks import mpt_argv
from tools.report import header, json_line


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def one_run(a: argparse.Namespace, rng: random.Random, tmp: Path) -> dict:
    metrics, err = tmp / "m.jsonl", tmp / "err.txt"
    metrics.unlink(missing_ok=True)
    cmd = mpt_argv("train", "--model", "gpt-tiny", "--data", "synthetic", "--pp", "2", "--micro-batch", "2",
                   "--seq-len", "16", "--microbatches", "3", "--threads", "1", "--no-progress", "--steps", "100000",
                   "--hang-timeout", str(a.hang_timeout), "--metrics", str(metrics))
    with open(err, "w") as e:
        job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=e, start_new_session=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        after = rng.randint(2, 6)
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after):
            if job.poll() is not None:
                raise RuntimeError(f"the job ended early: {err.read_text()[-500:]}")
            time.sleep(0.05)
        pids = rank_pids(job.pid)
        hung = rng.choice(sorted(pids))
        os.kill(pids[hung], signal.SIGSTOP)
        t0 = time.monotonic()
        named = ranks_gone = None
        while time.monotonic() - t0 < a.bound:
            if named is None and " hung " in err.read_text():
                named = time.monotonic() - t0
            if ranks_gone is None and not any(alive(p) for p in pids.values()):
                ranks_gone = time.monotonic() - t0
            if job.poll() is not None and ranks_gone is not None:
                break
            time.sleep(0.02)
        stopped = time.monotonic() - t0
        line = next((x for x in err.read_text().splitlines() if " hung " in x), "")
        return {"rank": hung, "named_s": named, "ranks_gone_s": ranks_gone, "stopped_s": stopped, "exit": job.poll(),
                "right_rank": line.startswith(f"mpt train: error: rank {hung} (pid {pids[hung]}) hung "), "line": line}
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--hang-timeout", type=float, default=10.0)
    p.add_argument("--bound", type=float, default=300.0, help="give up on a run after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    head = header("hang_check")
    rng = random.Random(a.seed)
    results = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.runs):
            r = one_run(a, rng, Path(d))
            results.append(r)
            print(f"run {i + 1:2d}: rank {r['rank']} stopped, named after {r['named_s'] or float('nan'):.2f} s "
                  f"(right rank: {r['right_rank']}), both ranks gone after {r['ranks_gone_s'] or float('nan'):.2f} s, "
                  f"the launcher too after {r['stopped_s']:.2f} s, "
                  f"exit {r['exit']}", flush=True)
    summary = {"runs": a.runs, "hang_timeout_s": a.hang_timeout,
               "all_named_right": all(r["right_rank"] for r in results),
               "exits": sorted({r["exit"] for r in results}, key=str)}
    for key in ("named_s", "ranks_gone_s", "stopped_s"):
        values = [r[key] for r in results if r[key] is not None]
        summary[key] = {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else None
        if values:
            print(f"{key}: min {min(values):.2f} s, median {statistics.median(values):.2f} s, max {max(values):.2f} s")
    json_line("hang_check", head, **summary)
    if a.json is not None:
        a.json.write_text(json.dumps({"summary": {**summary, "machine": head}, "runs": results}, indent=1))
    return 0 if summary["all_named_right"] else 1


if __name__ == "__main__":
    sys.exit(main())
