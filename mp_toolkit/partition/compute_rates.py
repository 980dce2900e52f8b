"""A device's compute rates, measured here for `profile_here.measure_profile` (issue 36): per
precision the **peak** (`matmul_tflops`: the block's four forward matrix products at the model's
shapes, the profile's ``peak_tflops``) and the **sustained** rate (`sustained_tflops`: the cost
model's FLOPs of a block and the LM head over their forward + backward time at the model's shapes,
the profile's ``tflops``, which the planner turns FLOPs into seconds with). `device_rates` takes
both in a bounded time; `profile_here`'s docstring says what each figure is and still misses.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mp_toolkit.arch.architectures import ARCHITECTURES
from mp_toolkit.arch.zoo import zoo_family_on
from mp_toolkit.layers import LayerList, run_layers
from mp_toolkit.optim.master import PRECISIONS
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.materialize import materialize

from .cost import ModelShape, layer_costs
from .measure import measure_layers
from .memstats import DeviceMemory

__all__ = ["ModelEnds", "block_products", "device_rates", "layer_overhead_us", "matmul_tflops", "model_ends",
           "sustained_tflops", "thread_speedup",
           "synced_layer_seconds", "synced_seconds", "timed_tokens"]

RATE_BUDGET_S = 1.2
"""Seconds for the matrix-product (peak) rates of all precisions together."""
SUSTAINED_BUDGET_S = 3.2
"""Seconds for the sustained rates (a block and the head, forward + backward) of all precisions
together, fp32's share twice another's: the precision most runs train in, and the one a CPU has
fast kernels for."""
SUSTAINED_ROUNDS = (1, 3, 2)
"""`measure_layers`' warm-up rounds, timed rounds (their median kept) and micro-batches per round
(gradients accumulate from the second on, as in a step)."""
SUSTAINED_PASSES = 1 + (SUSTAINED_ROUNDS[0] + SUSTAINED_ROUNDS[1]) * SUSTAINED_ROUNDS[2]
"""Forward + backward passes of each layer that costs: its rounds and `measure_layers`' kept-bytes pass."""
SUSTAINED_SHARE = 0.5
"""The fraction of the peak rate a block and the head are assumed to sustain when sizing the timed
tokens (`timed_tokens`; 0.6-0.7 measured in fp32 on an AVX2 EPYC for gpt-small-cpu)."""
PROBE_ROWS = 16
"""Token rows of the first, sizing run of a precision's products."""


def block_products(hidden: int, ffn: int, tokens: int) -> list[tuple[int, int, int]]:
    """(rows, inner, columns) of one transformer block's matrix products for ``tokens`` tokens:
    the fused q/k/v projection, the attention output, the MLP's two."""
    return [(tokens, hidden, 3 * hidden), (tokens, hidden, hidden), (tokens, hidden, ffn), (tokens, ffn, hidden)]


def synced_seconds(fn, device: torch.device) -> float:
    """Seconds of ``fn()``, a GPU synchronised before and after (its launches are asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def matmul_tflops(products: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device,
                  budget_s: float) -> float:
    """The products' total FLOPs over the sum of each one's median time (the profile's ``peak_tflops``),
    in about ``budget_s``: rows cut where the full products would not fit it thrice."""
    probe = [(min(rows, PROBE_ROWS), k, n) for rows, k, n in products]
    operands = [(torch.randn(r, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device))
                for r, k, n in probe]
    # the second pass's time: the first pays one-time costs (cuBLAS's handle, oneDNN's kernel choice)
    passes = [sum(synced_seconds(lambda a=a, b=b: a @ b, device) for a, b in operands) for _ in range(2)]
    per_row = passes[1] / probe[0][0]
    full = products[0][0]
    rows = full if per_row * full <= budget_s / 3 else max(probe[0][0], int(budget_s / 3 / per_row))
    operands = [(torch.randn(rows, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device))
                for _, k, n in products]
    times: list[list[float]] = [[] for _ in operands]
    started = time.perf_counter()
    for i in range(1 + 25):  # the first pass warms up; 3 timed passes at least, 25 at most
        for slot, (a, b) in zip(times, operands):
            t = synced_seconds(lambda a=a, b=b: a @ b, device)
            if i:
                slot.append(t)
        if i >= 3 and time.perf_counter() - started > budget_s:
            break
    flops = sum(2 * rows * k * n for _, k, n in products)
    return flops / sum(statistics.median(t) for t in times) / 1e12


@contextmanager
def _one_core(device: torch.device, threads: int = 1):
    """``threads`` torch threads on a CPU (one: a rate of one core), the count restored after."""
    before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _peak_rates(shape, tokens: int, precisions: tuple[str, ...], device: torch.device) -> dict[str, float]:
    """TFLOP/s per precision of the block's matrix products; one torch thread on a CPU."""
    products = block_products(shape.hidden, shape.ffn, tokens)
    with _one_core(device):
        return {p: matmul_tflops(products, PRECISIONS[p], device, RATE_BUDGET_S / len(precisions))
                for p in precisions}


@dataclass(frozen=True)
class ModelEnds:
    """What `sustained_tflops` times: a model's layers, only its ends drawn."""

    layers: LayerList
    """The model's layer list: its embedding, first block and the layers after its last block on
    the device, the other blocks left on meta (no storage)."""
    make_batch: Callable
    """``make_batch(b, s) -> (inputs, labels)`` of random tokens (the family's measurement batch)."""
    loss: Callable
    """``loss(output, labels)`` after the last layer, as the last stage runs it."""


def model_ends(model: str, shape: ModelShape, device: torch.device) -> ModelEnds | None:
    """``model``'s `ModelEnds` on ``device``, or None where model_zoo does not build it
    (``shape.hf_modules``, or a family it has not). Built on meta first, so that a large model costs
    only the layers timed (`materialize`)."""
    zoo = None if shape.hf_modules else zoo_family_on(ARCHITECTURES[shape.family])
    if zoo is None:
        return None
    config = zoo.get_config(model)
    with torch.device("meta"):
        net = zoo.model_class(config)
    layers = LayerList.from_model(net)
    ends = [0, 1, *range(1 + shape.num_layers, len(layers))]  # the cost model's order: embedding, blocks, rest
    materialize(layers, ends, net.initial_value, ParallelContext(device=device), device)
    return ModelEnds(layers, *zoo.measure_batch(config))


def _on(v, device: torch.device, as_tuple: bool = False):
    """A tensor or a tuple of them (a family's inputs or labels) on ``device``; ``as_tuple``: a
    tensor as a 1-tuple, to unpack as a layer's arguments."""
    if isinstance(v, tuple):
        return tuple(t.to(device) for t in v)
    return (v.to(device),) if as_tuple else v.to(device)


def synced_layer_seconds(layers: LayerList, x, loss_fn, labels, device: torch.device, repeats: int = 3) -> list[float]:
    """Each layer's forward + backward seconds on its input (the previous layer's output), the
    device synchronised around each (`measure_layers` reads the host's clock only, right on a CPU,
    not after a GPU's asynchronous launches); ``loss_fn(output, labels)`` after the last layer; the
    median of ``repeats`` after one warm-up, weight gradients accumulating as in a step."""
    out = []
    for i, layer in enumerate(layers.layers):
        leaves = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in _on(x, device, as_tuple=True))
        last = i == len(layers) - 1

        def step(layer=layer, leaves=leaves, last=last):
            y = run_layers([layer], *leaves)
            if last:
                loss_fn(y, labels).backward()
            else:  # gradients of ones into the float outputs, as a stage's next one sends back
                ys = [t for t in (y if isinstance(y, tuple) else (y,)) if t.requires_grad]
                torch.autograd.backward(ys, [torch.ones_like(t) for t in ys])

        out.append(statistics.median([synced_seconds(step, device) for _ in range(1 + repeats)][1:]))
        with torch.no_grad():
            x = run_layers([layer], *leaves)
        for p in layer.parameters():
            p.grad = None
    return out


def _ends_flops(shape: ModelShape, micro_batch: int, seq_len: int, precision: str) -> tuple[float, float]:
    """The cost model's forward + backward FLOPs of one block and of the layers after the last one."""
    costs = layer_costs(shape, micro_batch, seq_len, precision, tp=1)
    flops = [c.flops_fwd + c.flops_bwd for c in costs]
    return flops[1], sum(flops[1 + shape.num_layers:])


def timed_tokens(shape: ModelShape, micro_batch: int, seq_len: int, precision: str, peak_tflops: float,
                 budget_s: float) -> tuple[int, int]:
    """(micro-batch, sequence) to time a block and the head at: the model's own, or where their
    `SUSTAINED_PASSES` at `SUSTAINED_SHARE` of the peak would take over ``budget_s`` (a precision
    without a fast kernel), fewer tokens: the micro-batch halved first, then the sequence (to
    `PROBE_ROWS` at least); a slow kernel's rate does not depend on the tokens."""
    def slow(b: int, s: int) -> bool:
        flops = SUSTAINED_PASSES * sum(_ends_flops(shape, b, s, precision))
        return flops > budget_s * SUSTAINED_SHARE * peak_tflops * 1e12

    b, s, least = micro_batch, seq_len, min(seq_len, PROBE_ROWS)
    while b > 1 and slow(b, s):
        b = max(1, b // 2)
    while s > least and slow(b, s):
        s = max(least, s // 2)
    return b, s


def _ends_seconds(ends: ModelEnds, shape: ModelShape, micro_batch: int, seq_len: int, precision: str,
                  device: torch.device, threads: int = 1) -> list[float]:
    """Forward + backward seconds of the first block, the layers after the last block and the head with
    its loss, for ``micro_batch`` x ``seq_len`` tokens: ``threads`` torch threads on a CPU (one: a
    core's), inside `measure_layers`' rounds, as ``--method time`` times layers; on a GPU
    `synced_layer_seconds`."""
    layers, n, dtype = ends.layers, shape.num_layers, PRECISIONS[precision]
    timed = LayerList([(name, layers[name]) for name in layers.names[1:2] + layers.names[1 + n:]]).to(dtype)
    embedding = layers.layers[0].to(dtype)
    inputs, labels = (_on(v, device) for v in ends.make_batch(micro_batch, seq_len))
    with torch.no_grad():  # the first block's input
        x = run_layers([embedding], *_on(inputs, device, as_tuple=True))
    with _one_core(device, threads):
        if device.type == "cpu":
            warmup, repeats, rounds = SUSTAINED_ROUNDS
            return [t.forward_s + t.backward_s for t in measure_layers(
                timed, x, ends.loss, labels, warmup=warmup, repeats=repeats, microbatches=rounds)]
        return synced_layer_seconds(timed, x, ends.loss, labels, device)


def sustained_tflops(ends: ModelEnds, shape: ModelShape, micro_batch: int, seq_len: int, precision: str,
                     device: torch.device, overhead_s: float = 0.0) -> float:
    """The cost model's FLOPs of ``shape.num_layers`` blocks and the head over the time of as many
    forward + backward of one block and one of the head with its loss (the layers in between, a
    final norm, timed but not counted: the cost model gives them no FLOPs), less ``overhead_s`` per
    layer timed: the rate that, with that fixed cost per layer, gives back the time measured at the
    model's shapes (`layer_overhead_us`); ``ends`` from `model_ends`."""
    times = _ends_seconds(ends, shape, micro_batch, seq_len, precision, device)
    block, head = _ends_flops(shape, micro_batch, seq_len, precision)
    n = shape.num_layers
    layers = n + len(times) - 1  # the blocks and the layers after the last one
    busy = max(n * times[0] + sum(times[1:]) - layers * overhead_s, 0.05 * (n * times[0] + sum(times[1:])))
    return (n * block + head) / busy / 1e12


def thread_speedup(ends: ModelEnds, shape: ModelShape, micro_batch: int, seq_len: int, cores: int,
                   device: torch.device) -> float:
    """How much faster a rank with all ``cores`` threads runs the model's block and head (forward +
    backward, fp32, at its shapes) than a rank with one: 1 to ``cores`` (1 on a GPU, or one core).
    Small matrices gain little from a second thread, large ones nearly double."""
    if device.type != "cpu" or cores <= 1:
        return 1.0

    def seconds(threads: int) -> float:
        return sum(_ends_seconds(ends, shape, micro_batch, seq_len, "fp32", device, threads))
    # alternating pairs, the median ratio: one pair varies with what else the machine does
    ratios = [seconds(1) / seconds(cores) for _ in range(OVERHEAD_REPEATS)]
    return min(float(cores), max(1.0, statistics.median(ratios)))


OVERHEAD_TOKENS = (1, 8)
"""The micro-batch a block is timed at for its fixed cost: FLOPs negligible beside it."""
OVERHEAD_REPEATS = 5
"""Pairs of timings `layer_overhead_us` takes the median intercept of (one pair varied by a third
between runs on a 2-core VM)."""


def layer_overhead_us(ends: ModelEnds, shape: ModelShape, micro_batch: int, seq_len: int,
                      device: torch.device) -> float:
    """A layer call's fixed cost (microseconds, at least 0): the intercept of a block's forward +
    backward time over its FLOPs, from the block timed at `OVERHEAD_TOKENS` (FLOPs negligible) and at
    the model's ``micro_batch`` x ``seq_len``, fp32. Per-operation dispatch, autograd and the
    elementwise work that does not grow with the FLOPs."""
    b, s = OVERHEAD_TOKENS
    f_small, f_full = (_ends_flops(shape, bb, ss, "fp32")[0] for bb, ss in ((b, s), (micro_batch, seq_len)))
    fits = []
    for _ in range(OVERHEAD_REPEATS):  # an intercept from two times: the median of a few
        small, full = (_ends_seconds(ends, shape, bb, ss, "fp32", device)[0]
                       for bb, ss in ((b, s), (micro_batch, seq_len)))
        if full <= small or f_full <= f_small:
            fits.append(small)
        else:
            fits.append(small - f_small * (full - small) / (f_full - f_small))
    return max(0.0, statistics.median(fits) * 1e6)


def device_rates(model: str, shape: ModelShape, micro_batch: int, seq_len: int, precisions: tuple[str, ...],
                 device: torch.device, cores: int = 1) -> tuple[dict[str, float], dict[str, float], str, float, float]:
    """(sustained TFLOP/s, peak TFLOP/s per precision, how they were taken: for the profile's note, a
    layer's fixed cost in microseconds: `layer_overhead_us`, 0 where the layers are not built, a rank's
    speed-up with ``cores`` threads: `thread_speedup`, 1 where not built) (`profile_here`'s docstring
    says what each is)."""
    seq_len = min(seq_len, shape.positions or seq_len)  # a model takes no longer sequence
    peak = _peak_rates(shape, micro_batch * seq_len, precisions, device)
    ends = model_ends(model, shape, device)
    if ends is None:
        return dict(peak), peak, (f"tflops: the block's matrix products only (model_zoo does not build "
                                  f"{model}), for {micro_batch} x {seq_len} tokens"), 0.0, 1.0
    DeviceMemory.of(device).keep_freed()  # the heap as `mpt train` runs it
    overhead = layer_overhead_us(ends, shape, micro_batch, seq_len, device) if "fp32" in precisions else 0.0
    rates, fewer = {}, []
    weights = {p: 2 if p == "fp32" else 1 for p in precisions}
    for p in precisions:
        budget = SUSTAINED_BUDGET_S * weights[p] / sum(weights.values())
        b, s = timed_tokens(shape, micro_batch, seq_len, p, peak[p], budget)
        rates[p] = sustained_tflops(ends, shape, b, s, p, device, overhead * 1e-6)
        if (b, s) != (micro_batch, seq_len):
            fewer.append(f"{p} at {b} x {s}, within its time budget")
    how = (f"tflops: sustained rate in the cost model's FLOPs of {model}'s block and LM head, forward + backward, "
           f"for {micro_batch} x {seq_len} tokens, net of layer_overhead_us per layer"
           + (f" ({'; '.join(fewer)})" if fewer else "")
           + "; peak_tflops: the block's four matrix products; layer_overhead_us: the intercept of a block's "
           f"forward + backward time over its FLOPs, timed at {OVERHEAD_TOKENS[0]} x {OVERHEAD_TOKENS[1]} tokens "
           f"and at {micro_batch} x {seq_len}")
    speedup = thread_speedup(ends, shape, micro_batch, seq_len, cores, device)
    if speedup != 1.0:
        how += f"; thread_speedup: the block and head at {cores} threads against one"
    return rates, peak, how, overhead, speedup
