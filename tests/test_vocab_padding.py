"""Vocabulary padding for tensor parallelism: any vocabulary splits over any tp.

At tp > 1 the embedding and LM head hold ``Vp / tp`` rows each, ``Vp`` the vocabulary rounded up to
a multiple of 128 x tp (`mp_toolkit.parallel.vocab_parallel`). The padded rows must be invisible:
the same losses and full parameters as one process (to the measured fp32 floor, tests/floor.py),
the rows stay exactly zero under weight decay, LAMB and LARS, and every full form (gather_full,
checkpoints, `mpt export`) has the original vocabulary. The model: a GPT with vocab 997 (prime),
padded to 1024 at tp = 2.
"""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_zoo import gpt
from mp_toolkit.checkpoint import open_checkpoint
from mp_toolkit.cli import main
from mp_toolkit.parallel.tensor_parallel import padded_vocab_size
from mp_toolkit.run.checks import validate
from mp_toolkit.run.config import TrainConfig
from tests.dist_harness import run_world
from tests.floor import assert_all_within, assert_within
from tests.mpt_command import run_mpt
from tests.vocab_padding_workers import CONFIG, PADDED, VOCAB, padded_layers, padded_oracle

torch.set_num_threads(1)


def test_padded_size_is_megatrons_rule():
    assert padded_vocab_size(50257, 2) == 50432 and padded_vocab_size(50257, 8) == 51200  # 128 x tp
    assert padded_vocab_size(VOCAB, 2) == PADDED and padded_vocab_size(256, 2) == 256
    assert padded_vocab_size(VOCAB, 1) == VOCAB  # nothing is split, nothing padded
    assert padded_vocab_size(VOCAB, 2, divisible_by=1) == 998


def test_gpt2_preset_is_no_longer_refused_at_tp2():
    validate(TrainConfig.of(model="gpt2", pp=1, tp=2, dp=1))  # was: "--tp 2 does not divide vocab=50257"


def test_padded_layers_and_loss_match_the_unsplit_ones():
    """Embedding, an LM head with a bias (BERT's decoder) and the cross-entropy at tp = 2 on ids and
    labels from both shards and the last real id: the padded ids are -inf logits and get no gradient."""
    ranks = run_world(padded_layers, 2, timeout_s=120)
    for r, result in enumerate(ranks):
        assert result["shapes"] == ((512, 8), (512, 8), (512,)) and result["local_shape"] == (2, 4, 512)
        assert result["pad_rows"] == (0, 27)[r]  # ids 997..1023 live on rank 1
        assert result["pad_zero"] and result["pad_logits_inf"]
        for label, (got, want) in result["pairs"].items():
            exact = label.startswith("weight:") or label == "logits"  # a copy; a gather of the same products
            torch.testing.assert_close(got, want, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6,
                                       msg=lambda m, label=label: f"{label}: {m}")


@pytest.mark.parametrize("optimizer,tied", [("lamb", True), ("lars", False)])
def test_tp2_training_matches_one_process_and_padding_stays_zero(optimizer, tied):
    ranks = run_world(padded_oracle, 2, optimizer, tied, timeout_s=300)
    head = "embed.wte.weight" if tied else "lm_head.weight"
    ratios = []
    for result in ranks:
        ratios.append(assert_within(*result["losses"], f"{optimizer} losses"))
        ratios.append(assert_all_within(result["params"], f"{optimizer}"))
        assert {"embed.wte.weight", head} <= result["trust"].keys()  # the padded tensors are adapted
        ratios.append(assert_all_within(result["trust"], f"{optimizer} trust ratio"))
        assert result["pad_max"] == {"init": 0.0, "trained": 0.0, "optimizer_state": 0.0}
        assert result["state_tensors"] >= 1
        assert result["padded"]["embed.wte.weight"] == ((512, 16), (VOCAB, 16))  # shard, gather_full
        assert result["padded"].get("lm_head.weight", ((512, 16), (VOCAB, 16))) == ((512, 16), (VOCAB, 16))
        assert result["reshard"]  # shard_full(gather_full(p)) is p, zero padding included
    print(f"{optimizer}: worst error / fp32 floor {max(ratios):.2f}")


# ---------------------------------------------------------------- the CLI: train at tp 2, export, resume at tp 1

RUN = ["--data", "synthetic", "--micro-batch", "2", "--microbatches", "2", "--seq-len", "16", "--lr", "1e-2",
       "--threads", "1", "--no-progress", "--timeout", "60"]


def _mpt_train(*args) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = run_mpt(["train", *args, *RUN], env=env, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_cli_trains_an_odd_vocab_at_tp2_and_its_checkpoint_loads_in_transformers_and_at_tp1(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", **CONFIG.to_dict()}))
    out = _mpt_train("--model", config, "--pp", "1", "--tp", "2", "--steps", "2", "--save-dir", tmp_path / "run",
                     "--cache-dir", tmp_path / "cache")
    assert f"tp 2 (vocab {VOCAB} padded to {PADDED})" in out, out
    ck = open_checkpoint(tmp_path / "run")
    state = {k: v for layer in ck.layer_names for k, v in ck.read_layer(layer).items()}
    assert state["embed.wte.weight"].shape == (VOCAB, CONFIG.n_embd)  # the full form holds no padding
    for name, v in ck.read_optimizer("embed")[0]["embed.wte.weight"].items():
        assert v.shape in ((VOCAB, CONFIG.n_embd), ()), name

    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.vocab_size == VOCAB and hf.transformer.wte.weight.shape == (VOCAB, CONFIG.n_embd)
    ours = gpt.GPT(CONFIG)
    result = ours.load_state_dict(state, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # the tie loads once
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ours.eval()(ids), hf(ids).logits
    assert got.shape == want.shape == (2, 16, VOCAB)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)  # HF's gelu_new vs ours: ~1e-7 apart

    # resume on one rank: no padding there, the checkpoint's (997, C) tensors load as they are
    out = _mpt_train("--model", config, "--pp", "1", "--tp", "1", "--steps", "3", "--save-dir", tmp_path / "run",
                     "--cache-dir", tmp_path / "cache", "--resume", "latest")
    assert "resumed from" in out and "padded" not in out, out
