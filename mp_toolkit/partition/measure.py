"""Measure each layer on this machine: forward and backward time, and the bytes autograd keeps.

``mpt plan --method time`` uses these numbers instead of FLOPs. Every layer runs on its real
input (the previous layer's output for one micro-batch), ``warmup`` untimed rounds then
``repeats`` timed ones, and the median is kept (robust to a stray slow run). The last layer is
timed together with the loss, as the pipeline's last stage runs them. Kept bytes are counted with
`torch.autograd.graph.saved_tensors_hooks`, one count per storage, parameters excluded; the
transient peak beyond them (gradients of logits, temporaries) from the resident set size, with
large blocks mapped individually so that RSS follows live tensors (`mp_toolkit.memstats`).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mp_toolkit.layers import LayerList, run_layers
from mp_toolkit.memstats import map_large_blocks, peak_rss_bytes, release_free_memory, reset_peak, rss_bytes


@dataclass(frozen=True)
class LayerTiming:
    """Medians for one micro-batch through one layer."""

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
    """Detached copies of a layer's inputs; float tensors become leaves that want a gradient."""
    parts = x if isinstance(x, tuple) else (x,)
    return tuple(t.detach().requires_grad_(t.is_floating_point()) for t in parts)


def measure_layers(layer_list: LayerList, inputs, loss_fn: Callable | None = None, labels=None,
                   warmup: int = 2, repeats: int = 5, memory: bool = False) -> list[LayerTiming]:
    """Time every layer of ``layer_list`` (already in its compute dtype) on ``inputs``.

    ``loss_fn(output, labels)`` is applied after the last layer (and timed with it).
    ``memory=True`` also measures each layer's transient peak; it maps large blocks one by one
    for the rest of the process (`map_large_blocks`), which slows CPU kernels by 20-30%, so take
    the times from a run without it.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    if memory:
        map_large_blocks()
    x = inputs
    out: list[LayerTiming] = []
    last = len(layer_list) - 1
    for i, (name, layer) in enumerate(zip(layer_list.names, layer_list.layers)):
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        fwd, bwd, kept, peak = [], [], 0, 0
        for r in range(warmup + repeats):
            args = _as_inputs(x)
            seen: dict[int, int] = {}
            release_free_memory()
            before = rss_bytes()
            reset_peak()
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(_saved_bytes_hook(params, seen), lambda t: t):
                y = run_layers([layer], *args)
                loss = loss_fn(y, labels) if i == last and loss_fn is not None else None
            t1 = time.perf_counter()
            roots, grads = _roots(y, loss)
            if roots:
                torch.autograd.backward(roots, grads)
            t2 = time.perf_counter()
            grads = sum(p.grad.nbytes for p in layer.parameters() if p.grad is not None)
            if memory and r >= warmup:
                peak = max(peak, peak_rss_bytes() - before - grads)
            for p in layer.parameters():
                p.grad = None
            if r >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                kept = sum(seen.values())
            del roots, grads, loss
        out.append(LayerTiming(name, statistics.median(fwd), statistics.median(bwd), kept,
                               max(0, peak - kept) if memory else 0))
        x = tuple(t.detach() for t in y) if isinstance(y, tuple) else y.detach()
    return out


def _roots(y, loss) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """What to differentiate: the loss, or the float outputs with gradients of ones."""
    if loss is not None:
        return [loss], None
    outs = [t for t in (y if isinstance(y, tuple) else (y,)) if t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


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
