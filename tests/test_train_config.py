"""`mpt train --config ds_config.json`: DeepSpeed values reach TrainConfig, the optimizer, the loss scaler and
the lr schedule; flags given on the command line win; errors are one line naming the key."""

import dataclasses
import json

import pytest
import torch

from mp_toolkit.cli import build_parser, main
from mp_toolkit.commands.train import train_config
from mp_toolkit.ds.defaults import deepspeed_defaults
from mp_toolkit.optim.factory import build_optimizer
from mp_toolkit.optim.lr import WarmupDecayLR, WarmupLR
from mp_toolkit.optim.settings import Optim
from mp_toolkit.run.compose import loss_scaler
from mp_toolkit.run.config import SECTION_OF, SECTIONS, Parallel, TrainConfig
from mp_toolkit.run.loop import lr_at
from mp_toolkit.run.state import Progress
from tests.cli_helpers import assert_one_line_exit_2

DS = {
    "train_batch_size": 48, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5,
    "steps_per_print": 10, "wall_clock_breakdown": False,
    "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 100, "hysteresis": 3,
             "consecutive_hysteresis": True, "min_loss_scale": 2},
    "optimizer": {"type": "Lamb", "params": {"lr": 4e-3, "betas": [0.8, 0.95], "eps": 1e-7, "weight_decay": 0.02,
                                             "min_coeff": 0.05, "max_coeff": 4.0, "bias_correction": False}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 4e-3, "warmup_num_steps": 10,
                                                      "total_num_steps": 100, "warmup_type": "linear"}},
    "pipeline": {"stages": 2, "partition_method": "uniform", "activation_checkpoint_interval": 0},
}


def config(tmp_path, doc=DS, *flags, world_size=None):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(doc))
    return train_config(build_parser().parse_args(["train", "--config", str(path), *flags]), world_size)


def test_every_deepspeed_value_reaches_the_train_config(tmp_path):
    cfg, notes = config(tmp_path)
    par, batch, num, o = cfg.parallel, cfg.batch, cfg.numerics, cfg.optim
    assert (par.pp, par.dp, par.partition, batch.micro_batch, batch.microbatches, o.clip_grad) == (
        2, 1, "uniform", 4, 12, 0.5)
    assert (num.precision, num.initial_scale_power, num.loss_scale_window, num.hysteresis, num.min_loss_scale,
            num.consecutive_hysteresis) == ("fp16", 12, 100, 3, 2.0, True)
    assert (o.optimizer, o.lr, o.weight_decay, o.betas, o.eps) == ("lamb", 4e-3, 0.02, (0.8, 0.95), 1e-7)
    assert (o.min_trust, o.max_trust, o.bias_correction) == (0.05, 4.0, False)
    assert o.lr_schedule == WarmupDecayLR(warmup_max_lr=4e-3, warmup_num_steps=10, total_num_steps=100,
                                          warmup_type="linear")
    assert o.lamb_rule == "deepspeed"  # "type": "Lamb" is DeepSpeed's FusedLamb
    # nothing overridden; the DeepSpeed whose defaults filled the absent keys is named first
    assert notes[0].endswith(f"settings from the DeepSpeed config (dp 1; absent keys take the defaults of "
                             f"{deepspeed_defaults().source})")
    assert notes[1] == (f"{tmp_path / 'ds.json'}: keys not used by mp_toolkit: "
                        "steps_per_print, wall_clock_breakdown")


def test_flags_on_the_command_line_override_the_file_and_say_so(tmp_path):
    cfg, notes = config(tmp_path, DS, "--pp", "1", "--micro-batch", "2", "--seed", "7", "--clip-grad", "none")
    assert (cfg.parallel.pp, cfg.batch.micro_batch, cfg.batch.microbatches, cfg.seed, cfg.optim.clip_grad) == (
        1, 2, 12, 7, None)
    assert "overridden on the command line: --clip-grad, --micro-batch, --pp" in notes[0]  # --seed: not in the file
    # a schedule flag replaces the config's scheduler (its exact DeepSpeed schedule) by warm-up/decay
    cfg, notes = config(tmp_path, DS, "--lr", "1e-3")
    assert cfg.optim.lr_schedule is None and cfg.optim.lr == 1e-3 and cfg.optim.lr_decay == "linear"
    assert any("the scheduler block is replaced by warm-up/decay of --lr" in n for n in notes)
    # another optimizer drops Lamb's coefficients
    cfg, _ = config(tmp_path, DS, "--optimizer", "adamw")
    o = cfg.optim
    assert (o.optimizer, o.betas, o.min_trust, o.bias_correction, o.lamb_rule) == (
        "adamw", None, None, True, "mp_toolkit")


def test_dp_is_what_the_launcher_world_leaves_after_pp_and_tp(tmp_path):
    """DeepSpeed: dp = world / (pp x tp), and the batch arithmetic uses it: 48 = 4 x 6 x dp 2."""
    cfg, notes = config(tmp_path, world_size=4)
    assert (cfg.parallel.pp, cfg.parallel.dp, cfg.batch.micro_batch, cfg.batch.microbatches) == (2, 2, 4, 6)
    assert "(dp 2; " in notes[0]
    cfg, _ = config(tmp_path, DS, "--pp", "1", "--tp", "2", world_size=8)
    assert (cfg.parallel.dp, cfg.batch.microbatches) == (4, 3)


def test_defaults_are_unchanged_without_a_config():
    cfg, notes = train_config(build_parser().parse_args(["train"]))
    assert cfg == TrainConfig() and notes == []


def test_flat_names_reach_their_sections_and_come_back():
    """One table, derived from the sections' fields, puts each flat name (a flag's, a DeepSpeed override's,
    a manifest's) in its section: 6 top-level fields and 9 sections hold the 75 names, each once."""
    top = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in SECTIONS]
    in_sections = [f.name for kind in SECTIONS.values() for f in dataclasses.fields(kind)]
    assert (len(dataclasses.fields(TrainConfig)), len(SECTIONS), len(top) + len(in_sections)) == (15, 9, 75)
    assert len(set(top + in_sections)) == len(SECTION_OF) == 75 and list(TrainConfig().flat()) == list(SECTION_OF)
    cfg = TrainConfig.of(model="gpt-tiny", pp=4, lr=2e-3, precision="bf16", save_every=5, data="synthetic")
    assert (cfg.model, cfg.parallel.pp, cfg.optim.lr, cfg.numerics.precision, cfg.checkpoint.save_every,
            cfg.dataset.data) == ("gpt-tiny", 4, 2e-3, "bf16", 5, "synthetic")
    assert cfg.replace(parallel=Parallel(pp=3), dp=2).parallel == Parallel(pp=3, dp=2)  # the section, then its names
    assert cfg.replace(lr=1e-2).optim == dataclasses.replace(cfg.optim, lr=1e-2) and cfg.optim.lr == 2e-3
    assert TrainConfig.of(**cfg.flat()) == cfg and cfg.flat()["pp"] == 4
    with pytest.raises(TypeError, match="learning_rate"):
        TrainConfig.of(learning_rate=1e-3)


def test_the_factory_passes_every_option():
    w = torch.nn.Parameter(torch.ones(3, 3))
    named = [("h.0.weight", w)]
    lamb = build_optimizer(Optim("lamb", lr=1e-3, weight_decay=0.01, betas=(0.8, 0.9), eps=1e-5, min_trust=0.1,
                                 max_trust=2.0, bias_correction=False), named)
    g = lamb.param_groups[0]
    assert (g["betas"], g["eps"], g["min_trust"], g["max_trust"], g["bias_correction"]) == (
        (0.8, 0.9), 1e-5, 0.1, 2.0, False)
    lars = build_optimizer(Optim("lars", lr=0.1, weight_decay=0.0, momentum=0.7, trust_coefficient=0.02, eps=1e-6),
                           named)
    lars_group = lars.param_groups[0]
    assert (lars_group["momentum"], lars_group["trust_coefficient"], lars_group["eps"]) == (0.7, 0.02, 1e-6)
    adamw = build_optimizer(Optim("adamw", lr=1e-3, weight_decay=0.0, betas=(0.5, 0.6), eps=1e-4), named)
    assert (adamw.param_groups[0]["betas"], adamw.param_groups[0]["eps"]) == ((0.5, 0.6), 1e-4)
    sgd = Optim("sgd", lr=0.1, weight_decay=0.0)
    assert build_optimizer(Optim("sgd", lr=0.1, momentum=0.5), named).param_groups[0]["momentum"] == 0.5
    # without options every optimizer keeps its own defaults
    assert build_optimizer(Optim("lamb", lr=1e-3, weight_decay=0.0), named).param_groups[0]["eps"] == 1e-6
    assert build_optimizer(sgd, named).param_groups[0]["momentum"] == 0.9


def test_the_loss_scaler_and_the_schedule_come_from_the_config(tmp_path):
    cfg, _ = config(tmp_path)
    scaler = loss_scaler(cfg)
    assert (scaler.scale, scaler.loss_scale_window, scaler.hysteresis, scaler.min_loss_scale,
            scaler.consecutive_hysteresis) == (2.0 ** 12, 100, 3, 2.0, True)
    # the DeepSpeed schedule counts applied steps: after 5 steps of which 2 were skipped, step 6 runs at
    # schedule position 4 = DeepSpeed iteration 2 of a linear 10-step warm-up
    assert lr_at(cfg, Progress(step=5, applied=3), 6) == pytest.approx(4e-3 * 2 / 10)
    assert lr_at(cfg, Progress(step=5, applied=3), 6) == cfg.optim.lr_schedule(4)
    plain = TrainConfig.of(lr=1e-2, steps=10, warmup_steps=4)  # WarmupDecay counts every step
    assert lr_at(plain, Progress(step=5, applied=3), 2) == pytest.approx(5e-3)


def test_an_in_process_run_follows_the_config_and_lists_ignored_keys_once(tmp_path, capsys):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 5,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-6}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 3,
                                                       "warmup_type": "linear"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    metrics = tmp_path / "m.jsonl"
    code = main(["train", "--config", str(path), "--model", "gpt-tiny", "--pp", "1", "--data", "synthetic",
                 "--seq-len", "16", "--steps", "4", "--threads", "1", "--no-progress", "--metrics", str(metrics)])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("keys not used by mp_toolkit: steps_per_print") == 1
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    schedule = WarmupLR(warmup_max_lr=1e-2, warmup_num_steps=3, warmup_type="linear")
    assert [r["lr"] for r in rows] == [schedule(s) for s in (1, 2, 3, 4)] == pytest.approx([0, 0, 1e-2 / 3, 2e-2 / 3])
    assert all(r["tokens_per_s"] * r["step_time_s"] == pytest.approx(2 * 2 * 16) for r in rows)


def _bad(capsys, *args, mentions):
    assert_one_line_exit_2(capsys, args, mentions)


def test_config_errors_are_one_line_naming_the_key(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**DS, "optimizer": {"type": "Lamb", "params": {"lr": -1}}}))
    _bad(capsys, "train", "--config", str(path), mentions="optimizer.params.lr -1 must be a positive finite number")
    path.write_text(json.dumps({**DS, "pipeline": {"stages": 9}}))
    _bad(capsys, "train", "--config", str(path), "--model", "gpt-tiny", "--seq-len", "16",
         mentions=f"--pp 9 exceeds the model's 7 layers (embed, h.0, h.1, h.2, h.3, ln_f, lm_head): use at most 7 "
                  f"(from pipeline.stages in {path})")
    path.write_text("{not json")
    _bad(capsys, "train", "--config", str(path), mentions="not valid JSON at line 1")
    _bad(capsys, "train", "--config", str(tmp_path / "missing.json"), mentions="no such DeepSpeed config file")


def test_options_an_optimizer_does_not_read_are_refused(capsys):
    _bad(capsys, "train", "--model", "gpt-tiny", "--momentum", "0.5",
         mentions="--momentum is not an option of --optimizer adamw")
    _bad(capsys, "train", "--model", "gpt-tiny", "--no-bias-correction",
         mentions="--no-bias-correction applies to --optimizer lamb")
    _bad(capsys, "train", "--model", "gpt-tiny", "--optimizer", "lamb", "--min-trust", "2", "--max-trust", "1",
         mentions="--min-trust 2.0 exceeds --max-trust 1.0")
    _bad(capsys, "train", "--model", "gpt-tiny", "--betas", "0.9", "1.5", mentions="--betas 0.9 1.5")


def test_checkpoint_flags_are_checked_before_any_rank_starts(capsys, tmp_path):
    _bad(capsys, "train", "--model", "gpt-tiny", "--resume", mentions="--resume latest needs --save-dir")
    _bad(capsys, "train", "--model", "gpt-tiny", "--resume", str(tmp_path / "nope"),
         mentions="no such checkpoint directory")
    _bad(capsys, "train", "--model", "gpt-tiny", "--save-every", "5", mentions="--save-every 5 needs --save-dir")
    _bad(capsys, "train", "--model", "gpt-tiny", "--save-dir", str(tmp_path), "--keep", "-1", mentions="--keep -1")


def test_the_deepspeed_launchers_local_rank_is_accepted():
    """deepspeed passes --local_rank=N first (before `train` with `--module`, after it through a script)."""
    for argv in (["--local_rank=1", "train", "--pp", "1"], ["train", "--local_rank=1", "--pp", "1"],
                 ["train", "--local-rank", "0", "--pp", "1"]):
        cfg, _ = train_config(build_parser().parse_args(argv))
        assert cfg.parallel.pp == 1
