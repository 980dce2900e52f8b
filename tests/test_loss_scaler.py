"""The fp16 loss-scaler state machine (DeepSpeed's semantics) and the overflow test."""

import math
import random

import pytest
import torch

from mp_toolkit.optim.clip import has_inf_or_nan, tensor_norms
from mp_toolkit.optim.loss_scaler import DynamicLossScaler


def scales_after(scaler, overflows):
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


def test_hysteresis_two_keeps_the_scale_on_the_first_overflow_and_halves_on_the_second():
    s = DynamicLossScaler(initial_scale_power=16, hysteresis=2)
    assert s.scale == 2.0 ** 16
    assert scales_after(s, [True, True, True]) == [2.0 ** 16, 2.0 ** 15, 2.0 ** 14]


def test_growth_after_exactly_loss_scale_window_clean_steps_from_the_start_and_after_overflow():
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=4, hysteresis=1)
    assert scales_after(s, [False] * 3) == [16.0] * 3
    assert scales_after(s, [False]) == [32.0]                      # the 4th clean step doubles
    assert scales_after(s, [False] * 4) == [32.0] * 3 + [64.0]     # and every 4 clean steps after
    assert scales_after(s, [True]) == [32.0]
    assert scales_after(s, [False] * 4) == [32.0] * 3 + [64.0]     # 4 clean steps after the overflow


def test_an_overflow_absorbed_by_hysteresis_restarts_the_window_and_growth_refills_hysteresis():
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    assert scales_after(s, [False, True, False, False]) == [16.0] * 4  # absorbed; window restarted
    assert scales_after(s, [False]) == [32.0]                          # 3rd clean step since it
    assert s.cur_hysteresis == 2
    assert scales_after(s, [True, True]) == [32.0, 16.0]               # refilled: one absorbed again


def test_min_loss_scale_is_a_floor_and_never_raises():
    s = DynamicLossScaler(initial_scale_power=3, hysteresis=1, min_loss_scale=2.0)
    assert scales_after(s, [True] * 4) == [4.0, 2.0, 2.0, 2.0]


def test_consecutive_hysteresis_refills_on_every_clean_step():
    plain = DynamicLossScaler(initial_scale_power=8, hysteresis=2)
    refill = DynamicLossScaler(initial_scale_power=8, hysteresis=2, consecutive_hysteresis=True)
    pattern = [True, False, True, False, True]
    assert scales_after(plain, pattern) == [256.0, 256.0, 128.0, 128.0, 64.0]
    assert scales_after(refill, pattern) == [256.0] * 5


def test_static_scale_never_changes():
    s = DynamicLossScaler(static_scale=128.0, loss_scale_window=2, hysteresis=1)
    assert not s.dynamic
    assert scales_after(s, [True, True, False, False, False, False, True]) == [128.0] * 7
    assert DynamicLossScaler(static_scale=0).dynamic  # DeepSpeed: loss_scale 0 means dynamic


def deepspeed_reference(overflows, init_scale, window, min_scale, delayed_shift, consecutive):
    """DeepSpeed's DynamicLossScaler.update_scale (the original growth formula), transcribed."""
    cur_scale, cur_iter, last_overflow_iter, cur_hysteresis = init_scale, 0, -1, delayed_shift
    out = []
    for overflow in overflows:
        if overflow:
            if delayed_shift == 1 or cur_hysteresis == 1:
                cur_scale = max(cur_scale / 2.0, min_scale)
            else:
                cur_hysteresis -= 1
            last_overflow_iter = cur_iter
        else:
            if consecutive:
                cur_hysteresis = delayed_shift
            if (cur_iter - last_overflow_iter) % window == 0:
                if not consecutive:
                    cur_hysteresis = delayed_shift
                cur_scale *= 2.0
        cur_iter += 1
        out.append(cur_scale)
    return out


@pytest.mark.parametrize("window,hysteresis,consecutive", [(1, 1, False), (3, 2, False), (5, 3, True), (2, 2, True)])
def test_matches_deepspeed_on_random_overflow_sequences(window, hysteresis, consecutive):
    rng = random.Random(window * 10 + hysteresis)
    overflows = [rng.random() < 0.3 for _ in range(300)]
    s = DynamicLossScaler(initial_scale_power=10, loss_scale_window=window, hysteresis=hysteresis,
                          min_loss_scale=1.0, consecutive_hysteresis=consecutive)
    assert scales_after(s, overflows) == deepspeed_reference(overflows, 2.0 ** 10, window, 1.0, hysteresis,
                                                             consecutive)


def test_state_dict_round_trip_continues_identically():
    rng = random.Random(7)
    overflows = [rng.random() < 0.3 for _ in range(60)]
    a = DynamicLossScaler(initial_scale_power=6, loss_scale_window=4, hysteresis=2)
    scales_after(a, overflows[:30])
    b = DynamicLossScaler(initial_scale_power=6, loss_scale_window=4, hysteresis=2)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert scales_after(b, overflows[30:]) == scales_after(a, overflows[30:])
    with pytest.raises(ValueError, match="missing keys"):
        b.load_state_dict({"cur_scale": 1.0})


@pytest.mark.parametrize("kwargs,match", [
    (dict(loss_scale_window=0), r"loss_scale_window must be an integer >= 1, got 0"),
    (dict(hysteresis=0), r"hysteresis must be an integer >= 1, got 0"),
    (dict(min_loss_scale=0.0), r"min_loss_scale must be a finite number > 0, got 0.0"),
    (dict(static_scale=-1.0), r"static_scale must be a finite number >= 0 .* got -1.0"),
    (dict(initial_scale_power=16.5), r"initial_scale_power must be an integer"),
])
def test_rejects_bad_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler(**kwargs)


def test_has_inf_or_nan():
    finite = [torch.randn(100), torch.full((3, 3), 1e30), torch.randn(5).half(), torch.empty(0)]
    assert has_inf_or_nan(finite) is False            # 1e30 is large, not an overflow
    assert has_inf_or_nan([]) is False and has_inf_or_nan([None]) is False
    for bad in (math.inf, -math.inf, math.nan):
        t = torch.randn(70000)
        t[65432] = bad
        assert has_inf_or_nan(finite + [t]) is True, bad
    half = torch.ones(8, dtype=torch.float16)
    half[3] = 70000.0                                  # overflows fp16 to inf
    assert has_inf_or_nan([None, half]) is True


def test_has_inf_or_nan_reads_the_norms_it_is_given():
    """The step hands over the 2-norms it takes for clipping: one pass over the gradients."""
    ts = [torch.randn(100), torch.full((3, 3), 1e30), torch.randn(7, 5)]
    norms = tensor_norms(ts)
    assert torch.isinf(norms[1]) and torch.isfinite(norms[[0, 2]]).all()  # 1e30 squared overflows fp32
    assert has_inf_or_nan(ts, norms) is False  # ... so that tensor is scanned element by element
    assert has_inf_or_nan(ts, torch.tensor([1.0, 2.0, math.nan])) is False  # a nan norm alone is rechecked
    ts[2][4, 4] = math.nan
    assert has_inf_or_nan(ts, tensor_norms(ts)) is True
    with pytest.raises(ValueError, match="2 norms for 3 tensors"):
        has_inf_or_nan(ts, norms[:2])
