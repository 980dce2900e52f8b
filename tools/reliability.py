"""Issue 39's goals, measured: replica checks, asynchronous saves, loss-spike rewinds.

    python -m tools.reliability replicas --flips 20 --clean-steps 334   # bit flips found; false alarms
    python -m tools.reliability async-save --model gpt2-medium --steps 9 # training stall per save
    python -m tools.reliability async-faults --runs 50                   # write failures in the background
    python -m tools.reliability elastic --runs 10                        # a node lost, then back

``replicas``: ``--flips`` runs of gpt-tiny at dp 2 (pp 2, fp32, checked every 2 steps), each with one
random bit of one random tensor (a master or an optimizer-state tensor) of one random rank flipped
after a random step (`MPT_FAULTS`); a flip counts as found when the run stops with exit 6 at the next
check, naming that rank. Then one clean run per precision (fp32, bf16, fp16) checked after each of
``--clean-steps`` steps: every check that passes is a clean check, any exit 6 a false alarm.

``async-save``: the same run (GPT-2-medium at pp 2 by default) saved every ``--save-every`` steps,
synchronously, with ``--async-save`` and not at all; the stall of a save is the wall time from the
end of its step to the start of the next (the metrics rows' ``time`` minus ``step_time_s``): the
first save's (which faults in the copy's pages) and the median of the later ones.

``elastic``: ``--runs`` times, two torchrun agents (``--nnodes 1:2``, one worker each, gpt-tiny at
pp 1) train at dp 2; at step 25 agent 1 and its worker are SIGKILLed; the time until the survivor
ends its first step at dp 1 (the metrics rows' ``time``) is the recovery; agent 1 is started again
once the survivor has trained 5 steps, and the job must grow back to dp 2 and end with exit 0.

``async-faults``: ``--runs`` runs with ``--async-save`` whose background writer fails (an injected
``OSError`` (ENOSPC) at a random shard of a random save, `MPT_FAULTS` ``save_error``): each must end
in one line (exit 2) with ``latest`` on a complete, loadable checkpoint older than the failed one.

Prints the machine header (`tools.report`), the figures, then one JSON line. Results go into
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

from mp_toolkit.checkpoint import latest_step, open_checkpoint
from mp_toolkit.run.launch import EXIT_REPLICAS, free_port
from tools.ranks import mpt_argv
from tools.report import header, json_line

TINY = ["train", "--model", "gpt-tiny", "--data", "synthetic", "--micro-batch", "2", "--seq-len", "16",
        "--microbatches", "3", "--threads", "1", "--no-progress", "--lr", "1e-2"]


def run(args: list[str], faults: dict | None = None, timeout_s: float = 900.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if faults:
        env["MPT_FAULTS"] = json.dumps(faults)
    return subprocess.run(mpt_argv(*args), capture_output=True, text=True, timeout=timeout_s, env=env)


def replicas(a: argparse.Namespace, head: dict) -> dict:
    rng = random.Random(a.seed)
    found, missed = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.flips):
            rank, step = rng.randrange(4), rng.randrange(1, 7)
            flip = {"rank": rank, "step": step, "tensor": rng.randrange(4), "element": rng.randrange(10**6),
                    "bit": rng.randrange(32)}
            r = run([*TINY, "--pp", "2", "--dp", "2", "--steps", "8", "--check-replicas", "2",
                     "--save-dir", f"{tmp}/f{i}", "--save-every", "2"], {"flip": [flip]})
            check = step + step % 2  # the first check at or after the flip's step (it follows the flip)
            ok = (r.returncode == EXIT_REPLICAS and f"replica check after step {check}:" in r.stderr
                  and f"(rank {rank})" in r.stderr)
            found += ok
            if not ok:
                missed.append({"flip": flip, "exit": r.returncode, "stderr": r.stderr[-400:]})
            print(f"flip {i + 1}: {flip}: {'found' if ok else 'MISSED'}", flush=True)
        clean, alarms = 0, 0
        for precision in ("fp32", "bf16", "fp16"):
            r = run([*TINY, "--pp", "1", "--dp", "2", "--steps", str(a.clean_steps), "--check-replicas", "1",
                     "--precision", precision])
            alarms += r.returncode == EXIT_REPLICAS
            clean += a.clean_steps if r.returncode == 0 else 0
            print(f"clean {precision}: {a.clean_steps} checks, exit {r.returncode}", flush=True)
    print(f"flips found {found} of {a.flips}; clean checks {clean}, false alarms {alarms}")
    return {"flips": a.flips, "found": found, "missed": missed, "clean_checks": clean, "false_alarms": alarms}


def _stalls(rows: list[dict], every: int) -> list[float]:
    """Seconds between the end of each saving step (step % every == 0, not the last) and the start of the
    next: the save, and the loop's own bookkeeping."""
    return [b["time"] - b["step_time_s"] - a["time"] for a, b in zip(rows, rows[1:]) if a["step"] % every == 0]


def async_save(a: argparse.Namespace, head: dict) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "async", "none"):
            root = Path(tmp) / mode
            args = [*TINY[:2], a.model, *TINY[3:], "--pp", "2", "--steps", str(a.steps), "--seq-len", "64",
                    "--micro-batch", "1", "--microbatches", "4", "--schedule", "1f1b",
                    "--metrics", str(root / "m.jsonl")]
            if mode != "none":
                args += ["--save-dir", str(root / "ck"), "--save-every", str(a.save_every), "--keep", "1"]
            if mode == "async":
                args.append("--async-save")
            r = run(args)
            if r.returncode != 0:
                raise SystemExit(f"{mode}: exit {r.returncode}\n{r.stderr[-2000:]}")
            rows = [json.loads(line) for line in (root / "m.jsonl").read_text().splitlines()]
            stalls = _stalls(rows, a.save_every)
            out[mode] = {"first_s": stalls[0], "later_s": statistics.median(stalls[1:]), "stalls_s": stalls,
                         "step_s": statistics.median(r["step_time_s"] for r in rows[1:]),
                         "wall_s": rows[-1]["time"] - rows[0]["time"]}
            print(f"{mode}: stall at the first save {stalls[0]:.3f} s, median of the later ones "
                  f"{out[mode]['later_s']:.3f} s; median step {out[mode]['step_s']:.3f} s; steps 1-{a.steps} in "
                  f"{out[mode]['wall_s']:.1f} s", flush=True)
    loop = out["none"]["later_s"]
    ratio = {k: (out["async"][k] - loop) / max(1e-9, out["sync"][k] - loop) for k in ("first_s", "later_s")}
    print(f"async stall / sync stall (the loop's own gap {loop:.3f} s taken off both): first save "
          f"{ratio['first_s']:.3f}, later saves {ratio['later_s']:.3f}")
    return {**out, "model": a.model, "save_every": a.save_every, "ratio": ratio}


def async_faults(a: argparse.Namespace, head: dict) -> dict:
    rng = random.Random(a.seed)
    good, bad = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            root = Path(tmp) / f"r{i}" / "ck"
            step, rank = rng.choice((4, 6)), rng.randrange(2)
            faults = {"save_error": {"rank": rank, "step": step, "file": rng.randrange(6)}}
            r = run([*TINY, "--pp", "2", "--steps", "8", "--save-dir", str(root), "--save-every", "2",
                     "--async-save"], faults)
            lines = [x for x in r.stderr.splitlines() if x.startswith("mpt train")]
            try:
                latest = latest_step(root)
                open_checkpoint(root)  # verifies every shard's size and hash
                loadable = True
            except Exception as e:  # noqa: BLE001 -- any failure to load is the finding
                latest, loadable = None, repr(e)
            ok = r.returncode == 2 and len(lines) == 1 and loadable is True and latest is not None and latest < step
            good += ok
            if not ok:
                bad.append({"faults": faults, "exit": r.returncode, "latest": latest, "loadable": loadable,
                            "stderr": r.stderr[-600:]})
            print(f"run {i + 1}: {faults}: exit {r.returncode}, latest {latest}: {'ok' if ok else 'BAD'}", flush=True)
    print(f"{good} of {a.runs} failed background writes left a complete latest checkpoint; corrupted: {len(bad)}")
    return {"runs": a.runs, "ok": good, "bad": bad}


ELASTIC_RDZV = "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def _metrics(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _wait(what, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := what():
            return got
        time.sleep(0.2)
    return None


def _elastic_run(tmp: Path) -> dict:
    endpoint = f"127.0.0.1:{free_port()}"
    train = [*TINY, "--pp", "1", "--elastic", "1:2", "--global-batch", "12", "--steps", "1500", "--save-every", "10",
             "--keep", "2", "--resume", "auto", "--save-dir", str(tmp / "ck"), "--metrics", str(tmp / "m.jsonl")]

    def agent(node: int, name: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic",
               "--rdzv-conf", f"is_host={int(node == 0)},{ELASTIC_RDZV}", "--max-restarts", "3",
               "--monitor-interval", "0.2", "-m", "mp_toolkit.cli", *train]
        with open(tmp / f"{name}.log", "w") as log:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    agents = [agent(0, "a0"), agent(1, "a1")]
    try:
        if not _wait(lambda: (r := _metrics(tmp / "m.jsonl")) and r[-1]["step"] >= 25, 300):
            return {"error": "no step 25"}
        killed = time.time()
        for pid in [agents[1].pid, *_children(agents[1].pid)]:  # the node: its agent and its worker
            os.kill(pid, signal.SIGKILL)
        after = _wait(lambda: [r for r in _metrics(tmp / "m.jsonl") if r["time"] > killed + 0.5], 300)
        if not after:
            return {"error": "the survivor did not train again"}
        recovery = after[0]["time"] - killed
        _wait(lambda: _metrics(tmp / "m.jsonl")[-1]["step"] >= after[0]["step"] + 5, 120)
        agents[1] = agent(1, "a1-again")
        codes = [a.wait(600) for a in agents]
        log = (tmp / "a0.log").read_text()
        regrown = log.count("elastic: world 2 = ") == 2 and "elastic: world 1 = " in log
        return {"recovery_s": recovery, "exit": codes, "regrown": regrown and codes == [0, 0]}
    finally:
        for a in agents:
            if a.poll() is None:
                for pid in [a.pid, *_children(a.pid)]:
                    os.kill(pid, signal.SIGKILL)
                a.wait()


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                out += [int(entry.name), *_children(int(entry.name))]
    return out


def elastic(a: argparse.Namespace, head: dict) -> dict:
    runs = []
    for i in range(a.runs):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(_elastic_run(Path(tmp)))
        print(f"run {i + 1}: {runs[-1]}", flush=True)
    within = sum(1 for r in runs if r.get("recovery_s", 1e9) <= 60)
    regrown = sum(1 for r in runs if r.get("regrown"))
    times = [r["recovery_s"] for r in runs if "recovery_s" in r]
    print(f"survivor trained again within 60 s in {within} of {a.runs} runs (recovery median "
          f"{statistics.median(times):.1f} s, max {max(times):.1f} s); grew back to dp 2 in {regrown} of {a.runs}")
    return {"runs": runs, "within_60s": within, "regrown": regrown}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("replicas")
    r.add_argument("--flips", type=int, default=20)
    r.add_argument("--clean-steps", type=int, default=334)
    s = sub.add_parser("async-save")
    s.add_argument("--model", default="gpt2-medium")
    s.add_argument("--steps", type=int, default=9)
    s.add_argument("--save-every", type=int, default=2)
    f = sub.add_parser("async-faults")
    f.add_argument("--runs", type=int, default=50)
    e = sub.add_parser("elastic")
    e.add_argument("--runs", type=int, default=10)
    for q in (r, s, f, e):
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    head = header(f"tools.reliability {a.what}")
    fields = {"replicas": replicas, "async-save": async_save, "async-faults": async_faults,
              "elastic": elastic}[a.what](a, head)
    json_line(f"tools.reliability {a.what}", head, a.json, **fields)


if __name__ == "__main__":
    main()
