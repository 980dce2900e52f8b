"""Learning-rate schedules: WarmupDecay's values, and DeepSpeed's WarmupLR / WarmupDecayLR /
WarmupCosineLR against DeepSpeed's own scheduler classes, step by step."""

import math
import os

import pytest
import torch

from mp_toolkit.optim.lr import WarmupCosineLR, WarmupDecay, WarmupDecayLR, WarmupLR, deepspeed_iteration


@pytest.fixture(scope="module")
def lr_schedules():
    """DeepSpeed's schedules. DeepSpeed picks its accelerator once, at import; the CPU one needs no
    GPU and no process group."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return pytest.importorskip("deepspeed.runtime.lr_schedules")


def _optimizer(lr: float = 0.01) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def deepspeed_step_lrs(scheduler_cls, steps: int, optimizer_lr: float = 0.01, **params) -> list[float]:
    """The rate of optimizer steps 1..steps as DeepSpeed's engine runs them: the scheduler is built
    before step 1 and ``scheduler.step()`` follows every optimizer step (engine._take_model_step)."""
    optimizer = _optimizer(optimizer_lr)
    scheduler = scheduler_cls(optimizer, **params)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])  # what this optimizer step uses
        scheduler.step()
    return lrs


def ours(schedule, steps: int) -> list[float]:
    return [schedule(k) for k in range(1, steps + 1)]


# -- WarmupDecay (the CLI's schedule) keeps its values ------------------------------------------------

def test_warmup_decay_linear_warmup_then_constant():
    s = WarmupDecay(lr=0.4, total_steps=10, warmup_steps=4)
    assert ours(s, 6) == [0.1, 0.2, 0.30000000000000004, 0.4, 0.4, 0.4]


def test_warmup_decay_linear_and_cosine_decay_to_min_lr():
    lin = WarmupDecay(lr=1.0, total_steps=6, warmup_steps=2, decay="linear", min_lr=0.2)
    assert ours(lin, 6) == pytest.approx([0.5, 1.0, 0.8, 0.6, 0.4, 0.2], abs=1e-15)
    cos = WarmupDecay(lr=1.0, total_steps=4, warmup_steps=0, decay="cosine")
    assert ours(cos, 4) == pytest.approx([0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(1, 5)], abs=1e-15)


# -- DeepSpeed's schedules, against DeepSpeed ---------------------------------------------------------

@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("warmup_num_steps,warmup_min_lr", [(1, 0.0), (2, 0.0), (7, 0.001), (100, 0.0)])
def test_warmup_lr_matches_deepspeed(lr_schedules, warmup_type, warmup_num_steps, warmup_min_lr):
    params = dict(warmup_min_lr=warmup_min_lr, warmup_max_lr=0.02, warmup_num_steps=warmup_num_steps,
                  warmup_type=warmup_type)
    n = warmup_num_steps + 30
    assert ours(WarmupLR(**params), n) == deepspeed_step_lrs(lr_schedules.WarmupLR, n, **params)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("warmup_num_steps,total_num_steps,warmup_min_lr",
                         [(10, 50, 0.0), (1, 20, 0.0), (5, 5, 0.0), (20, 8, 0.0), (10, 60, 0.003)])
def test_warmup_decay_lr_matches_deepspeed(lr_schedules, warmup_type, warmup_num_steps, total_num_steps,
                                           warmup_min_lr):
    params = dict(total_num_steps=total_num_steps, warmup_min_lr=warmup_min_lr, warmup_max_lr=0.011,
                  warmup_num_steps=warmup_num_steps, warmup_type=warmup_type)
    n = max(warmup_num_steps, total_num_steps) + 15  # past the end: stays at warmup_min_lr
    assert ours(WarmupDecayLR(**params), n) == deepspeed_step_lrs(lr_schedules.WarmupDecayLR, n, **params)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("warmup_num_steps,total_num_steps,warmup_min_ratio,cos_min_ratio",
                         [(10, 50, 0.0, 0.0001), (1, 30, 0.0, 0.0), (8, 40, 0.1, 0.05), (20, 10, 0.2, 0.1)])
def test_warmup_cosine_lr_matches_deepspeed(lr_schedules, warmup_type, warmup_num_steps, total_num_steps,
                                            warmup_min_ratio, cos_min_ratio):
    params = dict(total_num_steps=total_num_steps, warmup_min_ratio=warmup_min_ratio,
                  warmup_num_steps=warmup_num_steps, cos_min_ratio=cos_min_ratio, warmup_type=warmup_type)
    n = max(warmup_num_steps, total_num_steps) + 15
    expected = deepspeed_step_lrs(lr_schedules.WarmupCosineLR, n, optimizer_lr=0.003, **params)
    assert ours(WarmupCosineLR(lr=0.003, **params), n) == expected


def test_at_iteration_is_deepspeeds_lr_at_that_last_batch_iteration(lr_schedules):
    """Direct index mapping: our at_iteration(i) is DeepSpeed's lr after scheduler.step(i)."""
    ds_params = dict(total_num_steps=40, warmup_num_steps=9, warmup_type="log")
    cases = [(WarmupDecayLR(warmup_max_lr=0.02, **ds_params), lr_schedules.WarmupDecayLR(
                 _optimizer(), warmup_max_lr=0.02, **ds_params)),
             (WarmupCosineLR(lr=0.01, **ds_params), lr_schedules.WarmupCosineLR(_optimizer(0.01), **ds_params))]
    for schedule, scheduler in cases:
        for i in range(0, 50):
            scheduler.step(i)
            assert schedule.at_iteration(i) == scheduler.get_last_lr()[0]


def test_step_to_iteration_mapping_and_first_steps():
    assert [deepspeed_iteration(k) for k in (1, 2, 3, 10)] == [-1, 0, 1, 8]
    # Steps 1 and 2 both run at warmup_min_lr (iterations -1 and 0); the cosine one starts at 0.
    warm = WarmupLR(warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=10)
    assert (warm(1), warm(2)) == (0.001, 0.001)
    assert warm(3) == 0.001 + (0.01 - 0.001) * ((1 / math.log(10)) * math.log(2))
    assert warm(11) < warm(12) == warm(13) == 0.001 + (0.01 - 0.001)  # iteration 10 ends warm-up
    assert WarmupCosineLR(lr=0.01, total_num_steps=10, warmup_min_ratio=0.5)(1) == 0.0
    assert WarmupCosineLR(lr=0.01, total_num_steps=10, warmup_min_ratio=0.5)(2) == 0.005
    with pytest.raises(ValueError, match="step 0 must be an integer >= 1"):
        warm(0)


def test_warmup_decay_lr_reaches_zero_at_total_num_steps():
    s = WarmupDecayLR(warmup_max_lr=1.0, warmup_num_steps=4, total_num_steps=8, warmup_type="linear")
    # iterations -1..9: warm-up 0, 0, .25, .5, .75; decay (8 - i) / 4 from i = 4.
    assert ours(s, 11) == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]


@pytest.mark.parametrize("make,message", [
    (lambda: WarmupLR(warmup_max_lr=0.1, warmup_type="cosine"), "warmup_type 'cosine' must be one of log, linear"),
    (lambda: WarmupLR(warmup_max_lr=0.1, warmup_num_steps=0), "warmup_num_steps 0 must be a positive integer"),
    (lambda: WarmupLR(warmup_max_lr=-0.1), "warmup_max_lr -0.1 must be a non-negative finite number"),
    (lambda: WarmupDecayLR(total_num_steps=0), "total_num_steps 0 must be a positive integer"),
    (lambda: WarmupCosineLR(lr=0.1, total_num_steps=10, cos_min_ratio=math.nan), "cos_min_ratio nan"),
])
def test_invalid_schedules_raise(make, message):
    with pytest.raises(ValueError, match=message):
        make()
