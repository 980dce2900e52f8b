"""Embedding gradients accumulated by rows (`mp_toolkit.engine.embedding_rows`): bitwise the dense
backward's over several micro-batches, without a (V, C) temporary after the first."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mp_toolkit.engine.embedding_rows import accumulate_by_rows

V, C = 400, 16


class LargestOutput(TorchDispatchMode):
    """Records the most elements a tensor made by an operator had while active (an in-place
    operator's output is its input: not made)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.data_ptr() for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.data_ptr() not in given:
                self.numel = max(self.numel, t.numel())
        return out


def micro_batches(padding_idx, n=3):
    """(ids, upstream gradient) per micro-batch: many repeats of few tokens (padding among them), and
    gradients spanning 12 orders of magnitude, so that the order of each row's additions shows."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 6, (2, 24), generator=g)
        if padding_idx is not None:
            ids[0, :3] = padding_idx
        grad = torch.randn(2, 24, C, generator=g) * 10.0 ** torch.randint(-6, 6, (2, 24, 1), generator=g)
        out.append((ids, grad))
    return out


def accumulate(emb: nn.Embedding, batches, dtype):
    largest = []
    for ids, grad in batches:
        with LargestOutput() as seen:
            emb(ids).backward(grad.to(dtype))
        largest.append(seen.numel)
    return emb.weight.grad, largest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_rows_equal_the_dense_backward_bitwise(padding_idx, dtype):
    torch.manual_seed(0)
    dense = nn.Embedding(V, C, padding_idx=padding_idx).to(dtype)
    rows = nn.Embedding(V, C, padding_idx=padding_idx).to(dtype)
    rows.load_state_dict(dense.state_dict())
    assert accumulate_by_rows(nn.Sequential(rows)) == ["0"]
    batches = micro_batches(padding_idx)
    want, dense_largest = accumulate(dense, batches, dtype)
    got, rows_largest = accumulate(rows, batches, dtype)
    assert torch.equal(got, want)
    if padding_idx is not None:
        assert not got[padding_idx].any()  # the padding row gets no gradient, as in the dense backward
    # after the first micro-batch nothing the size of the table is made; the dense backward makes one each time
    assert dense_largest == [V * C] * 3
    assert rows_largest[0] == V * C and max(rows_largest[1:]) < V * C // 2
    # the comparison can fail: the same additions in another order (each contribution added to the
    # accumulated gradient in turn, not summed per row first) give other bits
    ids, grad = batches[1]
    first = want - torch.ops.aten.embedding_dense_backward(grad.to(dtype), ids, V, -1, False)  # any start will do
    one_by_one = first.clone().index_add_(0, ids.reshape(-1), grad.to(dtype).reshape(-1, C))
    summed_first = first + torch.ops.aten.embedding_dense_backward(grad.to(dtype), ids, V, -1, False)
    assert not torch.equal(one_by_one, summed_first)


def test_same_gradients_in_a_stage_with_other_layers_and_eval_unchanged():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(V, C), nn.Linear(C, C), nn.GELU(), nn.Linear(C, 3))
    hooked = nn.Sequential(nn.Embedding(V, C), nn.Linear(C, C), nn.GELU(), nn.Linear(C, 3))
    hooked.load_state_dict(plain.state_dict())
    accumulate_by_rows(hooked)
    for ids, _ in micro_batches(None):
        for model in (plain, hooked):
            model(ids).square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), hooked.parameters()):
        assert torch.equal(p.grad, q.grad), name
    with torch.no_grad():
        ids = micro_batches(None, 1)[0][0]
        assert torch.equal(plain(ids), hooked(ids))


class TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, C)
        self.head = nn.Linear(C, V, bias=False)
        self.head.weight = self.embed.weight  # one weight used twice in one backward

    def forward(self, ids):
        return self.head(self.embed(ids))


class Scaled(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2.0


@pytest.mark.parametrize("make", [TiedHead, lambda: Scaled(V, C), lambda: nn.Embedding(V, C, sparse=True),
                                  lambda: nn.Embedding(V, C, max_norm=1.0),
                                  lambda: nn.Embedding(V, C, scale_grad_by_freq=True)],
                         ids=["tied in one stage", "subclass", "sparse", "max_norm", "scale_grad_by_freq"])
def test_left_dense(make):
    assert accumulate_by_rows(make()) == []


def test_hooks_on_the_weight_see_every_dense_gradient():
    """While a hook watches the weight's gradient (`mp_toolkit.run.skips` makes it inf that way),
    every micro-batch's gradient is the dense one; without hooks the rows are added in place again."""
    torch.manual_seed(0)
    emb = nn.Embedding(V, C)
    accumulate_by_rows(nn.Sequential(emb))
    seen = []
    handle = emb.weight.register_hook(lambda g: seen.append(g.shape) or torch.full_like(g, float("inf")))
    batches = micro_batches(None)
    _, largest = accumulate(emb, batches, torch.float32)
    assert seen == [(V, C)] * 3 and largest == [V * C] * 3 and emb.weight.grad.isinf().all()
    handle.remove()
    emb.weight.grad = None
    _, largest = accumulate(emb, batches, torch.float32)
    assert largest[0] == V * C and max(largest[1:]) < V * C // 2 and emb.weight.grad.isfinite().all()
