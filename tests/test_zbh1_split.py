"""ZB-H1's split backward (`mp_toolkit.engine.split_backward`) against the full backward.

``I`` then ``W`` must give the input gradients and the weight gradients of one full backward
bitwise (the same kernels on the same operands, accumulated as ``AccumulateGrad`` does: no
tolerance), and do no matrix product twice: the FLOPs of ``I`` and ``W`` add up to the full
backward's. The cases where the split would be wrong fall back (``WeightPass`` None).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from model_zoo.gpt import GPT, GPTConfig, lm_loss
from mp_toolkit.engine.split_backward import split_backward_input
from mp_toolkit.layers import LayerList

CFG = GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=4, tie_word_embeddings=False)
B, T = 2, 16


def gpt_stage(start: int, stop: int):
    torch.manual_seed(0)
    layers = LayerList.from_model(GPT(CFG))  # embed, h.0, h.1, h.2, ln_f, lm_head
    return layers.slice(start, stop, 1)


def stage_roots(stage, x, y, last: bool, seed: int):
    """(roots, root grads) of one micro-batch: the loss on the last stage, else the output with a fixed gradient."""
    out = stage(x)
    if last:
        return [lm_loss(out, y)], None
    return [out], [torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))]


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def grads_of(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


@pytest.mark.parametrize("start, stop, last", [(1, 3, False), (3, 6, True)], ids=["blocks", "last-stage"])
def test_split_equals_full_backward_bitwise_over_two_microbatches(start, stop, last):
    stage = gpt_stage(start, stop)
    params = list(stage.parameters())
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(B, T, CFG.n_embd, generator=gen) for _ in range(2)]
    ys = [torch.randint(0, CFG.vocab_size, (B, T), generator=gen) for _ in range(2)]

    full_dx, full_flops = [], 0
    for k, (x0, y) in enumerate(zip(xs, ys)):
        x = x0.clone().requires_grad_()
        roots, root_grads = stage_roots(stage, x, y, last, k)
        full_flops += flops(lambda roots=roots, root_grads=root_grads: torch.autograd.backward(roots, root_grads))
        full_dx.append(x.grad)
    full = grads_of(params)

    stage.zero_grad(set_to_none=True)
    split_flops, passes = 0, []
    for k, (x0, y) in enumerate(zip(xs, ys)):  # I, I, then W, W: the order ZB-H1 defers them in
        x = x0.clone().requires_grad_()
        roots, root_grads = stage_roots(stage, x, y, last, k)
        box = {}
        split_flops += flops(lambda box=box, roots=roots, root_grads=root_grads, x=x:
                             box.update(out=split_backward_input(roots, root_grads, [x], params)))
        (dx,), weight_pass = box["out"]
        assert weight_pass is not None
        assert torch.equal(dx, full_dx[k])
        # I computed the LayerNorms' gradients (groups of vectors only, `worth_deferring`), no Linear's
        assert all((p.grad is None) == (".ln_" not in name) for name, p in stage.named_parameters())
        passes.append(weight_pass)
    for weight_pass in passes:
        split_flops += flops(weight_pass.run)
    assert split_flops == full_flops
    assert all(torch.equal(a, b) for a, b in zip(grads_of(params), full))
    # W's groups: 4 matrices per block (qkv, attn proj, fc, mlp proj; the LayerNorms' in I), lm_head
    assert len(passes[0].groups) == {False: 8, True: 4 + 1}[last]


def test_first_stage_is_not_split():
    """Token ids need no gradient: the whole backward is weight work, done by W unsplit."""
    stage = gpt_stage(0, 2)
    ids = torch.randint(0, CFG.vocab_size, (B, T))
    out = stage(ids)
    got, weight_pass = split_backward_input([out], [torch.ones_like(out)], [], list(stage.parameters()))
    assert got == () and weight_pass is None


class TwiceInARow(torch.nn.Module):
    """One weight on the path of its own second use: its W must not be entered at both uses."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class SideBySide(torch.nn.Module):
    """One weight used on two parallel branches: the split applies, both uses in one group."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.other = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * F.linear(torch.sin(self.other(x)), self.lin.weight)


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class CustomFunction(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return Scale.apply(x, self.w).tanh()


@pytest.mark.parametrize("module, splits", [(TwiceInARow, False), (SideBySide, True), (CustomFunction, False)])
def test_split_or_fallback_gives_the_full_backward(module, splits):
    torch.manual_seed(0)
    m = module()
    params = list(m.parameters())
    x0 = torch.randn(4, 8)
    x = x0.clone().requires_grad_()
    m(x).square().sum().backward()
    full, full_dx = grads_of(params), x.grad
    m.zero_grad(set_to_none=True)

    x = x0.clone().requires_grad_()
    roots = [m(x).square().sum()]
    (dx,), weight_pass = split_backward_input(roots, None, [x], params)
    assert (weight_pass is not None) == splits
    if weight_pass is not None:
        weight_pass.run()
    else:  # the executor's fallback: the kept graph, towards the weights only
        torch.autograd.backward(roots, inputs=params)
    assert torch.equal(dx, full_dx)
    assert all(torch.equal(a, b) for a, b in zip(grads_of(params), full))


def test_gradient_hooks_on_parameters_still_fire_in_w():
    """A hook on a parameter (mpt's fault injection makes a gradient inf with one) sees W's gradient,
    or I's for a LayerNorm parameter (`worth_deferring`)."""
    stage = gpt_stage(1, 2)
    params = list(stage.parameters())  # ln_1.weight, ln_1.bias, attn.qkv.weight, attn.qkv.bias, ...
    seen, seen_ln = [], []
    params[3].register_hook(lambda g: seen.append(g.shape) or torch.full_like(g, float("inf")))
    params[0].register_hook(lambda g: seen_ln.append(g.shape) or torch.full_like(g, float("inf")))
    x = torch.randn(B, T, CFG.n_embd, requires_grad=True)
    out = stage(x)
    _, weight_pass = split_backward_input([out], [torch.ones_like(out)], [x], params)
    assert seen == [] and seen_ln == [params[0].shape] and torch.isinf(params[0].grad).all()
    weight_pass.run()
    assert seen == [params[3].shape] and torch.isinf(params[3].grad).all()
    assert seen_ln == [params[0].shape]  # once, in I
