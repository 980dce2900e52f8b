"""Measure each layer on this machine: forward and backward time, and the bytes autograd keeps.

``mpt plan --method time`` uses these numbers instead of FLOPs. Every layer runs on its real
input (the previous layer's output for one micro-batch) the way a pipeline stage runs it: a
*round* is ``microbatches`` micro-batches in 1F1B order (F0 F1 B0 F2 B1 ... B(k-1)), weight
gradients accumulating in place across the round (``.grad`` exists after the first backward, so
later ones add into it) and dropped after it, as the optimizer step's ``zero_grad`` does; the
allocator keeps and reuses its blocks between micro-batches. A layer's forward (backward) time
is the mean per micro-batch of a round, median over ``repeats`` rounds after ``warmup`` untimed
ones. Timed alone instead (one micro-batch on a trimmed heap, its weight gradients allocated
anew each time), a GPT block took 30-50% more CPU time than inside such a round, and than it
takes inside a real 1F1B run (`tools/pipeline_profile.py`, per-action CPU time).
The last layer is timed together with the loss, as the pipeline's last stage runs them.

Kept bytes are counted with `torch.autograd.graph.saved_tensors_hooks` in one untimed pass, one
count per storage, parameters excluded; the transient peak beyond them (gradients of logits,
temporaries) from the resident set size of one micro-batch alone, with large blocks mapped
individually so that RSS follows live tensors (`mp_toolkit.memstats`).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mp_toolkit.layers import LayerList, run_layers
from mp_toolkit.memstats import map_large_blocks, peak_rss_bytes, release_free_memory, reset_peak, rss_bytes

TIMED_MICROBATCHES = 4
"""Micro-batches per timing round that callers use (gradients accumulate as in a step); more add little."""


@dataclass(frozen=True)
class LayerTiming:
    """Per micro-batch, for one layer: times inside a round, kept and transient bytes."""

    name: str
    forward_s: float
    backward_s: float
    activation_bytes: int
    workspace_bytes: int = 0
    """Peak resident bytes during its forward + backward beyond the kept activations (RSS)."""


def _saved_bytes_hook(params: set[int], seen: dict[int, int]):
    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    return pack


def _as_inputs(x) -> tuple:
    """Detached views of a layer's inputs; float tensors become leaves that want a gradient."""
    parts = x if isinstance(x, tuple) else (x,)
    return tuple(t.detach().requires_grad_(t.is_floating_point()) for t in parts)


def _roots(y, loss) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """What to differentiate: the loss, or the float outputs with gradients of ones."""
    if loss is not None:
        return [loss], None
    outs = [t for t in (y if isinstance(y, tuple) else (y,)) if t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


def one_f_one_b(k: int) -> list[tuple[str, int]]:
    """The order of a round: ``[("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ..., ("B", k-1)]``
    (one micro-batch in flight, as a 1F1B stage's steady state runs)."""
    order = [("F", 0)]
    for j in range(1, k):
        order += [("F", j), ("B", j - 1)]
    return order + [("B", k - 1)]


class _Layer:
    """One layer, its input and (for the last layer) the loss: the F and B of one micro-batch."""

    def __init__(self, layer, x, loss_fn, labels):
        self.layer, self.x, self.loss_fn, self.labels = layer, x, loss_fn, labels

    def forward(self):
        y = run_layers([self.layer], *_as_inputs(self.x))
        loss = self.loss_fn(y, self.labels) if self.loss_fn is not None else None
        return y, loss

    def drop_grads(self) -> None:
        for p in self.layer.parameters():
            p.grad = None


def _time_rounds(run: _Layer, microbatches: int, warmup: int, repeats: int) -> tuple[float, float]:
    """Median over rounds of the mean forward and backward seconds per micro-batch. Only what a
    stage keeps stays referenced between actions (the graph's roots), not the loss layer's
    (B, T, V) logits: a stray reference changes what the allocator can hand back and reuse."""
    fwd, bwd = [], []
    for r in range(warmup + repeats):
        pending: dict[int, tuple] = {}
        f = b = 0.0
        for kind, j in one_f_one_b(microbatches):
            if kind == "F":
                t0 = time.perf_counter()
                y, loss = run.forward()
                f += time.perf_counter() - t0
                pending[j] = _roots(y, loss)  # the gradients of ones are made outside the timing
                del y, loss
            else:
                roots, grads = pending.pop(j)
                t0 = time.perf_counter()
                if roots:
                    torch.autograd.backward(roots, grads)
                b += time.perf_counter() - t0
                del roots, grads
        run.drop_grads()  # the optimizer step's zero_grad (set to None)
        if r >= warmup:
            fwd.append(f / microbatches)
            bwd.append(b / microbatches)
    return statistics.median(fwd), statistics.median(bwd)


def _kept_and_peak(run: _Layer, params: set[int], memory: bool) -> tuple[int, int]:
    """Bytes autograd keeps for one micro-batch, and (``memory``) the peak resident bytes of its
    forward + backward beyond the layer's weight gradients."""
    seen: dict[int, int] = {}
    if memory:
        release_free_memory()
        reset_peak()
    before = rss_bytes()
    with torch.autograd.graph.saved_tensors_hooks(_saved_bytes_hook(params, seen), lambda t: t):
        y, loss = run.forward()
    roots, grads = _roots(y, loss)
    if roots:
        torch.autograd.backward(roots, grads)
    grad_bytes = sum(p.grad.nbytes for p in run.layer.parameters() if p.grad is not None)
    peak = peak_rss_bytes() - before - grad_bytes if memory else 0
    run.drop_grads()
    return sum(seen.values()), peak


def measure_layers(layer_list: LayerList, inputs, loss_fn: Callable | None = None, labels=None,
                   warmup: int = 1, repeats: int = 3, memory: bool = False,
                   microbatches: int = 4) -> list[LayerTiming]:
    """Time every layer of ``layer_list`` (already in its compute dtype) on ``inputs``, one
    micro-batch; ``microbatches`` per round (see the module docstring).

    ``loss_fn(output, labels)`` is applied after the last layer (and timed with it).
    ``memory=True`` measures each layer's transient peak instead of timing it (times are then
    0); it maps large blocks one by one for the rest of the process (`map_large_blocks`), which
    slows CPU kernels by 20-30%, so take the times from a run without it.
    """
    if repeats < 1 or warmup < 0 or microbatches < 1:
        raise ValueError(f"repeats={repeats} and microbatches={microbatches} must be >= 1 and warmup={warmup} >= 0")
    if memory:
        map_large_blocks()
    x = inputs
    out: list[LayerTiming] = []
    last = len(layer_list) - 1
    for i, (name, layer) in enumerate(zip(layer_list.names, layer_list.layers)):
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        run = _Layer(layer, x, loss_fn if i == last else None, labels)
        fwd = bwd = 0.0
        if memory:
            for _ in range(warmup):  # one-time costs (kernel scratch) out of the peak
                _kept_and_peak(run, params, False)
        kept, peak = _kept_and_peak(run, params, memory)
        if not memory:
            fwd, bwd = _time_rounds(run, microbatches, warmup, repeats)
        out.append(LayerTiming(name, fwd, bwd, kept, max(0, peak - kept) if memory else 0))
        if i < last:
            with torch.no_grad():  # the next layer's input
                x = run_layers([layer], *_as_inputs(x))
    return out


def measure_optimizer_step(build: Callable, named_params: list, repeats: int = 3) -> tuple[float, int]:
    """Median seconds of one optimizer step over ``named_params`` (gradients filled with ones),
    and its transient bytes beyond the state it keeps (foreach temporaries)."""
    params = [p for _, p in named_params]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = build(named_params)
    times = []
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        opt.step()  # allocates the state
        release_free_memory()
        before = rss_bytes()
        reset_peak()
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        transient = max(0, peak_rss_bytes() - before)
        for p, s in zip(params, saved):  # leave the model as it was
            p.copy_(s)
            p.grad = None
    return statistics.median(times), transient
