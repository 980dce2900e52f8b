"""`measure_layers`: per-micro-batch times inside rounds of accumulating micro-batches."""

import pytest
import torch
import torch.nn.functional as F

from mp_toolkit.layers import LayerList
from mp_toolkit.partition import measure
from mp_toolkit.partition.measure import measure_layers, one_f_one_b

FWD, BWD = 1.0, 2.0  # a layer's forward and backward cost per unit of work, in clock seconds


class Clock:
    """The clock `measure` reads, made virtual: it moves only when a `_Work` runs, by the work's
    cost, and stands still during real computation. A timing is then the work that fell inside
    its window, exactly (whole numbers, no rounding), whatever the machine's load; a window that
    missed a layer's work, or caught another's, is off by a whole unit. No test asserts a duration."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(measure, "time", clock)  # measure's `time.perf_counter()` only
    return clock


class _Work(torch.autograd.Function):
    """Identity whose forward advances the clock by FWD * k and whose backward by BWD * k."""

    @staticmethod
    def forward(ctx, x, k, clock):
        ctx.k, ctx.clock = k, clock
        clock.advance(FWD * k)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.clock.advance(BWD * ctx.k)
        return g, None, None


class Timed(torch.nn.Module):
    """A layer of known cost: a scale (one weight) then ``k`` units of work."""

    def __init__(self, k: int, clock: Clock | None = None):
        super().__init__()
        self.k, self.clock = k, clock or Clock()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.grads_seen: list[torch.Tensor] = []
        self.w.register_post_accumulate_grad_hook(lambda p: self.grads_seen.append(p.grad.clone()))

    def forward(self, x):
        return _Work.apply(x * self.w, self.k, self.clock)


def test_one_f_one_b_order():
    assert one_f_one_b(1) == [("F", 0), ("B", 0)]
    assert one_f_one_b(3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]


@pytest.mark.parametrize("microbatches", [1, 3])
def test_times_are_per_microbatch_and_in_proportion(clock, microbatches):
    # Bounds the windows: each layer's forward (backward) window holds its own work of every
    # micro-batch of a round and nothing else (not the other layer's, not the untimed pass that
    # counts kept bytes), and the round's total is divided by the micro-batch count.
    layers = LayerList([("one", Timed(1, clock)), ("three", Timed(3, clock))])
    one, three = measure_layers(layers, torch.ones(2, 4), warmup=0, repeats=1, microbatches=microbatches)
    assert (one.name, one.forward_s, one.backward_s) == ("one", FWD, BWD)
    assert (three.name, three.forward_s, three.backward_s) == ("three", 3 * FWD, 3 * BWD)


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


def test_last_layer_is_timed_with_its_loss(clock):
    # Bounds where the loss's cost lands: 4 units of work in the loss show up in the last layer's
    # forward and backward (1 + 4 units), and in no other layer's.
    layers = LayerList([("a", Timed(1, clock)), ("b", Timed(1, clock))])
    loss = lambda y, labels: (_Work.apply(y, 4, clock) * labels).sum()  # noqa: E731
    first, last = measure_layers(layers, torch.ones(2, 4), loss, torch.ones(2, 4), warmup=0, repeats=1)
    assert (first.forward_s, first.backward_s) == (FWD, BWD)
    assert (last.forward_s, last.backward_s) == (5 * FWD, 5 * BWD)
    assert last.activation_bytes > 0  # x * w keeps x for w's gradient: 2 x 4 fp32 = 32 bytes at least


class WorkedEmbedding(torch.nn.Module):
    """An embedding, then ``k`` units of work on its output: backward work all on the weight's path."""

    def __init__(self, k: int, clock: Clock):
        super().__init__()
        self.embed, self.k, self.clock = torch.nn.Embedding(64, 32), k, clock

    def forward(self, ids):
        return _Work.apply(self.embed(ids), self.k, self.clock)


class WorkedLinear(torch.nn.Module):
    """A linear layer whose input passes through ``k_in`` units of work and its weight through
    ``k_w``: backward work on the input's path only (ZB-H1's I) and on the weight's only (W)."""

    def __init__(self, k_in: int, k_w: int, clock: Clock):
        super().__init__()
        self.lin, self.k_in, self.k_w, self.clock = torch.nn.Linear(32, 32), k_in, k_w, clock

    def forward(self, x):
        return F.linear(_Work.apply(x, self.k_in, self.clock), _Work.apply(self.lin.weight, self.k_w, self.clock),
                        self.lin.bias)


def test_split_times_zbh1s_input_and_weight_passes(clock):
    # Bounds which pass each backward's work is timed in: I holds exactly the work on the paths to
    # the layer's inputs, W exactly the work on the paths to its weights, and I + W is the backward.
    torch.manual_seed(0)
    layers = LayerList([("embed", WorkedEmbedding(1, clock)), ("lin", WorkedLinear(2, 3, clock))])
    e, lin = measure_layers(layers, torch.randint(0, 64, (4, 16)), warmup=0, repeats=1, split=True)
    # token ids need no gradient: the embedding's backward is all weight work, as on a first stage
    assert (e.input_s, e.weight_s, e.backward_s) == (0.0, BWD, BWD)
    assert (lin.forward_s, lin.input_s, lin.weight_s, lin.backward_s) == (5 * FWD, 2 * BWD, 3 * BWD, 5 * BWD)
    # I records the gradient of the product's output for W: (4 x 16 tokens, 32 features) fp32
    assert lin.recorded_bytes == 4 * 16 * 32 * 4 and e.recorded_bytes == 0
    plain = measure_layers(layers, torch.randint(0, 64, (4, 16)), warmup=0, repeats=1)
    assert plain[1].input_s == plain[1].weight_s == plain[1].recorded_bytes == 0  # not split: the whole backward
    assert plain[1].backward_s == 5 * BWD


def test_split_puts_backward_work_on_the_path_to_the_input_into_i_once(clock):
    # Timed: x * w, then work in backward. The work lies between the root and the input, so I runs
    # it; W re-enters at x * w for w alone and does not run it again (it would show as 1 unit in W)
    (t,) = measure_layers(LayerList([("t", Timed(1, clock))]), torch.ones(2, 4), warmup=0, repeats=1, split=True)
    assert (t.input_s, t.weight_s) == (BWD, 0.0)


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
