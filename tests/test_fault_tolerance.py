"""Issue 9: no hangs, no lost steps, clear errors (RELIABILITY.md).

Every job is real processes (`mpt train` starting its ranks, torchrun, or bare ranks) on gpt-tiny,
synthetic data, fp32, two pipeline stages. Faults come from the test-only ``MPT_FAULTS`` hook
(`mp_toolkit.run.faults.Faults`: a rank SIGKILLs itself at a step or inside a save; a rank's gradients or
loss turn non-finite) or from outside (SIGKILL of the launcher). Each test asserts that no
process of its job survives, and kills any in its finally.
"""

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mp_toolkit.checkpoint import open_checkpoint
from mp_toolkit.cli import main
from mp_toolkit.optim.loss_scaler import DynamicLossScaler
from mp_toolkit.run.launch import Faults, LaunchEnv
from mp_toolkit.run.preempt import DEBOUNCE_S
from mp_toolkit.run.skips import SkipStreak
from mp_toolkit.run.watchdog import Judge
from tests.fault_workers import (
    Job,
    bare_ranks,
    differing,
    log_hang,
    mpt_job,
    rank_pid,
    rows,
    tensors,
    torchrun_job,
    watch_hang,
)


def finish(job: Job, timeout: float) -> int:
    """The job's exit code, after asserting that none of its processes outlived it."""
    try:
        code = job.wait(timeout)
        assert job.survivors() == [], job.stderr
        return code
    finally:
        job.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: 8 steps saved every 2; (its checkpoint root, its metrics rows)."""
    tmp = tmp_path_factory.mktemp("reference")
    job = mpt_job(tmp, "--save-dir", str(tmp / "ck"), "--save-every", "2", "--metrics", str(tmp / "m.jsonl"))
    assert finish(job, 240) == 0, job.stderr  # bounds a hang: on a loaded machine start-up alone took 90 s
    return tmp / "ck", rows(tmp / "m.jsonl")


def assert_same_run(root, metrics, reference):
    """Steps 1..8 with the reference's losses, and final parameters and optimizer state bit for bit."""
    ref_root, ref_rows = reference
    got = rows(metrics)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert [r["loss"] for r in got] == [r["loss"] for r in ref_rows]
    assert open_checkpoint(root).step == 8
    assert differing(tensors(root), tensors(ref_root)) == []


# -- 1. a rank dies mid-step --------------------------------------------------------------------------

def test_a_killed_rank_is_named_and_restarts_resume_bitwise(tmp_path, reference):
    """Rank 1 SIGKILLs itself at the start of step 5: rank 0 names it, the watchdog names it and its
    step, stops rank 0, and --restarts 1 resumes from step 4; the run ends as the uninterrupted one."""
    root, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    job = mpt_job(tmp_path, "--save-dir", str(root), "--save-every", "2", "--metrics", str(metrics),
                  "--restarts", "1", faults={"kill": {"rank": 1, "step": 5}})
    assert finish(job, 120) == 0, job.stderr
    err = job.stderr.splitlines()
    assert "mpt train: rank 1 died (signal 9, SIGKILL) during step 5; stopping ranks 0" in err, err
    assert f"mpt train: restart 1 of 1: resuming from step-00000004 in {root}" in err, err
    assert any(line.startswith("mpt train: error: rank 0 lost rank 1 (pid ") and " during step 5 (" in line
               for line in err), err
    assert f"resumed from {root / 'step-00000004'} at step 4" in job.stdout
    assert_same_run(root, metrics, reference)


def test_ranks_without_a_watchdog_stop_on_their_own(tmp_path):
    """Bare ranks (only RANK, WORLD_SIZE, MASTER_* set, as a launcher without an agent would): a
    SIGKILLed peer closes its sockets and rank 0 stops at once naming it (found dead by pid, not yet
    reaped). One line, exit 1."""
    metrics = tmp_path / "m.jsonl"
    r0, r1 = bare_ranks(tmp_path, "--timeout", "20", "--steps", "400", "--metrics", str(metrics),
                        faults={"kill": {"rank": 1, "step": 3}})
    try:
        assert r0.wait(90) == 1, r0.stderr  # rank 1 dies at step 3; 90 s bounds a hang, not a speed
        lines = r0.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r0.stderr, r0.stderr
        assert lines[0].startswith(f"mpt train: error: rank 0 lost rank 1 (pid {r1.proc.pid}) during step 3 ("), lines
        assert r1.wait(5) == -signal.SIGKILL
        assert r0.survivors() == []
    finally:
        r0.kill()
        r1.kill()


def test_killing_the_launcher_takes_its_ranks_down(tmp_path):
    """SIGKILL of `mpt train` itself (not its ranks): each rank gets SIGHUP from the kernel
    (PR_SET_PDEATHSIG) and no process is left behind."""
    metrics = tmp_path / "m.jsonl"
    job = mpt_job(tmp_path, "--steps", "400", "--metrics", str(metrics))
    try:
        deadline = time.monotonic() + 60
        while not (metrics.exists() and rows(metrics)) and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = [rank_pid(job.mark, r) for r in (0, 1)]
        assert None not in ranks
        job.proc.kill()
        assert job.wait(10) == -signal.SIGKILL
        assert job.survivors(settle_s=10) == []
    finally:
        job.kill()


def test_torchrun_max_restarts_with_resume_auto_resumes_bitwise(tmp_path, reference):
    """Under torchrun the agent stops the survivor and restarts both ranks; --resume auto picks up the
    latest checkpoint (and starts fresh on the first attempt), so the run ends as the uninterrupted one."""
    root, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    job = torchrun_job(tmp_path, "--save-dir", str(root), "--save-every", "2", "--metrics", str(metrics),
                       "--resume", "auto", faults={"kill": {"rank": 1, "step": 5}})
    assert finish(job, 150) == 0, job.stderr[-3000:]
    assert "--resume auto: " in job.stdout and "holds no committed checkpoint yet, starting from step 0" in job.stdout
    assert f"resumed from {root / 'step-00000004'} at step 4" in job.stdout
    # the survivor names the lost rank; torchrun's agent reports it too (whichever exit it saw first)
    assert "mpt train: error: rank 0 lost rank 1 (pid " in job.stderr, job.stderr[-3000:]
    assert_same_run(root, metrics, reference)


# -- 1b. a rank hangs (issue 22): heartbeats name it, every process stops, restarts resume ---------------

HUNG_LINE = "mpt train: error: rank {rank} (pid {pid}) hung "  # then its last reported phase


def test_a_hung_rank_is_named_every_process_stops_and_restarts_resume_bitwise(tmp_path, reference):
    """Rank 1 SIGSTOPs itself at the start of step 5 (a frozen process: its own threads stop too).
    Rank 0's heartbeat judge finds its counter stopped for --hang-timeout, prints one line naming
    it, SIGKILLs it and exits 4; the mpt launcher restarts (--restarts 1) from step 4 and the run
    ends bitwise as the uninterrupted one. The times (stop -> line, stop -> every process of that
    start gone) go to $MPT_HANG_LOG when set; they are bounded by the watch, never asserted."""
    root, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    job = mpt_job(tmp_path, "--save-dir", str(root), "--save-every", "2", "--metrics", str(metrics),
                  "--restarts", "1", "--hang-timeout", "5",
                  faults={"kill": {"rank": 1, "step": 5, "signal": "SIGSTOP"}})
    try:
        figures = watch_hang(job, (0, 1), hung=1, timeout=150)
        assert finish(job, 150) == 0, job.stderr
    finally:
        job.kill()
    log_hang(figures, "mpt launcher, SIGSTOP rank 1")
    err = job.stderr.splitlines()
    named = [line for line in err if " hung " in line]
    assert len(named) == 1 and named[0].startswith(HUNG_LINE.format(rank=1, pid=figures["pid"])), err
    assert "no heartbeat for " in named[0] and named[0].endswith("(--hang-timeout 5); stopping every rank"), named
    assert f"mpt train: restart 1 of 1: resuming from step-00000004 in {root}" in err, err
    assert not any("Traceback" in line for line in err), job.stderr
    assert_same_run(root, metrics, reference)


def test_a_hung_rank_serving_the_store_is_named_by_the_others(tmp_path):
    """Bare ranks (as the deepspeed launcher starts them: rank 0 serves the rendezvous store). Rank 0
    SIGSTOPs itself: the store stops answering too, so rank 1's judge names rank 0 from the store's
    silence, SIGKILLs it (same host) and exits 4 in one line, long before --timeout."""
    r0, r1 = bare_ranks(tmp_path, "--timeout", "300", "--hang-timeout", "5", "--steps", "400",
                        faults={"kill": {"rank": 0, "step": 3, "signal": "SIGSTOP"}})
    try:
        assert r1.wait(120) == 4, r1.stderr  # 120 s bounds a hang, not a speed
        lines = r1.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r1.stderr, r1.stderr
        assert lines[0].startswith(HUNG_LINE.format(rank=0, pid=r0.proc.pid)), lines
        assert "the rendezvous store it serves gave no answer for " in lines[0], lines
        assert r0.wait(10) == -signal.SIGKILL
        assert r0.survivors() == [] and r1.survivors() == []
    finally:
        r0.kill()
        r1.kill()


def test_torchrun_restarts_after_a_hung_rank_and_resumes_bitwise(tmp_path, reference):
    """Under torchrun its agent serves the store: rank 0 SIGSTOPs itself at step 5, rank 1 names it
    from its stopped heartbeat and SIGKILLs it, the agent restarts both (--max-restarts 1) and
    --resume auto ends bitwise as the uninterrupted run."""
    root, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    job = torchrun_job(tmp_path, "--save-dir", str(root), "--save-every", "2", "--metrics", str(metrics),
                       "--resume", "auto", "--hang-timeout", "5",
                       faults={"kill": {"rank": 0, "step": 5, "signal": "SIGSTOP"}})
    assert finish(job, 150) == 0, job.stderr[-3000:]
    named = [line for line in job.stderr.splitlines() if " hung " in line]
    assert len(named) == 1 and named[0].startswith("mpt train: error: rank 0 (pid ") and "no heartbeat" in named[0], \
        job.stderr[-3000:]
    assert f"resumed from {root / 'step-00000004'} at step 4" in job.stdout
    assert_same_run(root, metrics, reference)


def test_the_heartbeat_judge_names_stopped_stuck_and_deadlocked_ranks():
    """The judge's rules on beats alone: a stopped counter; a step that outlasts its limit outside
    communication (5x --hang-timeout for the first step, then max(timeout, 4x the longest step));
    every rank waiting on communication; finished ranks are never judged."""
    def beat(n, step, comm=False, first=False, done=False, pid=100):
        return {"n": n, "pid": pid, "phase": f"during step {step}" if step else "during start-up", "step": step,
                "comm": comm, "first": first, "done": done}

    judge = Judge(hang_timeout_s=10)
    judge.update({0: beat(1, 1, first=True), 1: beat(1, 1, first=True, pid=101)}, now=0)
    for t in range(1, 40):  # a first step of 40 s: within 5 x 10 s, both alive
        judge.update({0: beat(t, 1, first=True), 1: beat(t, 1, comm=True, first=True, pid=101)}, now=t)
        assert judge.hung(t) is None
    judge.update({0: beat(40, 2), 1: beat(40, 2, comm=True, pid=101)}, now=40)
    assert judge.hung(45) is None
    judge.update({0: beat(41, 3), 1: beat(41, 3, pid=101)}, now=50)  # step 2 took 10 s: limit max(10, 40)
    for t in range(51, 91):
        judge.update({0: beat(t, 3), 1: beat(t, 3, comm=True, pid=101)}, now=t)
    assert judge.hung(89) is None
    ranks, line = judge.hung(91)
    assert ranks == [0] and line.startswith("rank 0 (pid 100) hung during step 3: no progress for 41 s outside "
                                            "communication (--hang-timeout 10)"), line
    judge.update({0: beat(91, 3, comm=True), 1: beat(91, 3, comm=True, pid=101)}, now=91)
    ranks, line = judge.hung(92)
    assert ranks == [0, 1] and "every rank waiting on communication" in line, line
    stopped = Judge(hang_timeout_s=10)
    stopped.update({0: beat(1, None), 1: beat(1, None, pid=101)}, now=0)
    stopped.update({0: beat(2, None)}, now=5)
    assert stopped.hung(10) is None
    ranks, line = stopped.hung(10.5)
    assert ranks == [1] and line == ("rank 1 (pid 101) hung during start-up: no heartbeat for 10 s "
                                     "(--hang-timeout 10); stopping every rank"), line
    stopped.update({1: beat(2, None, done=True, pid=101)}, now=11)
    stopped.update({0: beat(3, None)}, now=30)
    assert stopped.hung(31) is None  # rank 1 finished: its silence means nothing


# -- 1c. preemption (issue 22): SIGTERM / SIGUSR1 stop every rank after the same step, saved ------------

def test_a_preempted_run_saves_the_step_in_flight_and_resumes_bitwise(tmp_path, reference):
    """SIGTERM to rank 1 alone at the start of step 5: every rank finishes step 5, the job saves it
    and exits 5 with one line. Resumed, SIGUSR1 to the mpt launcher at step 7 (forwarded to every
    rank): the same at step 7. Resumed again, the run ends bitwise as the uninterrupted one."""
    root, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    args = ("--save-dir", str(root), "--save-every", "2", "--metrics", str(metrics), "--keep", "0")
    job = mpt_job(tmp_path, *args, faults={"kill": {"rank": 1, "step": 5, "signal": "SIGTERM"}})
    assert finish(job, 240) == 5, job.stderr
    assert job.stderr.strip() == ("mpt train: SIGTERM: every rank stopped after step 5 "
                                  f"(saved {root / 'step-00000005'}; continue with --resume auto)"), job.stderr
    assert (root / "latest").read_text() == "step-00000005\n" and [r["step"] for r in rows(metrics)] == [1, 2, 3, 4, 5]
    again = mpt_job(tmp_path, *args, "--resume", "auto", name="again",
                    faults={"kill": {"rank": 0, "step": 7, "signal": "SIGUSR1", "to": "launcher"}})
    assert finish(again, 240) == 5, again.stderr
    assert again.stderr.strip().endswith(f"SIGUSR1: every rank stopped after step 7 (saved {root / 'step-00000007'}; "
                                         "continue with --resume auto)"), again.stderr
    last = mpt_job(tmp_path, *args, "--resume", "auto", name="last")
    assert finish(last, 240) == 0, last.stderr
    assert f"resumed from {root / 'step-00000007'} at step 7" in last.stdout
    assert_same_run(root, metrics, reference)


def _signalled(steps: str, wait_s: float) -> subprocess.CompletedProcess:
    """A process that installs `PreemptSignals`, runs ``steps`` (Python lines), gets SIGTERM ``wait_s``
    seconds later from a timer and then blocks its main thread: its exit code and output."""
    script = ("import os, signal, threading, time\n"
              "from mp_toolkit.run.preempt import PreemptSignals, DEBOUNCE_S\n"
              "s = PreemptSignals().install()\n"
              f"{steps}"
              f"threading.Timer({wait_s}, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
              "threading.Event().wait(60)\n"
              "print('not stopped', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, (done.returncode, done.stdout, done.stderr)
    return done


def test_a_second_signal_stops_at_once():
    """The first SIGTERM is a request (noted, the process goes on); a second one more than
    DEBOUNCE_S later ends the process at once (128 + 15) even while its main thread is blocked."""
    done = _signalled("s.begin()\nos.kill(os.getpid(), signal.SIGTERM); time.sleep(0.3)\n"
                      "print('noted', s.received.name, flush=True)\n", DEBOUNCE_S + 0.5)
    assert done.stdout == "noted SIGTERM\n" and done.stderr == "mpt train: SIGTERM again: stopping at once\n"


def test_a_signal_before_the_first_step_stops_at_once():
    """Issue 40: before the first step (building, loading) there is nothing to save: one signal ends the
    process at once (128 + 15) with one line, even while its main thread is blocked."""
    done = _signalled("", 0.2)
    assert done.stdout == "" and done.stderr == ("mpt train: SIGTERM before the first step: stopping at once "
                                                 "(nothing trained, nothing saved)\n")


def test_a_two_kill_chaos_run_ends_bitwise(tmp_path):
    """`tools.chaos` at a small size: an uninterrupted run, then one with --restarts 3 whose ranks
    get SIGKILL twice from outside at random steps and moments (seeded); every tensor of the two final
    checkpoints and every per-step loss equal."""
    out = tmp_path / "chaos.json"
    job = Job([sys.executable, "-m", "tools.chaos", "--kills", "2", "--steps", "16", "--save-every", "4", "--seed", "1",
               "--timeout", "300", "--work-dir", str(tmp_path / "work"), "--json", str(out)], tmp_path, name="chaos",
              env={"PYTHONPATH": str(Path(__file__).resolve().parents[1])})  # where `-m tools.chaos` resolves
    assert finish(job, 900) == 0, job.stdout[-3000:] + job.stderr[-3000:]  # bounds a hang, not a speed
    result = json.loads(out.read_text())
    assert (result["exit_code"], result["recoveries"], len(result["kills"])) == (0, 2, 2), result
    assert result["tensors"] > 0 and result["tensors_differing"] == 0 and result["losses_equal"], result


# -- 2. killed during a checkpoint save ---------------------------------------------------------------

def test_a_rank_killed_inside_a_save_leaves_latest_on_the_previous_checkpoint(tmp_path, reference):
    """Rank 1 dies after writing its shards of step 4, before the commit: the job stops (137, both
    ranks named), `latest` still names step 2, which verifies; --resume auto finishes bitwise."""
    root, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    job = mpt_job(tmp_path, "--save-dir", str(root), "--save-every", "2", "--metrics", str(metrics),
                  faults={"kill": {"rank": 1, "step": 4, "in": "save"}})
    assert finish(job, 90) == 128 + signal.SIGKILL, job.stderr
    err = job.stderr.strip().splitlines()
    assert err[-1] == "mpt train: rank 1 died (signal 9, SIGKILL) while saving step 4; stopping ranks 0", err
    assert err[0].startswith("mpt train: error: rank 0 lost rank 1 (pid ") and "while saving step 4" in err[0], err
    assert (root / "latest").read_text() == "step-00000002\n"
    scratch = root / ".tmp-step-00000004"
    assert (scratch / "rng" / "rank-00001.safetensors").is_file() and not (scratch / "manifest.json").exists()
    ck = open_checkpoint(root)
    ck.verify()
    assert ck.step == 2
    again = mpt_job(tmp_path, "--save-dir", str(root), "--save-every", "2", "--metrics", str(metrics),
                    "--resume", "auto", name="again")
    assert finish(again, 90) == 0, again.stderr
    assert f"resumed from {root / 'step-00000002'} at step 2" in again.stdout
    assert not scratch.exists()
    assert_same_run(root, metrics, reference)


# -- 3. damaged checkpoints (truncated and modified shards: tests/test_resume.py) ----------------------

def test_a_missing_shard_is_refused_with_its_name(tmp_path, reference, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(reference[0] / "step-00000008", ck)
    (ck / "optim" / "h.2.safetensors").unlink()
    code = main([*TRAIN_ONE_RANK, "--resume", str(ck)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "optim/h.2.safetensors" in err and "missing" in err, err


TRAIN_ONE_RANK = ["train", "--model", "gpt-tiny", "--data", "synthetic", "--micro-batch", "2", "--seq-len", "16",
                  "--microbatches", "3", "--threads", "1", "--no-progress", "--pp", "1", "--steps", "9"]


# -- 4. non-finite training ---------------------------------------------------------------------------

def test_nonfinite_steps_are_skipped_by_every_rank_and_a_streak_stops_the_run(tmp_path):
    """fp32, saving every step, --max-skips 3: rank 0's gradients are inf at step 2 (one skip, the run
    goes on), rank 1's loss is inf at steps 4-7. Every rank skips those steps, nothing is saved at a
    skipped step, the third skip in a row stops the run (exit 3, one line) with `latest` on step 3.
    1F1B named: the loss is the last stage's, on rank 1 there (a V schedule, the planner's pick for this
    run otherwise, computes it on rank 0, and the fault is refused as named for the wrong rank)."""
    root, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    faults = {"nonfinite": [{"rank": 0, "steps": [2], "kind": "grad"},
                            {"rank": 1, "steps": [4, 5, 6, 7], "kind": "loss"}]}
    job = mpt_job(tmp_path, "--schedule", "1f1b", "--save-dir", str(root), "--save-every", "1", "--keep", "0",
                  "--max-skips", "3",
                  "--metrics", str(metrics), faults=faults)
    assert finish(job, 90) == 3, job.stderr
    got = rows(metrics)
    assert [r["skipped"] for r in got] == [False, True, False, True, True, True]
    assert [math.isnan(r["grad_norm"]) for r in got] == [False, True, False, True, True, True]
    assert "step 2 skipped on every rank: non-finite gradients on some rank in fp32; parameters and optimizer " \
           "state unchanged (1 in a row, --max-skips 3)" in job.stdout
    assert "step 6 skipped on every rank: non-finite loss and gradients on some rank in fp32" in job.stdout
    assert job.stderr.strip() == (
        "mpt train: error: 3 consecutive steps skipped (steps 4-6): non-finite loss and gradients on some rank "
        f"in fp32; stopping, the last good checkpoint is {root / 'step-00000003'} (lower --lr, check the data, "
        "or raise --max-skips above 3)")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001", "step-00000003"]
    assert (root / "latest").read_text() == "step-00000003\n"
    step_count = tensors(root)["h.0.attn.qkv.weight:step"]
    assert step_count.item() == 2  # steps 1 and 3 were applied; the skipped step 2 left AdamW's count alone


def test_fp16_skips_count_only_once_the_scale_cannot_drop():
    """fp16 overflows lower the scale (the scaler's job, not a streak) until --min-loss-scale; from
    there each one counts. fp32 has no scaler: every skip counts."""
    from mp_toolkit.engine.interface import StepStats

    scaler = DynamicLossScaler(initial_scale_power=2, hysteresis=1, min_loss_scale=1.0)
    streak = SkipStreak(limit=20)
    counted = []
    for step in range(1, 6):
        stats = StepStats(loss=float("inf"), grad_norm=float("nan"), skipped=True, loss_scale=scaler.scale,
                          nonfinite="gradients")
        scaler.update(True)
        counted.append(streak.update(step, stats, scaler))
    assert counted == [False, False, True, True, True] and (streak.first, streak.count) == (3, 3)
    fp32 = SkipStreak(limit=2)
    ok = StepStats(loss=1.0, grad_norm=1.0)
    bad = StepStats(loss=float("nan"), grad_norm=float("nan"), skipped=True, nonfinite="loss")
    assert [fp32.update(s, x, None) for s, x in enumerate([bad, ok, bad, bad], 1)] == [True, False, True, True]
    assert (fp32.first, fp32.count) == (3, 2)


# -- flags and hooks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args,mentions", [
    (["--restarts", "2"], "--restarts 2 needs --save-dir and --save-every N"),
    (["--restarts", "2", "--save-dir", "x"], "--restarts 2 needs --save-dir and --save-every N"),
    (["--restarts", "-1"], "--restarts -1 is out of range"),
    (["--max-skips", "0"], "--max-skips 0 is out of range"),
    (["--resume", "auto"], "--resume auto needs --save-dir"),
    (["--hang-timeout", "-1"], "--hang-timeout -1.0 must be a positive finite number of seconds (or 0: no heartbeats)"),
])
def test_restart_and_skip_flags_are_checked_before_any_rank_starts(capsys, args, mentions):
    code = main([*TRAIN_ONE_RANK, *args])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and mentions in err, err


def test_restarts_under_a_launcher_points_at_its_own_restarts(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code = main([*TRAIN_ONE_RANK, "--restarts", "1", "--save-dir", str(tmp_path), "--save-every", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "torchrun --max-restarts N) and pass --resume auto" in err, err


def test_the_fault_hook_is_parsed_strictly(monkeypatch):
    faults = Faults.parse('{"kill": {"rank": 1, "step": 5, "in": "save"}, '
                          '"nonfinite": [{"rank": 0, "steps": [2, 3], "kind": "loss"}]}')
    assert faults.kill == (1, 5, "save") and faults.nonfinite == ((0, 2, "loss"), (0, 3, "loss"))
    assert faults.nonfinite_at(0, 3) == "loss" and faults.nonfinite_at(1, 3) is None
    env = LaunchEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, attempt=1, faults=faults)
    faults.kill_here(env, 5, "save")  # a restart (attempt 1) is never killed: this process lives on
    from mp_toolkit.run.config import ConfigError
    for text in ('{"kill": {"rank": 1}}', '{"kill": {"rank": 1, "step": 2, "in": "later"}}', "kill=1"):
        with pytest.raises(ConfigError, match="MPT_FAULTS"):
            Faults.parse(text)
