"""`mpt train --engine deepspeed` against `--engine mp_toolkit` (DESIGN.md invariant 1), and its refusals.

The two engines train the same gpt-tiny (tied embedding and LM head, so DeepSpeed's TiedLayerSpec
path runs) from the same seed on the same micro-batches, cut at the same explicit boundaries, with
our LAMB and a clipping threshold below every step's gradient norm (so the clip binds and its norm
must be the global one over both stages). Both divide each micro-batch loss by the number of
micro-batches before backward and accumulate the gradients in micro-batch order, so the gradients
are the same bits; the clipping norm is summed in a different order (DeepSpeed adds the squares of
per-tensor norms and all-reduces the sum; ours takes the 2-norm of the gathered per-tensor norms),
which may move the clip coefficient by an ulp. Tolerance: 1e-6 relative on the loss, 1e-5 on the
norm (measured: losses bitwise equal, norms within 1e-7).
"""

import json
import os
import subprocess
import sys

import pytest

from mp_toolkit.engine.deepspeed_bridge import fp16_available
from tests.cli_helpers import assert_one_line_exit_2
from tests.mpt_command import MptProcess, run_mpt

BASE = ["train", "--model", "gpt-tiny", "--pp", "2", "--data", "synthetic", "--steps", "3", "--microbatches", "3",
        "--micro-batch", "2", "--seq-len", "16", "--threads", "1", "--no-progress", "--lr", "1e-2", "--seed", "7",
        "--optimizer", "lamb", "--clip-grad", "0.05", "--precision", "fp32"]
CUT = [0, 2, 7]  # neither "uniform" nor "parameters" (ours or DeepSpeed's) cuts gpt-tiny's 7 layers here
ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def start(tmp_path, engine: str) -> tuple[MptProcess, str]:
    metrics = tmp_path / f"{engine}.jsonl"
    argv = [*BASE, "--partition", ",".join(map(str, CUT)), "--engine", engine, "--metrics", str(metrics)]
    return MptProcess(argv, env=ENV), metrics


def finish(proc: MptProcess, metrics) -> tuple[list[dict], str]:
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        proc.close()
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()], out


def test_deepspeed_engine_trains_like_ours_with_the_same_cut(tmp_path):
    runs = [start(tmp_path, engine) for engine in ("deepspeed", "mp_toolkit")]  # both at once: imports dominate
    (ds, ds_out), (ours, _) = [finish(*run) for run in runs]
    assert f"deepspeed PipelineModule: boundaries {CUT}" in ds_out  # DeepSpeed's module.parts
    assert [r["step"] for r in ds] == [r["step"] for r in ours] == [1, 2, 3]
    assert [r["loss"] for r in ds] == pytest.approx([r["loss"] for r in ours], rel=1e-6)
    assert all(r["grad_norm"] > 0.05 for r in ours)  # the clip binds on every step
    assert [r["grad_norm"] for r in ds] == pytest.approx([r["grad_norm"] for r in ours], rel=1e-5)
    assert ds[-1]["loss"] != ds[0]["loss"]  # it trained
    for d, o in zip(ds, ours):
        assert d["lr"] == o["lr"] and not d["skipped"]
        assert d["tokens_per_s"] * d["step_time_s"] == pytest.approx(3 * 2 * 16)
        # each stage holds the same layers: the per-stage spread of LAMB's trust ratios agrees
        for sd, so in zip(d["trust_ratio"], o["trust_ratio"], strict=True):
            assert [sd[k] for k in ("min", "median", "max")] == pytest.approx([so[k] for k in ("min", "median", "max")],
                                                                            rel=1e-5)
    assert "peak_memory_bytes" in ds[-1]


@pytest.mark.parametrize("extra, mentions", [
    (["--tp", "2"], "--tp 2 with --engine deepspeed"),
    (["--schedule", "gpipe"], "--schedule gpipe with --engine deepspeed"),
    (["--schedule", "interleaved"], "--schedule interleaved with --engine deepspeed"),
    (["--save-dir", "runs/x"], "--save-dir with --engine deepspeed"),
    (["--precision", "bf16"], "--optimizer lamb with --precision bf16 and --engine deepspeed"),
])
def test_what_the_deepspeed_engine_does_not_run_is_refused_in_one_line(capsys, extra, mentions):
    assert_one_line_exit_2(capsys, [*BASE, "--engine", "deepspeed", *extra], mentions)


@pytest.mark.skipif(fp16_available(), reason="DeepSpeed runs fp16 here (CUDA, or oneDNN fp16 kernels)")
def test_fp16_without_fp16_kernels_is_refused(capsys):
    line = assert_one_line_exit_2(capsys, [*BASE, "--engine", "deepspeed", "--precision", "fp16"], "--precision fp16")
    assert "fp32 or bf16" in line


def test_unknown_engine_is_refused_and_checks_import_no_deepspeed():
    code = ("import sys; from mp_toolkit.cli import main; "
            "c = main(['train', '--engine', 'deepspeed', '--tp', '2', '--model', 'gpt-tiny']); "
            "print(c, 'deepspeed' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False"], r.stderr  # refused before DeepSpeed (seconds to import) loads
    r = run_mpt(["train", "--engine", "megatron"], env=ENV, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--engine" in r.stderr
