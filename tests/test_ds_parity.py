"""DeepSpeed's semantics where a DeepSpeed config claims them (issue 20): the same JSON read by
DeepSpeed's own ``DeepSpeedConfig`` and by ours gives the same value for every setting we map, over
configs shaped like public ones (written here, none copied); the keys DeepSpeed refuses are refused;
the defaults come from the installed DeepSpeed; and ``"type": "Lamb"`` steps as FusedLamb's kernel
does, 1-D tensors included, against its formula written out here independently.

FusedLamb's rule, read from DeepSpeed's ``csrc/lamb/fused_lamb_cuda_kernel.cu`` (it runs on CUDA
only, so the formula is the reference): per tensor, with uncorrected moments ``m``, ``v``::

    u = m / (sqrt(v) + eps) + wd w
    coeff = 1 if ||w|| == 0 or ||u|| == 0 else min(max(||w|| / ||u||, min_coeff), max_coeff)
    w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * coeff * u        (lr alone without bias_correction)
"""

import dataclasses
import inspect
import json
import math
import os

import pytest
import torch

from mp_toolkit.ds.config import read_ds_config
from mp_toolkit.ds.defaults import DOCUMENTED, deepspeed_defaults, read_installed
from mp_toolkit.engine.reductions import trust_ratio_rows
from mp_toolkit.optim.factory import build_optimizer
from mp_toolkit.optim.settings import Optim
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.run.config import ConfigError
from tests.cli_helpers import assert_one_line_exit_2

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator once, at import
deepspeed = pytest.importorskip("deepspeed")
from deepspeed.ops.adam import FusedAdam  # noqa: E402
from deepspeed.ops.lamb import FusedLamb  # noqa: E402
from deepspeed.runtime import config as ds_config  # noqa: E402
from deepspeed.runtime import constants as ds_constants  # noqa: E402
from deepspeed.runtime import lr_schedules  # noqa: E402

# Shaped like the public configs (our own values and combinations): DeepSpeedExamples' bing_bert
# LAMB configs (64k batch at sequence 128, 32k at 512), its pipeline-parallel example, a
# Megatron-DeepSpeed GPT pretraining config, a BigScience-style bf16 config, and two small ones that
# leave most keys out.
CONFIGS = {
    "bert_lamb_seq128": {
        "train_batch_size": 4096, "train_micro_batch_size_per_gpu": 32, "steps_per_print": 100,
        "prescale_gradients": False, "gradient_clipping": 1.0, "wall_clock_breakdown": False,
        "optimizer": {"type": "Lamb", "params": {"lr": 6e-3, "weight_decay": 0.01, "bias_correction": False,
                                                 "max_coeff": 0.3, "min_coeff": 0.01}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
    },
    "bert_lamb_seq512_no_clip_key": {
        "train_batch_size": 2048, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 50,
        "optimizer": {"type": "Lamb", "params": {"lr": 2e-3, "weight_decay": 0.01, "max_coeff": 0.5}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1500, "warmup_num_steps": 200,
                                                          "warmup_max_lr": 2e-3, "warmup_type": "linear"}},
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "min_loss_scale": 2},
    },
    "pipeline_example": {
        "train_batch_size": 128, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8}},
        "pipeline": {"stages": 2, "partition_method": "parameters", "activation_checkpoint_interval": 0},
    },
    "megatron_gpt": {
        "train_batch_size": 512, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
        "steps_per_print": 1, "wall_clock_breakdown": True, "zero_optimization": {"stage": 0},
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                 "min_loss_scale": 1, "initial_scale_power": 12},
        "optimizer": {"type": "AdamW", "params": {"lr": 1.5e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 3000, "warmup_num_steps": 300,
                                                           "cos_min_ratio": 0.1}},
    },
    "bigscience_bf16": {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 16, "gradient_clipping": 1.0,
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}, "steps_per_print": 2000,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "Adam", "params": {"lr": 6e-5, "betas": [0.9, 0.95], "eps": 1e-8,
                                                 "weight_decay": 0.1, "adam_w_mode": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 6e-5,
                                                     "warmup_num_steps": 100}},
    },
    "lamb_defaults": {"train_batch_size": 16, "optimizer": {"type": "Lamb"}},
    "batch_only": {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5},
}


def deepspeeds_view(c) -> dict:
    """Every setting we map, as DeepSpeed's reader (and, for the optimizer, the constructor its
    engine calls with ``optimizer.params``) resolves it."""
    fp = c.float16_config
    out = dict(batch=(c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps),
               gradient_clipping=c.gradient_clipping,
               precision="fp16" if fp.enabled else "bf16" if c.bfloat16_config.enabled else "fp32",
               fp16=(fp.enabled, fp.loss_scale, fp.initial_scale_power, fp.loss_scale_window, fp.hysteresis,
                     fp.min_loss_scale, fp.consecutive_hysteresis))
    if c.optimizer_name is not None:
        cls = FusedLamb if c.optimizer_name == "lamb" else FusedAdam
        params = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                  if p.default is not inspect.Parameter.empty}
        params.update(c.optimizer_params or {})
        name = c.optimizer_name
        if name in ("adam", "adamw"):  # the engine: AdamW unless adam_w_mode is false (Adam type only)
            name = "adamw" if name == "adamw" or params.get("adam_w_mode", True) else "adam"
        out["optimizer"] = dict(name=name, lr=params["lr"], weight_decay=params["weight_decay"], eps=params["eps"],
                                betas=tuple(params["betas"]))
        if name == "lamb":
            out["optimizer"].update(min_trust=params["min_coeff"], max_trust=params["max_coeff"],
                                    bias_correction=params["bias_correction"])
    if c.scheduler_name is not None:
        out["scheduler"] = (c.scheduler_name, c.scheduler_params)
    if c.pipeline.get("stages") not in (None, "auto") and "pipeline" in c._param_dict:
        out["pipeline"] = (c.pipeline["stages"], c.pipeline["partition_method"].lower())
    return out


def our_view(s) -> dict:
    out = dict(batch=(s.train_batch_size, s.train_micro_batch_size_per_gpu, s.gradient_accumulation_steps),
               gradient_clipping=s.gradient_clipping, precision=s.precision,
               fp16=dataclasses.astuple(s.fp16))
    if s.optimizer is not None:
        o = s.optimizer
        out["optimizer"] = dict(name=o.name, lr=o.lr, weight_decay=o.weight_decay, eps=o.eps, betas=o.betas)
        if o.name == "lamb":
            out["optimizer"].update(min_trust=o.min_trust, max_trust=o.max_trust, bias_correction=o.bias_correction)
    if s.scheduler is not None:
        out["scheduler"] = (type(s.scheduler).__name__, None)
    if s.pp is not None:
        out["pipeline"] = (s.pp, s.partition)
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_mapped_setting_agrees_with_deepspeeds_reader(tmp_path, name):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(CONFIGS[name], indent=2))
    theirs, ours = ds_config.DeepSpeedConfig(str(path)), read_ds_config(path, dp=1)
    want, got = deepspeeds_view(theirs), our_view(ours)
    if "scheduler" in want:  # the schedule itself: DeepSpeed's class on its optimizer, step by step
        kind, params = want.pop("scheduler")
        assert got.pop("scheduler")[0] == kind
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=want["optimizer"]["lr"])
        schedule = getattr(lr_schedules, kind)(optimizer, **params)
        for step in range(1, 400):
            assert ours.scheduler(step) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-15), step
            schedule.step()
    assert got == want
    if want.get("optimizer", {}).get("name") == "lamb":
        assert ours.train_config_overrides()["lamb_rule"] == "deepspeed"


def test_absent_gradient_clipping_is_deepspeeds_default():
    """The point of issue 20's first finding: DeepSpeed >= 0.19.3 clips at 1.0 when the key is absent."""
    config = CONFIGS["bert_lamb_seq512_no_clip_key"]
    assert "gradient_clipping" not in config
    assert read_ds_config(config).gradient_clipping == ds_config.DeepSpeedConfig(dict(config)).gradient_clipping
    assert read_ds_config(config).train_config_overrides()["clip_grad"] == ds_constants.GRADIENT_CLIPPING_DEFAULT


def test_defaults_are_read_from_the_installed_deepspeed():
    d = deepspeed_defaults()
    assert d.installed and d.version == deepspeed.__version__ and d.source == f"DeepSpeed {deepspeed.__version__}"
    assert d.gradient_clipping == ds_constants.GRADIENT_CLIPPING_DEFAULT
    f = d.fp16
    assert (f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.consecutive_hysteresis,
            f.min_loss_scale, d.bf16_enabled) == (
        ds_constants.FP16_LOSS_SCALE_DEFAULT, ds_constants.FP16_INITIAL_SCALE_POWER_DEFAULT,
        ds_constants.FP16_LOSS_SCALE_WINDOW_DEFAULT, ds_constants.FP16_HYSTERESIS_DEFAULT,
        ds_constants.FP16_CONSECUTIVE_HYSTERESIS_DEFAULT, ds_constants.FP16_MIN_LOSS_SCALE_DEFAULT,
        ds_constants.BFLOAT16_ENABLED_DEFAULT)
    signature = inspect.signature(FusedLamb.__init__).parameters
    assert all(signature[k].default == v for k, v in d.lamb)
    assert d.removed_top == tuple(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    assert d.removed_zero == tuple(ds_config._REMOVED_ZERO_CONFIG_KEYS)


def test_documented_defaults_are_0_19s_and_a_package_without_the_files_keeps_them(tmp_path):
    """Without DeepSpeed the reader uses 0.19.x's documented values; they are the installed 0.19's."""
    if deepspeed.__version__.startswith("0.19."):
        installed = deepspeed_defaults()
        assert dataclasses.replace(installed, version="0.19.x", installed=False) == DOCUMENTED
    bare = read_installed(tmp_path, "9.9.9")  # a package whose sources cannot be read: the fallback is named
    assert bare.source == ("DeepSpeed 0.19.x (its documented defaults: none could be read from the installed "
                           "DeepSpeed 9.9.9's sources); refusing no keys: the top-level and zero_optimization keys "
                           "DeepSpeed 9.9.9 refuses were not found in its runtime/config.py")
    assert bare.gradient_clipping == DOCUMENTED.gradient_clipping and bare.removed_top == bare.removed_zero == ()
    assert DOCUMENTED.source == "DeepSpeed 0.19.x (its documented defaults: deepspeed is not installed)"
    s = read_ds_config({"train_batch_size": 4}, defaults=DOCUMENTED)
    assert s.gradient_clipping == 1.0 and s.defaults == DOCUMENTED.source


@pytest.mark.parametrize("keys", [
    {"sparse_attention": {"mode": "fixed", "block": 16}},
    {"amp": {"enabled": True}},
    {"elasticity": {"enabled": False}, "progressive_layer_drop": {"enabled": False}},
    {"curriculum_learning": {"enabled": False}},
    {"zero_optimization": {"stage": 0, "mics_shard_size": 8}},
])
def test_keys_deepspeed_refuses_are_refused_in_one_line_naming_them(keys):
    config = {"train_batch_size": 8, **keys}
    with pytest.raises(ds_config.DeepSpeedConfigError):
        ds_config.DeepSpeedConfig(json.loads(json.dumps(config)))
    with pytest.raises(ConfigError) as e:
        read_ds_config(config)
    line = str(e.value)
    assert "\n" not in line and f"DeepSpeed {deepspeed.__version__} refuses" in line
    for k in keys:
        if k != "zero_optimization":
            assert k in line
    if "zero_optimization" in keys:
        assert "zero_optimization.mics_shard_size" in line


def test_lamb_with_a_static_loss_scale_is_refused_as_deepspeeds_engine_does():
    config = {"train_batch_size": 8, "optimizer": {"type": "Lamb"}, "fp16": {"enabled": True, "loss_scale": 128}}
    with pytest.raises(ConfigError, match="Lamb requires dynamic loss scaling: set fp16.loss_scale to 0"):
        read_ds_config(config)


def test_mpt_train_refuses_a_removed_key_with_exit_2(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**CONFIGS["batch_only"], "sparse_attention": {"mode": "fixed"}}))
    assert_one_line_exit_2(capsys, ["train", "--config", path, "--model", "gpt-tiny", "--seq-len", "16"],
                           "sparse_attention: is a key DeepSpeed")


@pytest.mark.parametrize("argv, mentions", [
    (["simulate", "--schedule", "interleaved", "--pp", "8", "--microbatches", "4", "--chunks", "2"],
     "interleaved 1F1B needs --microbatches a multiple of --pp (got m=4, p=8)"),
    (["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--chunks", "2"],
     "--chunks 2 applies only to Interleaved1F1B"),
    (["plan", "--model", "gpt-tiny", "--seq-len", "16", "--schedule", "interleaved", "--pp", "2",
      "--microbatches", "3", "--chunks", "2"], "--schedule interleaved needs --microbatches a multiple of --pp 2"),
    (["train", "--model", "gpt-tiny", "--seq-len", "16", "--schedule", "interleaved", "--pp", "2",
      "--microbatches", "3", "--chunks", "2"], "interleaved 1F1B needs --microbatches a multiple of --pp"),
    (["train", "--model", "gpt-tiny", "--seq-len", "16", "--schedule", "interleaved", "--pp", "2", "--chunks", "0"],
     "--chunks 0 must be at least 1"),
])
def test_schedule_arguments_are_one_line_errors_in_every_cli(capsys, argv, mentions):
    """Issue 20, finding 7: mpt simulate printed a traceback where mpt plan and mpt train said one line."""
    assert_one_line_exit_2(capsys, argv, mentions)


# -- one LAMB step, FusedLamb's formula ---------------------------------------------------------------

def fused_lamb_reference(weights, grads, *, lr, betas, eps, weight_decay, bias_correction, min_coeff, max_coeff):
    """FusedLamb's update (module docstring), per tensor, in fp64, for several steps; returns
    the weights and the last step's coefficients. ``weight_decay[i]`` is tensor i's group decay."""
    ws = [w.double().clone() for w in weights]
    ms, vs = [torch.zeros_like(w) for w in ws], [torch.zeros_like(w) for w in ws]
    b1, b2 = betas
    coeffs = []
    for t, step_grads in enumerate(grads, start=1):
        coeffs = []
        step_size = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) if bias_correction else lr
        for i, g in enumerate(step_grads):
            g = g.double()
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            update = ms[i] / (vs[i].sqrt() + eps) + weight_decay[i] * ws[i]
            w_norm, u_norm = float(ws[i].norm()), float(update.norm())
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, min_coeff), max_coeff)
            ws[i] = ws[i] - step_size * coeff * update
            coeffs.append(coeff)
    return ws, coeffs


class Tiny(torch.nn.Module):
    """A matrix with a bias, a LayerNorm (1-D weight and bias) and a zero-initialised bias."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 12)
        self.norm = torch.nn.LayerNorm(12)
        self.out = torch.nn.Linear(12, 4)
        torch.nn.init.zeros_(self.out.bias)


@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_rule_deepspeed_steps_as_fused_lamb_on_every_tensor(bias_correction):
    """Three steps on a model with 1-D parameters: the LayerNorm weight (all ones: ||w||/||u|| ~ 1
    is clamped to max_coeff 0.3, as in the bing_bert config) and biases follow FusedLamb too."""
    torch.manual_seed(0)
    model = Tiny()
    named = list(model.named_parameters())
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, bias_correction=bias_correction, min_coeff=0.01, max_coeff=0.3)
    decay = 0.01  # biases and norm weights are left out of decay (bing_bert's no_decay groups), not of the clamp
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=gen) * (0.1 if p.dim() == 1 else 1.0) for _, p in named]
             for _ in range(3)]
    grads[0][-1].zero_()  # a zero gradient on the zero bias: both norms 0 on step 1 -> coefficient 1
    init = [p.detach().clone() for _, p in named]
    opt = build_optimizer(Optim(
        "lamb", lr=hp["lr"], weight_decay=decay, betas=hp["betas"], eps=hp["eps"], min_trust=hp["min_coeff"],
        max_trust=hp["max_coeff"], bias_correction=bias_correction, lamb_rule="deepspeed"), named)
    for step_grads in grads:
        for (_, p), g in zip(named, step_grads):
            p.grad = g.clone()
        opt.step()
    wd = [0.0 if p.dim() <= 1 else decay for _, p in named]
    want, coeffs = fused_lamb_reference(init, grads, weight_decay=wd, **hp)
    for (name, p), w in zip(named, want):
        torch.testing.assert_close(p.detach().double(), w, rtol=1e-6, atol=1e-6 * float(w.abs().max()) + 1e-12,
                                   msg=name)
    ratios = opt.last_trust_ratios()
    assert [ratios[p] for _, p in named] == pytest.approx(coeffs, rel=1e-6)
    assert ratios[model.norm.weight] == 0.3  # clamped: mp_toolkit's rule would use 1.0 here
    # the metrics' trust-ratio row names the rule and covers every tensor, the 1-D ones included
    row, = trust_ratio_rows(opt, ParallelContext())
    assert (row["rule"], row["tensors"]) == ("deepspeed", len(named))
    assert row["min"] == pytest.approx(min(coeffs), rel=1e-6) and row["max"] == pytest.approx(max(coeffs), rel=1e-6)


def test_lamb_rule_mp_toolkit_keeps_its_exclusions_and_says_so():
    torch.manual_seed(0)
    model = Tiny()
    named = list(model.named_parameters())
    opt = build_optimizer(Optim("lamb", lr=1e-2, weight_decay=0.01, max_trust=0.3), named)
    for _, p in named:
        p.grad = torch.randn_like(p)
    opt.step()
    ratios = opt.last_trust_ratios()
    assert ratios[model.norm.weight] == 1.0 and ratios[model.fc.bias] == 1.0  # not adapted
    row, = trust_ratio_rows(opt, ParallelContext())
    assert (row["rule"], row["tensors"]) == ("mp_toolkit", 2)  # the two matrices only


def test_lamb_rule_is_for_lamb_only():
    with pytest.raises(ValueError, match="--lamb-rule deepspeed applies to --optimizer lamb only"):
        build_optimizer(Optim("adamw", lr=1e-3, lamb_rule="deepspeed"), list(Tiny().named_parameters()))
