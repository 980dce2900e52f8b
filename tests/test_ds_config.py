"""The DeepSpeed JSON config reader: every mapping, every error (key named), the batch arithmetic, a
BERT-LAMB config end to end, and DeepSpeed's own config class on the same JSON."""

import json
import os
from pathlib import Path

import pytest
import torch

from mp_toolkit.ds.config import FP16Settings, OptimizerSettings, read_ds_config
from mp_toolkit.ds.defaults import DOCUMENTED, read_installed
from mp_toolkit.optim.lr import WarmupCosineLR, WarmupDecayLR, WarmupLR
from mp_toolkit.run.config import SECTION_OF, ConfigError, TrainConfig

BASE = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}


def read(dp: int = 1, **keys):
    return read_ds_config({**BASE, **keys}, dp=dp)


def fails(config, match: str, dp: int = 1):
    with pytest.raises(ConfigError, match=match) as e:
        read_ds_config(config, dp=dp)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.fixture(scope="module")
def deepspeed_config():
    """DeepSpeed's own config class: without a process group it takes world size 1."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator once, at import
    return pytest.importorskip("deepspeed.runtime.config").DeepSpeedConfig


# -- batch arithmetic -------------------------------------------------------------------------------

@pytest.mark.parametrize("keys,dp,expected", [
    (dict(train_batch_size=64, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=8), 2, (64, 4, 8)),
    (dict(train_batch_size=64, train_micro_batch_size_per_gpu=4), 4, (64, 4, 4)),
    (dict(train_batch_size=96, gradient_accumulation_steps=4), 3, (96, 8, 4)),
    (dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=8), 3, (96, 4, 8)),
    (dict(train_batch_size=32), 2, (32, 16, 1)),
    (dict(train_micro_batch_size_per_gpu=5), 2, (10, 5, 1)),
])
def test_batch_keys_derive_the_third_with_dp(keys, dp, expected):
    s = read_ds_config(keys, dp=dp)
    assert (s.train_batch_size, s.train_micro_batch_size_per_gpu, s.gradient_accumulation_steps, s.dp) == (
        *expected, dp)
    assert s.train_config_overrides()["micro_batch"] == expected[1]
    assert s.train_config_overrides()["microbatches"] == expected[2]


@pytest.mark.parametrize("keys,dp,message", [
    (dict(train_batch_size=64, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=8), 1,
     "train_batch_size 64 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 8 x dp 1 = 32"),
    (dict(train_batch_size=60, train_micro_batch_size_per_gpu=8), 1,
     "train_batch_size 60 is not divisible by train_micro_batch_size_per_gpu 8 x dp 1 = 8"),
    (dict(train_batch_size=64, gradient_accumulation_steps=3), 2,
     "train_batch_size 64 is not divisible by gradient_accumulation_steps 3 x dp 2 = 6"),
    (dict(train_batch_size=10), 4, "train_batch_size 10 is not divisible by dp 4 = 4"),
    (dict(gradient_accumulation_steps=4), 1, "set train_batch_size or train_micro_batch_size_per_gpu"),
    ({}, 1, "set train_batch_size or train_micro_batch_size_per_gpu"),
])
def test_batch_errors(keys, dp, message):
    fails(keys, message, dp=dp)


@pytest.mark.parametrize("dp", [0, -1, True, 2.0])
def test_dp_must_be_a_positive_integer(dp):
    fails(BASE, "dp .* must be a positive integer", dp=dp)


@pytest.mark.parametrize("keys", [
    dict(train_batch_size=64, train_micro_batch_size_per_gpu=4),
    dict(train_batch_size=48, gradient_accumulation_steps=3),
    dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=5), dict(train_batch_size=12),
    dict(train_micro_batch_size_per_gpu=7)])
def test_batch_arithmetic_agrees_with_deepspeed(deepspeed_config, keys):
    ours, theirs = read_ds_config(keys), deepspeed_config(dict(keys))
    assert (ours.train_batch_size, ours.train_micro_batch_size_per_gpu, ours.gradient_accumulation_steps) == (
        theirs.train_batch_size, theirs.train_micro_batch_size_per_gpu, theirs.gradient_accumulation_steps)


def test_inconsistent_batch_is_rejected_by_deepspeed_too(deepspeed_config):
    keys = dict(train_batch_size=64, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=8)
    with pytest.raises(AssertionError, match="64 != 4 \\* 8 \\* 1"):
        deepspeed_config(dict(keys))
    fails(keys, "train_batch_size 64 !=")


# -- clipping and precision -------------------------------------------------------------------------

@pytest.mark.parametrize("keys,clip", [({}, 1.0), (dict(gradient_clipping=0), None),
                                       (dict(gradient_clipping=1.5), 1.5)])
def test_gradient_clipping_absent_is_deepspeeds_default_and_zero_is_off(keys, clip):
    """DeepSpeed >= 0.19.3 clips at 1.0 when the key is absent (GRADIENT_CLIPPING_DEFAULT); 0 turns it off."""
    s = read(**keys)
    assert s.gradient_clipping == (clip or 0.0)
    assert s.train_config_overrides()["clip_grad"] == clip


def test_fp16_block_maps_every_key():
    s = read(fp16=dict(enabled=True, loss_scale=0, initial_scale_power=12, loss_scale_window=500, hysteresis=4,
                       min_loss_scale=2, consecutive_hysteresis=True, auto_cast=False))
    assert s.precision == "fp16"
    assert s.fp16 == FP16Settings(True, 0.0, 12, 500, 4, 2.0, True)
    o = s.train_config_overrides()
    assert (o["precision"], o["loss_scale"], o["initial_scale_power"], o["loss_scale_window"], o["hysteresis"],
            o["min_loss_scale"]) == ("fp16", 0.0, 12, 500, 4, 2.0)
    assert {**o, **s.pending_overrides()}["consecutive_hysteresis"] is True
    assert s.ignored == ("fp16.auto_cast",)


def test_fp16_static_scale_and_defaults():
    s = read(fp16={"enabled": True, "loss_scale": 128})
    assert s.fp16 == FP16Settings(enabled=True, loss_scale=128.0)
    assert read().fp16 == FP16Settings() and read().precision == "fp32"


@pytest.mark.parametrize("key", ["bf16", "bfloat16"])
def test_bf16_and_its_legacy_key(key):
    s = read(**{key: {"enabled": True, "immediate_grad_update": False}})
    assert s.precision == "bf16" and s.train_config_overrides()["precision"] == "bf16"
    assert s.ignored == (f"{key}.immediate_grad_update",)


@pytest.mark.parametrize("keys,message", [
    (dict(fp16={"enabled": True}, bf16={"enabled": True}), "fp16.enabled and bf16.enabled are both true"),
    (dict(fp16={"enabled": True}, bfloat16={"enabled": True}), "fp16.enabled and bfloat16.enabled are both true"),
    (dict(bf16={"enabled": True}, bfloat16={"enabled": False}), "bfloat16 and bf16 are both given"),
    (dict(fp16={"enable": True}), "fp16.enable is not a known key here .*: use enabled, loss_scale"),
    (dict(bf16={"enabled": True, "dtype": "bf16"}), "bf16.dtype is not a known key here"),
])
def test_precision_errors(keys, message):
    fails({**BASE, **keys}, message)


# -- optimizer --------------------------------------------------------------------------------------

def test_lamb_maps_trust_clamp_and_params():
    s = read(optimizer={"type": "LAMB", "params": {"lr": 2e-3, "betas": [0.8, 0.99], "eps": 1e-6,
                                                   "weight_decay": 0.01, "max_coeff": 0.3, "min_coeff": 0.01}})
    assert s.optimizer == OptimizerSettings(type="LAMB", name="lamb", lr=2e-3, weight_decay=0.01, eps=1e-6,
                                            betas=(0.8, 0.99), min_trust=0.01, max_trust=0.3, bias_correction=True)
    every = {**s.train_config_overrides(), **s.pending_overrides()}
    assert {k: every[k] for k in ("optimizer", "lr", "weight_decay", "eps", "betas", "min_trust", "max_trust")} == dict(
        optimizer="lamb", lr=2e-3, weight_decay=0.01, eps=1e-6, betas=(0.8, 0.99), min_trust=0.01, max_trust=0.3)


def test_lamb_takes_deepspeeds_defaults():
    s = read(optimizer={"type": "lamb"})
    assert s.optimizer == OptimizerSettings(type="lamb", name="lamb", lr=1e-3, weight_decay=0.0, eps=1e-8,
                                            betas=(0.9, 0.999), min_trust=0.01, max_trust=10.0)


@pytest.mark.parametrize("kind,params,name", [
    ("Adam", {}, "adamw"),                                  # DeepSpeed's Adam is AdamW by default
    ("adam", {"adam_w_mode": False}, "adam"),
    ("AdamW", {"adam_w_mode": False}, "adamw"),             # AdamW stays AdamW
    ("ADAMW", {"torch_adam": True}, "adamw"),
])
def test_adam_types(kind, params, name):
    s = read(optimizer={"type": kind, "params": {"lr": 3e-4, "weight_decay": 0.1, **params}})
    assert (s.optimizer.name, s.optimizer.lr, s.optimizer.weight_decay, s.optimizer.betas, s.optimizer.eps) == (
        name, 3e-4, 0.1, (0.9, 0.999), 1e-8)
    assert s.train_config_overrides()["optimizer"] == name
    assert s.ignored == (("optimizer.params.torch_adam",) if "torch_adam" in params else ())


def test_lars_momentum_and_trust_coefficient():
    s = read(optimizer={"type": "Lars", "params": {"lr": 0.5, "momentum": 0.8, "trust_coefficient": 0.02,
                                                   "weight_decay": 1e-4}})
    assert s.optimizer == OptimizerSettings(type="Lars", name="lars", lr=0.5, weight_decay=1e-4, eps=1e-8,
                                            momentum=0.8, trust_coefficient=0.02)
    pending = {**s.train_config_overrides(), **s.pending_overrides()}
    assert (pending["momentum"], pending["trust_coefficient"]) == (0.8, 0.02)


@pytest.mark.parametrize("optimizer,message", [
    ({"type": "OneBitLamb"}, 'optimizer.type "OneBitLamb" is not supported by mp_toolkit: use one of Adam, AdamW, '
                             'Lamb, Lars'),
    ({"params": {"lr": 1e-3}}, "optimizer.type is missing: use one of Adam, AdamW, Lamb, Lars"),
    ({"type": 3}, "optimizer.type 3 must be a string"),
    ({"type": "Lamb", "params": {"lr": 1e-3, "freeze_step": 10}}, "optimizer.params.freeze_step is not a known key"),
    ({"type": "Lamb", "params": {"max_grad_norm": 1.0}}, "optimizer.params.max_grad_norm .* use gradient_clipping"),
    ({"type": "Lamb", "params": {"eps_inside_sqrt": True}}, "optimizer.params.eps_inside_sqrt true is not supported"),
    ({"type": "Adam", "params": {"amsgrad": True}}, "optimizer.params.amsgrad true is not supported"),
    ({"type": "Adam", "params": {"bias_correction": False}}, "optimizer.params.bias_correction false is not supported"),
    ({"type": "Lamb", "params": {"min_coeff": 0.5, "max_coeff": 0.3}}, "optimizer.params.min_coeff 0.5 exceeds"),
    ({"type": "Lamb", "params": {"betas": [0.9]}}, "optimizer.params.betas \\[0.9\\] must be two numbers"),
    ({"type": "Lamb", "params": {"lr": "1e-3"}}, 'optimizer.params.lr "1e-3" must be a positive finite number'),
    ({"type": "Lamb", "params": {"lr": 0}}, "optimizer.params.lr 0 must be a positive"),
    ({"type": "Lars", "params": {"momentum": 1.0}}, "optimizer.params.momentum 1.0 must be below 1"),
    ({"type": "Lamb", "params": []}, "optimizer.params must be a JSON object, got \\[\\]"),
    ("Lamb", 'optimizer must be a JSON object, got "Lamb"'),
])
def test_optimizer_errors(optimizer, message):
    fails({**BASE, "optimizer": optimizer}, message)


# -- scheduler --------------------------------------------------------------------------------------

LAMB = {"type": "Lamb", "params": {"lr": 0.004}}


def test_warmup_lr_defaults_to_the_optimizers_lr():
    s = read(optimizer=LAMB, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 50}})
    assert s.scheduler == WarmupLR(warmup_max_lr=0.004, warmup_num_steps=50, warmup_type="log")
    o = s.train_config_overrides()
    assert (o["lr"], o["warmup_steps"], o["lr_decay"]) == (0.004, 50, "none")


def test_warmup_decay_lr_and_its_nearest_warmup_decay():
    s = read(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 100,
                                                            "warmup_min_lr": 1e-5, "warmup_type": "linear"}})
    assert s.scheduler == WarmupDecayLR(total_num_steps=1000, warmup_max_lr=0.001, warmup_min_lr=1e-5,
                                        warmup_num_steps=100, warmup_type="linear")  # DeepSpeed's 0.001 default
    o = s.train_config_overrides()
    assert (o["lr"], o["warmup_steps"], o["lr_decay"], o["min_lr"]) == (0.001, 100, "linear", 1e-5)
    assert "optimizer" not in o  # no optimizer block: the program picks it
    assert {**o, **s.pending_overrides()}["lr_schedule"] is s.scheduler


def test_warmup_cosine_lr_scales_the_optimizers_lr():
    s = read(optimizer=LAMB, scheduler={"type": "WarmupCosineLR", "params": {
        "total_num_steps": 500, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01, "warmup_num_steps": 20}})
    assert s.scheduler == WarmupCosineLR(lr=0.004, total_num_steps=500, warmup_min_ratio=0.1, cos_min_ratio=0.01,
                                         warmup_num_steps=20)
    o = s.train_config_overrides()
    assert (o["lr"], o["lr_decay"], o["min_lr"], o["warmup_steps"]) == (0.004, "cosine", 0.004 * 0.01, 20)


def test_optimizer_without_scheduler_means_constant_lr():
    o = read(optimizer=LAMB).train_config_overrides()
    assert (o["lr"], o["warmup_steps"], o["lr_decay"]) == (0.004, 0, "none")


@pytest.mark.parametrize("scheduler,message", [
    ({"type": "warmuplr"}, 'scheduler.type "warmuplr" is not supported by mp_toolkit: use one of WarmupLR, '
                           'WarmupDecayLR, WarmupCosineLR \\(case-sensitive'),
    ({"type": "OneCycle", "params": {}}, 'scheduler.type "OneCycle" is not supported'),
    ({"params": {}}, "scheduler.type is missing"),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}, "scheduler.params.total_num_steps is required"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, 'scheduler.params.warmup_type "cosine" must be'),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "scheduler.params.warmup_num_steps 0 must be a positive"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 1.5}}, "scheduler.params.warmup_num_steps 1.5 must be"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "cycle_min_lr": 0}}, "scheduler.params.cycle_min_lr is not"),
    ({"type": "WarmupLR", "params": {}}, "scheduler.params.warmup_max_lr is not set and there is no optimizer block"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 9}}, "scheduler.type WarmupCosineLR scales the "
                                                                  "optimizer's lr, but the config has no optimizer"),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 9, "warmup_max_lr": -1}},
     "scheduler.params.warmup_max_lr -1 must be a non-negative"),
])
def test_scheduler_errors(scheduler, message):
    fails({**BASE, "scheduler": scheduler}, message)


# -- pipeline ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,partition", [("Parameters", "parameters"), ("uniform", "uniform"),
                                              ("0, 3, 7", "0,3,7")])
def test_pipeline_stages_and_partition_method(method, partition):
    s = read(pipeline={"stages": 4, "partition_method": method, "seed_layers": True,
                       "activation_checkpoint_interval": 1})
    assert (s.pp, s.partition) == (4, partition)
    o = s.train_config_overrides()
    assert (o["pp"], o["partition"], o["recompute"]) == (4, partition, "full")  # the interval: --recompute full
    assert s.ignored == ("pipeline.seed_layers",)


@pytest.mark.parametrize("name,ours", [("GPipe", "gpipe"), ("1F1B", "1f1b"), ("Interleaved1F1B", "interleaved"),
                                       ("zbh1", "zbh1")])
def test_pipeline_schedule_and_chunks_extension(name, ours):
    s = read(pipeline={"stages": "auto", "schedule": name, "chunks": 2})
    assert (s.pp, s.schedule, s.chunks) == (None, ours, 2)
    o = s.train_config_overrides()
    assert (o["schedule"], o["chunks"]) == (ours, 2) and "pp" not in o


@pytest.mark.parametrize("pipeline,message", [
    ({"partition_method": "type:transformer"}, 'pipeline.partition_method "type:transformer" is not supported by '
                                               'mp_toolkit: use parameters, uniform'),
    ({"partition_method": "profile"}, 'pipeline.partition_method "profile" is not supported'),
    ({"stages": 0}, "pipeline.stages 0 must be a positive integer"),
    ({"stages": "two"}, 'pipeline.stages "two" must be a positive integer'),
    ({"schedule": "dualpipe"}, 'pipeline.schedule "dualpipe" is not a schedule: use one of gpipe, 1f1b'),
    ({"micro_batches": 8}, "pipeline.micro_batches is not read: .* gradient_accumulation_steps"),
    ({"chunks": True}, "pipeline.chunks true must be a positive integer"),
    (4, "pipeline must be a JSON object, got 4"),
])
def test_pipeline_errors(pipeline, message):
    fails({**BASE, "pipeline": pipeline}, message)


# -- ignored, unknown and refused keys --------------------------------------------------------------

def test_understood_but_ignored_and_unknown_keys_are_listed():
    s = read(steps_per_print=10, wall_clock_breakdown=True, communication_data_type="fp32", prescale_gradients=False,
             gradient_predivide_factor=2.0, activation_checkpointing={"partition_activations": False, "profile": True},
             flops_profiler={"enabled": False}, tensorboard={"enabled": True}, wandb={"enabled": False},
             zero_optimization={"stage": 0, "reduce_bucket_size": 5e8}, my_setting=1,
             pipeline={"stages": 2, "shedule": "1f1b"}, optimizer={"type": "Lamb", "legacy_fusion": False, "foo": 1})
    assert s.ignored == ("activation_checkpointing.profile", "communication_data_type", "flops_profiler",
                         "gradient_predivide_factor", "my_setting (unknown)", "optimizer.foo (unknown)",
                         "optimizer.legacy_fusion", "pipeline.shedule (unknown)", "prescale_gradients",
                         "steps_per_print", "wall_clock_breakdown", "zero_optimization")  # monitors: mapped
    assert s.ignored_message() == "DeepSpeed config (dict): keys not used by mp_toolkit: " + ", ".join(s.ignored)
    assert read().ignored == () and read().ignored_message() is None


def test_monitor_sections_map_onto_the_loggers():
    """tensorboard -> output_path/job_name, csv_monitor -> output_path/job_name/metrics.csv, wandb -> its
    project; disabled sections set nothing; their other keys are listed as ignored or unknown."""
    s = read(tensorboard={"enabled": True, "output_path": "logs", "job_name": "run1"},
             csv_monitor={"enabled": True, "output_path": "logs", "job_name": "run1", "flush": 1},
             wandb={"enabled": True, "project": "bert", "team": "t"})
    o = s.train_config_overrides()
    assert (o["tensorboard"], o["csv"], o["wandb"]) == (Path("logs/run1"), Path("logs/run1/metrics.csv"), "bert")
    assert s.ignored == ("csv_monitor.flush (unknown)", "wandb.team")
    assert read(tensorboard={"enabled": True}).train_config_overrides()["tensorboard"] == Path("DeepSpeedJobName")
    off = read(tensorboard={"enabled": False, "output_path": "x"}, wandb={"enabled": False}).train_config_overrides()
    assert not {"tensorboard", "csv", "wandb"} & off.keys()
    fails({**BASE, "tensorboard": {"enabled": "yes"}}, 'tensorboard.enabled "yes" must be true or false')


@pytest.mark.parametrize("keys,message", [
    (dict(zero_optimization={"stage": 2}), "zero_optimization.stage 2: mp_toolkit implements ZeRO stage 1"),
    (dict(zero_optimization={"stage": 3}), "zero_optimization.stage 3: mp_toolkit implements ZeRO stage 1"),
    (dict(zero_optimization={"stage": "1"}), 'zero_optimization.stage "1" must be an integer >= 0'),
    (dict(torch_autocast={"enabled": True}), "torch_autocast.enabled is not supported by mp_toolkit"),
])
def test_refused_features(keys, message):
    fails({**BASE, **keys}, message)


def test_zero_stage_0_and_legacy_false_are_accepted():
    assert read(zero_optimization=False).ignored == ("zero_optimization",)
    assert read(zero_optimization={"stage": 0}).precision == "fp32"
    assert read(zero_optimization={"stage": 0}).zero == 0


def test_zero_stage_1_and_legacy_true_select_zero1():  # tests/test_zero.py trains with it
    assert read(zero_optimization=True).train_config_overrides()["zero"] == 1
    assert read(zero_optimization={"stage": 1}).zero == 1


# -- wrong types -------------------------------------------------------------------------------------

@pytest.mark.parametrize("keys,message", [
    (dict(train_batch_size="32"), 'train_batch_size "32" must be a positive integer'),
    (dict(train_batch_size="auto"), 'train_batch_size "auto" .*HuggingFace Trainer placeholder'),
    (dict(train_batch_size=True), "train_batch_size true must be a positive integer"),
    (dict(train_batch_size=-32), "train_batch_size -32 must be a positive integer"),
    (dict(train_micro_batch_size_per_gpu=4.0), "train_micro_batch_size_per_gpu 4.0 must be a positive integer"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps 0 must be a positive integer"),
    (dict(gradient_clipping="1.0"), 'gradient_clipping "1.0" must be a non-negative finite number'),
    (dict(gradient_clipping=-1), "gradient_clipping -1 must be a non-negative"),
    (dict(gradient_clipping=float("nan")), "gradient_clipping NaN must be"),
    (dict(fp16=True), "fp16 must be a JSON object, got true"),
    (dict(fp16={"enabled": "yes"}), 'fp16.enabled "yes" must be true or false'),
    (dict(fp16={"hysteresis": True}), "fp16.hysteresis true must be a positive integer"),
    (dict(fp16={"loss_scale": -1}), "fp16.loss_scale -1 must be a non-negative"),
    (dict(fp16={"min_loss_scale": 0}), "fp16.min_loss_scale 0 must be a positive"),
    (dict(fp16={"min_loss_scale": 0.5}), "fp16.min_loss_scale 0.5 must be a whole number .*DeepSpeed reads it"),
    (dict(fp16={"initial_scale_power": -1}), "fp16.initial_scale_power -1 must be an integer >= 0"),
    (dict(bf16=[]), "bf16 must be a JSON object, got \\[\\]"),
])
def test_wrong_types_name_the_key(keys, message):
    assert fails({**BASE, **keys}, message).startswith("DeepSpeed config (dict): ")


# -- files -------------------------------------------------------------------------------------------

def test_reads_a_file_and_names_it_in_errors(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**BASE, "gradient_clipping": 0.5}))
    s = read_ds_config(path)
    assert (s.source, s.gradient_clipping, s.gradient_accumulation_steps) == (str(path), 0.5, 8)
    assert read_ds_config(str(path)) == s
    path.write_text(json.dumps({**BASE, "fp16": {"hysteresis": "2"}}))
    assert fails(path, 'fp16.hysteresis "2" must be') == f'{path}: fp16.hysteresis "2" must be a positive integer'


@pytest.mark.parametrize("text,message", [
    ("", "the DeepSpeed config is empty"),
    ("  \n", "the DeepSpeed config is empty"),
    ('{"train_batch_size": 32,\n "fp16": {"enabled": true,}}',
     "not valid JSON at line 2 column 27: Expecting property name"),
    ("[1, 2]", "the config must be a JSON object, got \\[1, 2\\]"),
    ('{"train_batch_size": 32, "train_batch_size": 64}', "key 'train_batch_size' appears twice"),
])
def test_bad_files(tmp_path, text, message):
    path = tmp_path / "ds.json"
    path.write_text(text)
    assert fails(path, message).startswith(f"{path}: ")


def test_unreadable_and_missing_files(tmp_path):
    fails(tmp_path / "missing.json", "missing.json: no such DeepSpeed config file")
    fails(tmp_path, "is a directory, not a file")  # a folder
    (tmp_path / "latin1.json").write_bytes(b'{"x": "\xe9"}')
    fails(tmp_path / "latin1.json", "latin1.json: not UTF-8 text")
    fails(42, "a DeepSpeed config is a file path or a dict, got int")


# -- TrainConfig mapping and a realistic config --------------------------------------------------------

BING_BERT_LAMB = {  # as DeepSpeedExamples' bing_bert deepspeed_bsz64k_lamb_config_seq128.json, plus a schedule
    "train_batch_size": 65536, "train_micro_batch_size_per_gpu": 64, "steps_per_print": 1000,
    "prescale_gradients": False, "gradient_clipping": 1.0, "wall_clock_breakdown": False,
    "optimizer": {"type": "Lamb", "params": {"lr": 11e-3, "weight_decay": 0.01, "bias_correction": False,
                                             "max_coeff": 0.3, "min_coeff": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 7038, "warmup_num_steps": 2000,
                                                      "warmup_max_lr": 11e-3, "warmup_type": "linear"}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
}


def test_defaults_a_package_does_not_give_are_named_where_they_fall_back(tmp_path):
    """A deepspeed package whose sources give only some defaults, and one list of refused keys: the
    rest take 0.19.x's documented values, and the line naming the defaults lists them (issue 34)."""
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "constants.py").write_text(
        "GRADIENT_CLIPPING_DEFAULT = 0.0\nFP16_LOSS_SCALE_DEFAULT = 0\nFP16_INITIAL_SCALE_POWER_DEFAULT = 12\n"
        "FP16_LOSS_SCALE_WINDOW_DEFAULT = 500\nFP16_HYSTERESIS_DEFAULT = 2\n"
        "FP16_CONSECUTIVE_HYSTERESIS_DEFAULT = False\n"
        "FP16_MIN_LOSS_SCALE_DEFAULT = 1\nBFLOAT16_ENABLED_DEFAULT = compute()\n")  # not a literal
    (tmp_path / "runtime" / "config.py").write_text('_REMOVED_TOP_LEVEL_CONFIG_KEYS = {"amp": f"{x} was removed"}\n')
    (tmp_path / "ops" / "lamb").mkdir(parents=True)
    (tmp_path / "ops" / "lamb" / "fused_lamb.py").write_text(
        "class FusedLamb:\n    def __init__(self, params, lr=2e-3, bias_correction=True, betas=[0.8, 0.99], eps=1e-8,\n"
        "                 weight_decay=0., max_coeff=5.0, min_coeff=0.01): pass\n")
    d = read_installed(tmp_path, "9.9.9")
    assert (d.gradient_clipping, d.fp16.initial_scale_power, d.lamb_default("lr"), d.lamb_default("betas")) == (
        0.0, 12, 2e-3, (0.8, 0.99))
    assert d.bf16_enabled == DOCUMENTED.bf16_enabled and d.fallback == ("bf16.enabled",)
    assert d.removed_top == ("amp",) and d.removed_zero == () and d.unread_refusals == ("zero_optimization",)
    s = read_ds_config({"train_batch_size": 4, "zero_optimization": {"stage": 0, "mics_shard_size": 8}}, defaults=d)
    assert s.defaults == ("DeepSpeed 9.9.9, and DeepSpeed 0.19.x's documented defaults for bf16.enabled (not found "
                          "in its sources); refusing no keys: the zero_optimization keys DeepSpeed 9.9.9 refuses were "
                          "not found in its runtime/config.py")
    assert s.gradient_clipping == 0.0 and "zero_optimization" in s.ignored  # mics_shard_size: not refused
    with pytest.raises(ConfigError, match="amp: is a key DeepSpeed 9.9.9 refuses"):
        read_ds_config({"train_batch_size": 4, "amp": {}}, defaults=d)
    (tmp_path / "ops" / "lamb" / "fused_lamb.py").unlink()
    assert read_installed(tmp_path, "9.9.9").fallback == ("bf16.enabled", *(f"Lamb's {k}" for k, _ in DOCUMENTED.lamb))


def test_bert_lamb_config_end_to_end(tmp_path):
    path = tmp_path / "bert_lamb.json"
    path.write_text(json.dumps(BING_BERT_LAMB, indent=2))
    s = read_ds_config(path, dp=64)  # 64 ranks x 64 sequences x 16 accumulation steps = 65536
    expected = dict(micro_batch=64, microbatches=16, clip_grad=1.0, precision="fp16", loss_scale=0.0,
                    initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1.0,
                    consecutive_hysteresis=False, optimizer="lamb", lr=11e-3, weight_decay=0.01, eps=1e-8,
                    betas=(0.9, 0.999), min_trust=0.01, max_trust=0.3, bias_correction=False, lamb_rule="deepspeed",
                    lr_schedule=WarmupDecayLR(total_num_steps=7038, warmup_num_steps=2000, warmup_max_lr=11e-3,
                                              warmup_type="linear"),
                    warmup_steps=2000, lr_decay="linear", min_lr=0.0)
    overrides, pending = s.train_config_overrides(), s.pending_overrides()
    assert {**overrides, **pending} == expected
    trainable = set(SECTION_OF)
    assert set(overrides) <= trainable and not set(pending) & trainable
    cfg = TrainConfig.of(**overrides)
    batch, optim = cfg.batch, cfg.optim
    assert (batch.micro_batch, batch.microbatches, optim.optimizer, optim.lr, cfg.numerics.precision) == (
        64, 16, "lamb", 11e-3, "fp16")
    assert s.ignored == ("prescale_gradients", "steps_per_print", "wall_clock_breakdown")
    assert s.scheduler(1) == 0.0 and s.scheduler(2002) == 11e-3 and s.scheduler(7040) == 0.0


def test_bert_lamb_config_agrees_with_deepspeeds_reader(deepspeed_config):
    """DeepSpeed accepts the same JSON (at its world size 1) and reads the same batch and fp16 values;
    it also tolerates mp_toolkit's pipeline extension keys."""
    config = {**BING_BERT_LAMB, "pipeline": {"stages": 2, "schedule": "1F1B", "chunks": 1}}
    theirs, ours = deepspeed_config(json.loads(json.dumps(config))), read_ds_config(config, dp=1)
    assert (theirs.train_batch_size, theirs.train_micro_batch_size_per_gpu, theirs.gradient_accumulation_steps) == (
        ours.train_batch_size, ours.train_micro_batch_size_per_gpu, ours.gradient_accumulation_steps) == (
        65536, 64, 1024)
    fp = theirs.float16_config
    assert FP16Settings(fp.enabled, fp.loss_scale, fp.initial_scale_power, fp.loss_scale_window, fp.hysteresis,
                        fp.min_loss_scale, fp.consecutive_hysteresis) == ours.fp16
    assert (theirs.optimizer_name, theirs.gradient_clipping, theirs.scheduler_name) == ("lamb", 1.0, "WarmupDecayLR")
    assert theirs.pipeline["schedule"] == "1F1B" and ours.schedule == "1f1b"


@pytest.mark.parametrize("scheduler", [
    {"type": "WarmupLR", "params": {"warmup_num_steps": 30}},  # warmup_max_lr: the optimizer's lr
    {"type": "WarmupDecayLR", "params": {"total_num_steps": 80, "warmup_num_steps": 10, "warmup_min_lr": 1e-4}},
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 60, "warmup_num_steps": 15, "warmup_type": "linear"}},
])
def test_schedule_read_from_json_matches_deepspeeds_engine(scheduler):
    """The engine builds ``scheduler(optimizer, **params)`` on the optimizer made from optimizer.params
    and steps it after every optimizer step; our schedule gives the same rate for every step."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    s = read(optimizer=LAMB, scheduler=scheduler)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LAMB["params"]["lr"])
    theirs = getattr(lr_schedules, scheduler["type"])(optimizer, **scheduler["params"])
    for step in range(1, 100):
        assert s.scheduler(step) == optimizer.param_groups[0]["lr"], step
        theirs.step()


def test_json_null_counts_as_absent():
    s = read(gradient_clipping=None, fp16=None, zero_optimization=None, torch_autocast=None,
             optimizer={"type": "Lamb", "params": {"max_coeff": None}})
    assert (s.gradient_clipping, s.fp16, s.optimizer.max_trust, s.ignored) == (1.0, FP16Settings(), 10.0, ())
