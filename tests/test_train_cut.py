"""`mpt train --partition flops|time`: the same cut as `mpt plan`, computed once and shared."""

import json
import re

import pytest
import torch

from model_zoo import bert, gpt
from mp_toolkit.layers import LayerList
from mp_toolkit.run.config import ConfigError, TrainConfig
from mp_toolkit.run.cut import CutWorkload, config_of, plan_boundaries
from tests.mpt_command import run_mpt

BASE = ["train", "--data", "synthetic", "--steps", "2", "--microbatches", "2", "--micro-batch", "2",
        "--seq-len", "16", "--threads", "1", "--no-progress", "--lr", "1e-2"]


def mpt(*args, timeout=180):
    return run_mpt(args, timeout=timeout)


def plan_cut(tmp_path, model, pp, chunks, micro_batch, seq_len):
    out = tmp_path / "plan.json"
    extra = ["--schedule", "interleaved", "--chunks", str(chunks)] if chunks > 1 else []
    r = mpt("plan", "--model", model, "--pp", str(pp), "--method", "flops", "--micro-batch", str(micro_batch),
            "--microbatches", "4", "--seq-len", str(seq_len), "--tflops", "1", "--json", str(out), *extra)
    assert r.returncode == 0, r.stderr
    stages = json.loads(out.read_text())["stages"]
    return [s["first_layer"] for s in stages] + [stages[-1]["last_layer"] + 1]


@pytest.mark.parametrize("model,build,pp,chunks,seq_len", [
    ("gpt-small-cpu", lambda: gpt.GPT(gpt.PRESETS["gpt-small-cpu"]), 2, 1, 128),
    ("gpt-small-cpu", lambda: gpt.GPT(gpt.PRESETS["gpt-small-cpu"]), 2, 2, 64),
    ("bert-tiny", lambda: bert.BertForPreTraining(bert.PRESETS["bert-tiny"]), 2, 1, 64),
])
def test_train_flops_cut_is_the_plan_flops_cut(tmp_path, model, build, pp, chunks, seq_len):
    with torch.device("meta"):
        m = build()
    cfg = TrainConfig.of(model=model, pp=pp, chunks=chunks, partition="flops", micro_batch=8, seq_len=seq_len)
    got = plan_boundaries(LayerList.from_model(m), pp, "flops", chunks, CutWorkload.of(cfg, config_of(m)))
    assert got == plan_cut(tmp_path, model, pp, chunks, 8, seq_len)
    if model == "gpt-small-cpu" and chunks == 1:
        # the LM head (vocabulary 4096, width 128) costs more FLOPs than a block: three blocks join the
        # embedding on stage 0, while the parameter cut (embedding and head hold equal weights) stops at two
        assert got == [0, 4, 7]
        assert plan_boundaries(LayerList.from_model(m), pp, "parameters") == [0, 3, 7]


def test_flops_is_the_default_and_needs_a_workload():
    assert TrainConfig().parallel.partition == "flops"
    with torch.device("meta"):
        layers = LayerList.from_model(gpt.GPT(gpt.PRESETS["gpt-tiny"]))
    with pytest.raises(ConfigError, match="--partition flops: needs the model's config"):
        plan_boundaries(layers, 2, "flops")


def test_bad_partition_names_the_methods(capsys):
    from tests.cli_helpers import assert_one_line_exit_2

    line = assert_one_line_exit_2(capsys, [*BASE, "--model", "gpt-tiny", "--partition", "fastest"])
    assert "flops, parameters, uniform, time" in line


def test_time_cut_is_measured_once_and_shared_by_both_ranks(tmp_path):
    """Rank 0 times the layers and broadcasts the cut: the run completes (two different cuts
    would deadlock), prints one measured cut, and trains exactly as one process does. The model is
    gpt-tiny untied: a tied embedding and head sum their gradients in another order across stages
    (per stage over the micro-batches, then the tie) than in one process (the tie per micro-batch),
    which is bitwise only for some data (`--seed 4` of the synthetic ids is not)."""
    model = tmp_path / "gpt-tiny-untied.json"
    model.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 32,
                                 "n_layer": 4, "n_head": 4, "tie_word_embeddings": False}))

    def run(name, *args):
        out = tmp_path / f"{name}.jsonl"
        r = mpt(*BASE, "--model", str(model), "--metrics", str(out), *args)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout, [json.loads(line)["loss"] for line in out.read_text().splitlines()]

    stdout, two = run("time", "--pp", "2", "--partition", "time", "--timeout", "120")
    cuts = re.findall(r"--partition time: layers measured on this machine, cut \[(\d+), (\d+), (\d+)\]", stdout)
    assert len(cuts) == 1, stdout
    a, b, c = map(int, cuts[0])
    assert a == 0 and 0 < b < c == 7  # gpt-tiny: embed, 4 blocks, ln_f, lm_head
    _, one = run("one", "--pp", "1")
    assert two == one  # pipeline-only: bitwise the single-process run, whatever the cut
