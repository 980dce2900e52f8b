"""Measure each layer on this machine: forward and backward time, and the bytes autograd keeps.

``mpt plan --method time`` uses these numbers instead of FLOPs. Every layer runs on its real
input (the previous layer's output for one micro-batch) the way a pipeline stage runs it: a
*round* is ``microbatches`` micro-batches in 1F1B order (F0 F1 B0 F2 B1 ... B(k-1); GPipe's
F0 ... F(k-1) B0 ... B(k-1) when planning GPipe), weight
gradients accumulating in place across the round (``.grad`` exists after the first backward, so
later ones add into it) and dropped after it, as the optimizer step's ``zero_grad`` does; the
allocator keeps and reuses its blocks between micro-batches. A layer's forward (backward) time
is the mean per micro-batch of a round, median over ``repeats`` rounds after ``warmup`` untimed
ones. Timed alone instead (one micro-batch on a trimmed heap, its weight gradients allocated
anew each time), a GPT block took 30-50% more CPU time than inside such a round, and than it
takes inside a real 1F1B run (`tools/pipeline_profile.py`, per-action CPU time).
The last layer is timed together with the loss, as the pipeline's last stage runs them.
With ``split=True`` every backward runs as ZB-H1's input-gradient pass ``I`` and weight-gradient
pass ``W`` (`mp_toolkit.engine.split_backward`, as the executor runs them) and both are timed:
the split's own cost (walking the graph, re-entering it) is in the figures.

Kept bytes are counted with `torch.autograd.graph.saved_tensors_hooks` in one untimed pass, one
count per storage, parameters excluded; the transient peak beyond them (gradients of logits,
temporaries) from the resident set size less its file pages (the libraries' code the layer pages
in is not the layer's memory) of one micro-batch alone, with large blocks mapped individually so that
it follows live tensors (`mp_toolkit.partition.memstats`).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mp_toolkit.engine.split_backward import split_backward_input
from mp_toolkit.layers import LayerList, run_layers
from mp_toolkit.partition.memstats import anon_bytes, map_large_blocks, peak_anon_bytes, release_free_memory, reset_peak
from mp_toolkit.progress import progress

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
    input_s: float = 0.0
    """With ``split=True``: ZB-H1's ``I`` (input gradients) of ``backward_s``; 0 otherwise."""
    weight_s: float = 0.0
    """With ``split=True``: ZB-H1's ``W`` (weight gradients) of ``backward_s``; 0 otherwise."""
    recorded_bytes: int = 0
    """With ``split=True``: the gradients ``I`` records for ``W`` (held, with the activations,
    from a micro-batch's I to its W); 0 otherwise."""

    def per_shard(self, tp: int) -> "LayerTiming":
        """This layer's share on one of ``tp`` tensor-parallel ranks: every time and byte / tp."""
        return LayerTiming(self.name, self.forward_s / tp, self.backward_s / tp, self.activation_bytes // tp,
                           self.workspace_bytes // tp, self.input_s / tp, self.weight_s / tp,
                           self.recorded_bytes // tp)


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


def all_forward_then_backward(k: int) -> list[tuple[str, int]]:
    """GPipe's order: ``[("F", 0), ..., ("F", k-1), ("B", 0), ..., ("B", k-1)]`` (every
    micro-batch's activations in flight at once)."""
    return [("F", j) for j in range(k)] + [("B", j) for j in range(k)]


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
        """(output, loss or None, the input leaves)."""
        leaves = _as_inputs(self.x)
        y = run_layers([self.layer], *leaves)
        loss = self.loss_fn(y, self.labels) if self.loss_fn is not None else None
        return y, loss, leaves

    def split_backward(self, roots, grads, leaves) -> tuple[float, float, int]:
        """ZB-H1's backward as the executor runs it (`engine.split_backward`): seconds of ``I``
        (input gradients, and what ``W`` needs) and of ``W`` (weight gradients), and the bytes of
        the gradients I recorded for W. Without float inputs (the embedding's token ids) ``I`` is
        empty and ``W`` the whole backward."""
        params = [p for p in self.layer.parameters() if p.requires_grad]
        t0 = time.perf_counter()
        _, weight_pass = split_backward_input(roots, grads, [t for t in leaves if t.requires_grad], params)
        t1 = time.perf_counter()
        recorded = 0
        if weight_pass is not None:
            recorded = sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                            for gs in weight_pass.recorded.values() for g in gs if g is not None}.values())
            t1 = time.perf_counter()  # the count is ours, not the engine's
            weight_pass.run()
        elif roots and params:
            torch.autograd.backward(roots, grads, inputs=params)
        return t1 - t0, time.perf_counter() - t1, recorded

    def drop_grads(self) -> None:
        for p in self.layer.parameters():
            p.grad = None


ORDERS = {"1f1b": one_f_one_b, "gpipe": all_forward_then_backward}
"""How a round orders its micro-batches: GPipe's order for GPipe, 1F1B's steady state for every
other schedule (1F1B, interleaved and ZB-H1 keep few micro-batches in flight)."""


def _time_rounds(run: _Layer, microbatches: int, warmup: int, repeats: int,
                 split: bool = False, order: str = "1f1b") -> tuple[float, float, float, float, int]:
    """Seconds per micro-batch (a round's mean) of the forward (median over rounds), and of the
    backward with, when ``split`` (the backward run as ZB-H1's I, then at once its W), its input-
    and weight-gradient parts (the median round by backward time) and the most bytes one
    micro-batch's I recorded for its W. Only what a stage keeps stays referenced between actions
    (the graph's roots), not the loss layer's (B, T, V) logits: a stray reference changes what the
    allocator can hand back and reuse."""
    rounds = []
    for r in range(warmup + repeats):
        pending: dict[int, tuple] = {}
        f = b_in = b_w = 0.0
        recorded = 0
        for kind, j in ORDERS[order](microbatches):
            if kind == "F":
                t0 = time.perf_counter()
                y, loss, leaves = run.forward()
                f += time.perf_counter() - t0
                pending[j] = (*_roots(y, loss), leaves)  # the gradients of ones are made outside the timing
                del y, loss, leaves
            else:
                roots, grads, leaves = pending.pop(j)
                if split:
                    i_s, w_s, got = run.split_backward(roots, grads, leaves)
                    b_in, b_w, recorded = b_in + i_s, b_w + w_s, max(recorded, got)
                else:
                    t0 = time.perf_counter()
                    if roots:
                        torch.autograd.backward(roots, grads)
                    b_in += time.perf_counter() - t0
                del roots, grads, leaves
        run.drop_grads()  # the optimizer step's zero_grad (set to None)
        if r >= warmup:
            rounds.append((f, b_in + b_w, b_in if split else 0.0, b_w, recorded))
    # the median round by backward time, and its I and W (the two middle rounds' means for an
    # even count), so that I + W is the backward exactly
    by_bwd = sorted(rounds, key=lambda x: x[1])
    mid = by_bwd[(len(by_bwd) - 1) // 2: len(by_bwd) // 2 + 1]
    fwd = statistics.median(x[0] for x in rounds)
    return (fwd / microbatches, *(statistics.fmean(x[i] for x in mid) / microbatches for i in (1, 2, 3)),
            max(x[4] for x in rounds))


def _kept_and_peak(run: _Layer, params: set[int], memory: bool) -> tuple[int, int]:
    """Bytes autograd keeps for one micro-batch, and (``memory``) the peak resident bytes of its
    forward + backward beyond the layer's weight gradients."""
    seen: dict[int, int] = {}
    if memory:
        release_free_memory()
        reset_peak()
    before = anon_bytes()
    with torch.autograd.graph.saved_tensors_hooks(_saved_bytes_hook(params, seen), lambda t: t):
        y, loss, _ = run.forward()
    roots, grads = _roots(y, loss)
    if roots:
        torch.autograd.backward(roots, grads)
    grad_bytes = sum(p.grad.nbytes for p in run.layer.parameters() if p.grad is not None)
    peak = peak_anon_bytes() - before - grad_bytes if memory else 0
    run.drop_grads()
    return sum(seen.values()), peak


def measure_layers(layer_list: LayerList, inputs, loss_fn: Callable | None = None, labels=None,
                   warmup: int = 1, repeats: int = 3, memory: bool = False,
                   microbatches: int = 4, split: bool = False, order: str = "1f1b",
                   bar: str | None = None) -> list[LayerTiming]:
    """Time every layer of ``layer_list`` (already in its compute dtype) on ``inputs``, one
    micro-batch; ``microbatches`` per round (see the module docstring).

    ``loss_fn(output, labels)`` is applied after the last layer (and timed with it).
    ``memory=True`` measures each layer's transient peak instead of timing it (times are then
    0); it maps large blocks one by one for the rest of the process (`map_large_blocks`), which
    slows CPU kernels by 20-30%, so take the times from a run without it.
    ``split=True`` runs every backward as ZB-H1's I then W and times both (`LayerTiming.input_s`).
    ``order`` is a round's order of micro-batches (`ORDERS`: ``"1f1b"`` or ``"gpipe"``).
    ``bar``: a progress bar's label, drawn on a terminal over the layers (`mp_toolkit.progress`).
    """
    if order not in ORDERS:
        raise ValueError(f"order={order!r}: choose one of {', '.join(ORDERS)}")
    if repeats < 1 or warmup < 0 or microbatches < 1:
        raise ValueError(f"repeats={repeats} and microbatches={microbatches} must be >= 1 and warmup={warmup} >= 0")
    if memory:
        map_large_blocks()
    x = inputs
    out: list[LayerTiming] = []
    last = len(layer_list) - 1
    named = zip(layer_list.names, layer_list.layers)
    for i, (name, layer) in enumerate(progress(named, bar, len(layer_list), bar is not None, "layer")):
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        run = _Layer(layer, x, loss_fn if i == last else None, labels)
        fwd = bwd = b_in = b_w = 0.0
        recorded = 0
        if memory:
            for _ in range(warmup):  # one-time costs (kernel scratch) out of the peak
                _kept_and_peak(run, params, False)
        kept, peak = _kept_and_peak(run, params, memory)
        if not memory:
            fwd, bwd, b_in, b_w, recorded = _time_rounds(run, microbatches, warmup, repeats, split, order)
        out.append(LayerTiming(name, fwd, bwd, kept, max(0, peak - kept) if memory else 0, b_in, b_w, recorded))
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
        before = anon_bytes()
        reset_peak()
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        transient = max(0, peak_anon_bytes() - before)
        for p, s in zip(params, saved):  # leave the model as it was
            p.copy_(s)
            p.grad = None
    return statistics.median(times), transient
