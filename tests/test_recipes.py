"""recipes/: the DeepSpeed configs parse, and one recipe entry runs under the deepspeed launcher, torchrun
and `mpt train --config` (CPU, gloo, 2 processes)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mp_toolkit.cli import main
from mp_toolkit.ds.config import read_ds_config
from mp_toolkit.optim.lr import WarmupDecayLR, WarmupLR
from mp_toolkit.run.launch import free_port

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
BIN = Path(sys.executable).parent


def run_group(cmd, timeout, cwd=None, env=None):
    """Run ``cmd`` in its own process group; on timeout kill the whole group (launcher and ranks)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[0]} ran past {timeout}s:\n{out[-3000:]}")
    return proc.returncode, out


def env(**extra):
    return dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1", **extra)


@pytest.mark.parametrize("dp,gas", [(1, 8), (8, 8)])
def test_gpt_recipe_config_parses(dp, gas):
    s = read_ds_config(RECIPES / "gpt_pretrain" / "ds_config.json", dp=dp)
    assert (s.train_micro_batch_size_per_gpu, s.gradient_accumulation_steps, s.train_batch_size) == (8, gas, 64 * dp)
    assert (s.precision, s.gradient_clipping, s.pp, s.partition) == ("bf16", 1.0, 2, "parameters")
    assert (s.optimizer.name, s.optimizer.lr, s.optimizer.min_trust, s.optimizer.max_trust) == (
        "lamb", 2e-3, 0.01, 10.0)
    assert s.scheduler == WarmupDecayLR(warmup_min_lr=0.0, warmup_max_lr=2e-3, warmup_num_steps=200,
                                        total_num_steps=5000, warmup_type="linear")
    assert s.ignored == ("steps_per_print", "wall_clock_breakdown")


@pytest.mark.parametrize("dp,gas", [(1, 32), (4, 8), (8, 4)])
def test_bert_recipe_config_parses(dp, gas):
    """train_batch_size 1024 with 32 per GPU: DeepSpeed derives the accumulation steps from dp."""
    s = read_ds_config(RECIPES / "bert_pretrain" / "ds_config.json", dp=dp)
    assert (s.train_batch_size, s.train_micro_batch_size_per_gpu, s.gradient_accumulation_steps) == (1024, 32, gas)
    assert (s.precision, s.fp16.loss_scale, s.fp16.hysteresis, s.pp, s.partition) == ("fp16", 0.0, 2, 2, "uniform")
    assert (s.optimizer.name, s.optimizer.lr, s.optimizer.eps, s.optimizer.bias_correction) == (
        "lamb", 6e-3, 1e-6, True)
    assert s.scheduler == WarmupLR(warmup_min_lr=0.0, warmup_max_lr=6e-3, warmup_num_steps=2000, warmup_type="linear")
    assert s.recompute is None and "pipeline.activation_checkpoint_interval" not in s.ignored  # 0: read, off


def losses(path):
    return [json.loads(line)["loss"] for line in Path(path).read_text().splitlines()]


def test_gpt_recipe_smoke_under_the_deepspeed_launcher(tmp_path):
    """`run.sh --smoke`: the real deepspeed launcher starts 2 CPU processes (pipeline.stages 2) that train
    a 4-layer GPT for 30 steps on this repository's sources; the loss falls (measured 6.25 -> 5.94 with
    the config's "Lamb" as DeepSpeed's FusedLamb, whose clamped trust ratios on every tensor take smaller
    early steps than our rule: the smoke run's lr is 3e-2)."""
    metrics = tmp_path / "smoke.jsonl"
    code, out = run_group([str(RECIPES / "gpt_pretrain" / "run.sh"), "--smoke", "--cache-dir", str(tmp_path / "cache"),
                           "--metrics", str(metrics)], timeout=150,
                          env=env(DEEPSPEED=str(BIN / "deepspeed"), MASTER_PORT=str(free_port())))
    assert code == 0, out[-3000:]
    assert "launch.py" in out and "--local_rank=1" in out  # deepspeed's launcher, which passes --local_rank
    assert "pp 2, tp 1, dp 1" in out and "optimizer lamb" in out
    assert out.count("keys not used by mp_toolkit: steps_per_print, wall_clock_breakdown") == 1  # rank 0, once
    loss = losses(metrics)
    assert len(loss) == 30 and sum(loss[-5:]) / 5 < loss[0] - 0.25, loss


def test_bert_recipe_entry_under_torchrun(tmp_path):
    """The recipe's train.py needs no DeepSpeed: torchrun starts the same 2 ranks (LOCAL_WORLD_SIZE set)."""
    metrics = tmp_path / "m.jsonl"
    cmd = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "train.py", "--deepspeed_config", "ds_config.json",
           "--model", "bert-tiny", "--data", str(RECIPES.parent / "mp_toolkit"), "--seq-len", "64",
           "--micro-batch", "4", "--microbatches", "2", "--steps", "4", "--precision", "fp32", "--lr", "1e-2",
           "--threads", "1", "--no-progress", "--cache-dir", str(tmp_path / "cache"), "--metrics", str(metrics)]
    code, out = run_group(cmd, timeout=120, cwd=RECIPES / "bert_pretrain", env=env())
    assert code == 0, out[-3000:]
    assert "model bert-tiny (bert)" in out and "pp 2, tp 1, dp 1" in out and "optimizer lamb" in out
    assert len(losses(metrics)) == 4


def test_gpt_recipe_config_under_mpt_train(tmp_path, capsys):
    """`mpt train --config recipes/.../ds_config.json`, here on one process (--pp 1 overrides pipeline.stages)."""
    metrics = tmp_path / "m.jsonl"
    code = main(["train", "--config", str(RECIPES / "gpt_pretrain" / "ds_config.json"), "--pp", "1",
                 "--model", str(RECIPES / "gpt_pretrain" / "smoke_model.json"), "--data", "synthetic",
                 "--seq-len", "32", "--micro-batch", "2", "--microbatches", "2", "--steps", "3", "--precision", "fp32",
                 "--threads", "1", "--no-progress", "--metrics", str(metrics)])
    out = capsys.readouterr().out
    assert code == 0
    assert "overridden on the command line: --micro-batch, --microbatches, --pp, --precision" in out
    # WarmupDecayLR(linear, 200 warm-up iterations) from the file: DeepSpeed iterations -1, 0, 1
    assert [json.loads(line)["lr"] for line in metrics.read_text().splitlines()] == pytest.approx([0.0, 0.0, 1e-5])


def test_bert_recipe_smoke_under_the_deepspeed_launcher(tmp_path):
    """BERT's `run.sh --smoke` (issue 22): the deepspeed launcher starts 2 CPU processes (pipeline.stages
    2; heartbeats on, as in every run) that pre-train bert-tiny (MLM + NSP) for 30 steps; the loss falls
    by more than its own step-to-step spread over the first five steps."""
    metrics = tmp_path / "smoke.jsonl"
    code, out = run_group([str(RECIPES / "bert_pretrain" / "run.sh"), "--smoke", "--cache-dir", str(tmp_path / "cache"),
                           "--metrics", str(metrics)], timeout=240,
                          env=env(DEEPSPEED=str(BIN / "deepspeed"), MASTER_PORT=str(free_port())))
    assert code == 0, out[-3000:]
    assert "launch.py" in out and "pp 2, tp 1, dp 1" in out and " hung " not in out, out[-3000:]
    loss = losses(metrics)
    noise = max(loss[:5]) - min(loss[:5])  # the floor: how much the loss moves between early steps
    assert len(loss) == 30 and sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - noise, loss
