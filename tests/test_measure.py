"""`measure_layers`: per-micro-batch times inside rounds of accumulating micro-batches."""

import time

import pytest
import torch

from mp_toolkit.layers import LayerList
from mp_toolkit.partition.measure import measure_layers, one_f_one_b

FWD_S, BWD_S = 0.010, 0.020
SLACK_S = 0.015  # a sleep lasts at least its time, and a little more on a loaded machine


class _Sleep(torch.autograd.Function):
    """Identity whose forward takes FWD_S * k seconds and backward BWD_S * k."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        time.sleep(FWD_S * k)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(BWD_S * ctx.k)
        return g, None


class Timed(torch.nn.Module):
    """A layer of known cost: a scale (one weight) then a sleep of ``k`` units."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k
        self.w = torch.nn.Parameter(torch.ones(4))
        self.grads_seen: list[torch.Tensor] = []
        self.w.register_post_accumulate_grad_hook(lambda p: self.grads_seen.append(p.grad.clone()))

    def forward(self, x):
        return _Sleep.apply(x * self.w, self.k)


def test_one_f_one_b_order():
    assert one_f_one_b(1) == [("F", 0), ("B", 0)]
    assert one_f_one_b(3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]


@pytest.mark.parametrize("microbatches", [1, 3])
def test_times_are_per_microbatch_and_in_proportion(microbatches):
    layers = LayerList([("one", Timed(1)), ("three", Timed(3))])
    one, three = measure_layers(layers, torch.ones(2, 4), warmup=0, repeats=1, microbatches=microbatches)
    assert FWD_S <= one.forward_s < FWD_S + SLACK_S and BWD_S <= one.backward_s < BWD_S + SLACK_S
    assert 3 * FWD_S <= three.forward_s < 3 * FWD_S + SLACK_S and 3 * BWD_S <= three.backward_s < 3 * BWD_S + SLACK_S


def test_gradients_accumulate_within_a_round_and_are_dropped_after_it():
    layer = Timed(0)
    before = layer.w.detach().clone()
    measure_layers(LayerList([("t", layer)]), torch.full((2, 4), 2.0), warmup=1, repeats=2, microbatches=3)
    # d/dw sum(x * w) with x = 2 over 2 rows: 4 per micro-batch. One untimed pass counts the kept
    # bytes, then 3 rounds of 3 micro-batches: 4, 8, 12 each (accumulated in place, never zeroed
    # within a round), restarting from None after every round as the optimizer step's zero_grad does
    seen = [g[0].item() for g in layer.grads_seen]
    assert seen == [4.0] + [4.0, 8.0, 12.0] * 3
    assert layer.w.grad is None and torch.equal(layer.w.detach(), before)  # the model is left as it was


def test_last_layer_is_timed_with_its_loss():
    layers = LayerList([("a", Timed(1)), ("b", Timed(1))])
    loss = lambda y, labels: (y * labels).sum()  # noqa: E731
    _, last = measure_layers(layers, torch.ones(2, 4), loss, torch.ones(2, 4), warmup=0, repeats=1)
    assert last.activation_bytes > 0  # x * w keeps x for w's gradient: 2 x 4 fp32 = 32 bytes at least
    assert BWD_S <= last.backward_s < BWD_S + SLACK_S


def test_split_times_zbh1s_input_and_weight_passes():
    torch.manual_seed(0)
    embed, lin = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32)
    layers = LayerList([("embed", embed), ("lin", lin)])
    e, l = measure_layers(layers, torch.randint(0, 64, (4, 16)), warmup=0, repeats=1, split=True)
    # token ids need no gradient: the embedding's backward is all weight work, as on a first stage
    assert e.input_s < 1e-4 and e.weight_s > 0 and e.backward_s == pytest.approx(e.input_s + e.weight_s)
    assert l.input_s > 0 and l.weight_s > 0 and l.backward_s == pytest.approx(l.input_s + l.weight_s)
    # I records the gradient of the product's output for W: (4 x 16 tokens, 32 features) fp32
    assert l.recorded_bytes == 4 * 16 * 32 * 4 and e.recorded_bytes == 0
    plain = measure_layers(layers, torch.randint(0, 64, (4, 16)), warmup=0, repeats=1)
    assert plain[1].input_s == plain[1].weight_s == plain[1].recorded_bytes == 0  # not split: the whole backward


def test_split_puts_backward_work_on_the_path_to_the_input_into_i_once():
    # Timed: x * w, then a sleep in backward. The sleep lies between the root and the input, so
    # I runs it; W re-enters at x * w for w alone and does not sleep again
    (t,) = measure_layers(LayerList([("t", Timed(1))]), torch.ones(2, 4), warmup=0, repeats=1, split=True)
    assert BWD_S <= t.input_s < BWD_S + SLACK_S and t.weight_s < SLACK_S


class Logged(torch.nn.Module):
    """Records "F" at each forward and "B" at each backward."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.log: list[str] = []

    def forward(self, x):
        self.log.append("F")
        y = x * self.w
        y.register_hook(lambda g: self.log.append("B"))
        return y


@pytest.mark.parametrize("order, expected", [("1f1b", "FFBFBB"), ("gpipe", "FFFBBB")])
def test_rounds_run_in_the_schedules_order(order, expected):
    layer = Logged()
    measure_layers(LayerList([("t", layer)]), torch.ones(2, 4), warmup=0, repeats=1, microbatches=3, order=order)
    assert "".join(layer.log) == "FB" + expected  # one untimed pass counts the kept bytes first
    with pytest.raises(ValueError, match="order='zigzag'"):
        measure_layers(LayerList([("t", layer)]), torch.ones(2, 4), order="zigzag")
