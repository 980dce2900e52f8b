"""`mpt train --save-dir / --resume`: a resumed run continues the interrupted one (DESIGN.md invariant 8).

Every run here is a real `mpt train` process (it starts its pp x tp x dp ranks itself over gloo) on
gpt-tiny and synthetic data, fp32 unless a test says otherwise. Parameters are compared through the
checkpoints the runs write (full tensors under the unsplit model's names).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from mp_toolkit.checkpoint import open_checkpoint
from tests.floor import assert_all_within, assert_within, pair
from tests.mpt_command import run_mpt

COMMON = ["train", "--model", "gpt-tiny", "--data", "synthetic", "--micro-batch", "2", "--seq-len", "16",
          "--threads", "1", "--no-progress", "--timeout", "60"]
BASE = [*COMMON, "--lr", "1e-2"]


def mpt(*args, timeout=120):
    return run_mpt(args, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def train(tmp_path, name, *args, microbatches=3, base=BASE):
    """Run to completion; returns (the per-step rows of its metrics file, its stdout)."""
    metrics = tmp_path / f"{name}.jsonl"
    r = mpt(*base, "--microbatches", str(microbatches), "--metrics", str(metrics), *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(line) for line in metrics.read_text().splitlines()], r.stdout


def losses(rows, steps):
    by_step = {row["step"]: row["loss"] for row in rows}
    return [by_step[s] for s in steps]


def tensors(root, step):
    """{name: tensor} of every model and optimizer tensor of one checkpoint."""
    ck = open_checkpoint(root / f"step-{step:08d}")
    out = {}
    for layer in ck.layer_names:
        out.update(ck.read_layer(layer))
        for param, state in ck.read_optimizer(layer)[0].items():
            out.update({f"{param}:{key}": value for key, value in state.items()})
    return out


# -- (a) same layout: bitwise ------------------------------------------------------------------------

LAMB = ["--optimizer", "lamb", "--clip-grad", "0.3", "--warmup-steps", "2", "--lr-decay", "cosine", "--steps", "6"]
"""LAMB with clipping that acts on every step (norms ~0.6-1.4) and a cosine decay over the six steps."""


def assert_resumed_bitwise(tmp_path, full, a, run):
    resumed, out = train(tmp_path, "resumed", *run, "--save-dir", str(tmp_path / "b"),
                         "--resume", str(a / "step-00000003"))
    assert "resumed from" in out and "at step 3" in out and "layout changed" not in out, out
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert losses(resumed, [4, 5, 6]) == losses(full, [4, 5, 6])
    assert [r["lr"] for r in resumed] == [r["lr"] for r in full[3:]]
    ta, tb = tensors(a, 6), tensors(tmp_path / "b", 6)
    assert ta.keys() == tb.keys() and any(k.endswith(":exp_avg") for k in ta)
    assert all(torch.equal(ta[k], tb[k]) for k in ta), [k for k in ta if not torch.equal(ta[k], tb[k])]


@pytest.fixture(scope="module")
def lamb_pp2(tmp_path_factory):
    """Six LAMB steps on pp=2 (1F1B), saved at steps 3 and 6: (rows, checkpoint root)."""
    tmp = tmp_path_factory.mktemp("lamb_pp2")
    rows, _ = train(tmp, "full", *LAMB, "--pp", "2", "--save-dir", str(tmp / "a"), "--save-every", "3")
    assert all(r["grad_norm"] > 0.3 for r in rows)  # clipping acted on every step
    return rows, tmp / "a"


def test_resume_on_the_same_layout_is_bitwise_adamw(tmp_path):
    """Six steps straight vs. a new process resuming the same run's step-3 checkpoint: identical
    per-step losses and identical parameters and optimizer state, bit for bit (pp=2, 1F1B, AdamW)."""
    run = ["--pp", "2", "--steps", "6"]
    full, _ = train(tmp_path, "full", *run, "--save-dir", str(tmp_path / "a"), "--save-every", "3")
    assert_resumed_bitwise(tmp_path, full, tmp_path / "a", run)


def test_resume_on_the_same_layout_is_bitwise_lamb_clipping(tmp_path, lamb_pp2):
    rows, root = lamb_pp2
    assert_resumed_bitwise(tmp_path, rows, root, [*LAMB, "--pp", "2"])


def test_fp16_resume_keeps_the_loss_scaler_and_the_deepspeed_schedule(tmp_path):
    """fp16 with overflows on both sides of the save: the scaler's counters and the DeepSpeed WarmupLR
    position (which advances on applied steps only) resume exactly, so the run is bitwise the same."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "initial_scale_power": 19, "hysteresis": 1, "loss_scale_window": 2},
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4,
                                                     "warmup_type": "linear"}}}))
    run = ["--config", str(ds), "--pp", "1", "--steps", "6"]  # no --lr: it would replace the scheduler
    full, _ = train(tmp_path, "full", *run, "--save-dir", str(tmp_path / "a"), "--save-every", "3", base=COMMON)
    resumed, _ = train(tmp_path, "resumed", *run, "--save-dir", str(tmp_path / "b"),
                       "--resume", str(tmp_path / "a" / "step-00000003"), base=COMMON)
    assert [r["skipped"] for r in full] == [True, False, False, True, False, False]
    # WarmupLR(linear, 4) at DeepSpeed iteration (applied steps - 1): -1 and 0 give 0, then 1e-2 / 4 per
    # iteration; the skipped steps 1 and 4 do not advance it, so steps 2 and 5 repeat their rate
    assert [r["lr"] for r in full] == pytest.approx([0.0, 0.0, 0.0, 0.0025, 0.0025, 0.005])
    assert [(r["loss"], r["lr"], r["loss_scale"], r["skipped"]) for r in resumed] == [
        (r["loss"], r["lr"], r["loss_scale"], r["skipped"]) for r in full[3:]]
    a, b = tensors(tmp_path / "a", 6), tensors(tmp_path / "b", 6)
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- (b) another layout: agrees to fp32 reduction order ----------------------------------------------

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, pp=1 tp=1 dp=1, the LAMB run, with 3 micro-batches of 2 per step (and 6, for dp)."""
    tmp = tmp_path_factory.mktemp("reference")
    out = {}
    for m in (3, 6):
        rows, _ = train(tmp, f"ref{m}", *LAMB, "--pp", "1", "--save-dir", str(tmp / f"ref{m}"), microbatches=m)
        out[m] = (rows, tensors(tmp / f"ref{m}", 6))
    return out


def assert_resumed_within(root, rows, reference, source, source_rows):
    """The resumed run (its checkpoint ``root``, its metrics ``rows``) against the uninterrupted single rank
    (``reference``: rows and step-6 tensors) within `floor.K` times the saved layout's own run (``source``,
    ``source_rows``) to step 6: losses of steps 4-6 and every tensor."""
    ref_rows, ref_tensors = reference
    steps = [4, 5, 6]
    worst = assert_within(*pair(losses(rows, steps), losses(ref_rows, steps), losses(source_rows, steps)), "losses")
    got, floor_run = tensors(root, 6), tensors(source, 6)
    assert got.keys() == ref_tensors.keys() == floor_run.keys()
    worst = max(worst, assert_all_within({k: pair(got[k], ref, floor_run[k]) for k, ref in ref_tensors.items()},
                                         "step 6"))
    print(f"\nworst err / floor: {worst:.2f}")


@pytest.mark.parametrize("saved,m", [(None, (3, 3)), (["--pp", "1", "--tp", "2"], (3, 3)),
                                     (["--pp", "1", "--dp", "2"], (3, 6))],  # dp: the same 12 sequences a step
                         ids=["pp2-to-pp1", "tp2-to-tp1", "dp2-to-dp1"])
def test_resume_on_another_layout(tmp_path, lamb_pp2, reference, saved, m):
    """Save at step 3 on a 2-rank layout, resume on one rank: the losses and every parameter and
    optimizer-state tensor agree with an uninterrupted single-rank run within `floor.K` times what
    the 2-rank layout itself costs on these kernels (DESIGN.md invariant 10): the floor is the same
    layout run uninterrupted to step 6, an equally valid fp32 run whose only difference from the
    single rank is its reduction order (the tied embedding's two stage copies sum their gradients
    by all-reduce, tp reduces partial sums, dp averages in buckets). Not bitwise for that reason.
    LAMB, not AdamW: Adam divides the ~1e-10 noise gradient of the attention key bias (exactly zero
    in exact arithmetic) by its own root mean square, which turns rounding noise into lr-sized steps."""
    source, source_rows = lamb_pp2[1], lamb_pp2[0]
    if saved is not None:
        source_rows, _ = train(tmp_path, "first", *LAMB, *saved, "--save-dir", str(tmp_path / "a"),
                               "--save-every", "3", microbatches=m[0])
        source = tmp_path / "a"
    rows, out = train(tmp_path, "second", *LAMB, "--pp", "1", "--save-dir", str(tmp_path / "b"),
                      "--resume", str(source / "step-00000003"), microbatches=m[1])
    assert "layout changed" in out and "reseeded" in out, out
    assert_resumed_within(tmp_path / "b", rows, reference[m[1]], source, source_rows)


@pytest.mark.parametrize("first,second,m", [("1f1b", "zbv", 3), ("dualpipev", "1f1b", 6)])
def test_resume_from_and_to_a_v_schedule(tmp_path, lamb_pp2, reference, first, second, m):
    """Issue 38: a checkpoint is the unsplit model's, whatever placed its stages: saved under 1F1B (stage s on
    rank s) and resumed under ZB-V (rank 0: stages 0 and 3), saved under DualPipeV and resumed under 1F1B,
    at pp 2. The losses and every tensor agree with the uninterrupted single rank within `floor.K` times
    the saved layout's own distance (the tied embedding's gradient sums in another order under each)."""
    source, source_rows = lamb_pp2[1], lamb_pp2[0]
    if first != "1f1b":
        source_rows, _ = train(tmp_path, "first", *LAMB, "--pp", "2", "--schedule", first, "--save-dir",
                               str(tmp_path / "a"), "--save-every", "3", microbatches=m)
        source = tmp_path / "a"
    rows, out = train(tmp_path, "second", *LAMB, "--pp", "2", "--schedule", second, "--save-dir",
                      str(tmp_path / "b"), "--resume", str(source / "step-00000003"), microbatches=m)
    assert "resumed from" in out and "at step 3" in out, out
    assert_resumed_within(tmp_path / "b", rows, reference[m], source, source_rows)


# -- (c) damaged shards ------------------------------------------------------------------------------

@pytest.mark.parametrize("damage,shard,pp,reason", [
    ("truncate", "layers/h.3.safetensors", "2", "truncated"),  # both ranks resume, one reads it
    ("flip", "optim/h.1.safetensors", "1", "SHA-256 mismatch"),
])
def test_a_damaged_shard_is_refused_with_its_file_name(tmp_path, lamb_pp2, damage, shard, pp, reason):
    """The rank that reads the damaged file reports it, naming it: one line on stderr, exit 2."""
    ck = tmp_path / "ck"
    shutil.copytree(lamb_pp2[1] / "step-00000003", ck)
    path = ck / shard
    data = bytearray(path.read_bytes())
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else data[:-1] + bytes([data[-1] ^ 1]))
    r = mpt(*BASE, "--microbatches", "3", *LAMB, "--pp", pp, "--resume", str(ck))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert shard in lines[0] and reason in lines[0], lines[0]


# -- (d) an interrupted save -------------------------------------------------------------------------

def test_a_killed_job_leaves_latest_on_a_complete_checkpoint_and_resumes(tmp_path):
    """Kill a pp=2 job (SIGKILL, every process) while it saves every step, whatever it was doing:
    `latest` names a complete checkpoint, its files verify, and --resume latest (on one rank) finishes."""
    root = tmp_path / "ck"
    run = ["--microbatches", "3", "--save-dir", str(root), "--keep", "2"]
    job = subprocess.Popen([sys.executable, "-m", "mp_toolkit.cli", *BASE, *run, "--pp", "2", "--steps", "400",
                            "--save-every", "1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 90
        while _latest(root) < 4 and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
        time.sleep(0.13)  # somewhere inside a later step or save
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the job's own process group: its launcher and both ranks
        job.wait(timeout=30)
    ck = open_checkpoint(root)
    ck.verify()  # every listed file present with its hash, nothing extra
    assert ck.step >= 4
    r = mpt(*BASE, *run, "--pp", "1", "--steps", str(ck.step + 2), "--resume", "latest")
    assert r.returncode == 0 and f"at step {ck.step}" in r.stdout, r.stdout + r.stderr
    assert open_checkpoint(root).step == ck.step + 2
    assert not [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]  # the next save cleaned up


def _latest(root) -> int:
    try:
        return int((root / "latest").read_text().strip().split("-")[1])
    except (OSError, IndexError, ValueError):
        return -1


def test_shards_written_without_a_commit_are_ignored_and_cleaned_up(tmp_path):
    """A save that wrote every shard of step 4 but never committed (the job died before rank 0's commit),
    with a half-written shard beside them: resume takes step 2, and the next save removes the scratch."""
    root = tmp_path / "ck"
    train(tmp_path, "first", "--pp", "1", "--steps", "2", "--save-dir", str(root))
    scratch = root / ".tmp-step-00000004"
    shutil.copytree(root / "step-00000002", scratch)
    (scratch / "manifest.json").unlink()  # commit writes it: an uncommitted save has none
    (scratch / "layers" / ".tmp-h.0.safetensors-4242").write_bytes(b"half a file")
    rows, out = train(tmp_path, "second", "--pp", "1", "--steps", "3", "--save-dir", str(root), "--resume", "latest")
    assert "at step 2" in out and [r["step"] for r in rows] == [3], out
    assert not scratch.exists() and (root / "latest").read_text().strip() == "step-00000003"


# -- (e) keep ----------------------------------------------------------------------------------------

def test_keep_retains_the_newest_and_a_finished_run_has_nothing_to_do(tmp_path):
    root = tmp_path / "ck"
    train(tmp_path, "run", "--pp", "1", "--steps", "5", "--save-dir", str(root), "--save-every", "1", "--keep", "2")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000004", "step-00000005"]
    assert open_checkpoint(root).step == 5
    r = mpt(*BASE, "--microbatches", "3", "--pp", "1", "--steps", "5", "--save-dir", str(root), "--resume")
    assert r.returncode == 0 and "nothing to train" in r.stdout, r.stdout + r.stderr
