"""Bytes a real optimizer step holds and adds, per parameter (run as ``python -m tests.static_bytes_workers
PRECISIONS OPTIMIZERS``: one JSON line per pair). Its own process: `map_large_blocks` (so that RSS follows
large tensors) stays in force for the rest of a process and slows its kernels.

A 3.7M-parameter GPT trains one step through our `PipelineEngine` (pp 1, the fp32 masters of
`MasterWeights`, the loss scaler in fp16, clipping at 1.0, weight decay 0.01), then a second step whose
`OptimizerStep` is wrapped to observe it: just before it, the unique storages of the weights, their
gradients, the masters and their gradients and the optimizer state ("held"); during it, the resident
set size's peak above its start ("transient").
"""

import json
import sys

import torch

from model_zoo.gpt import GPT, GPTConfig
from mp_toolkit.engine.pipeline import PipelineEngine
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.factory import build_optimizer
from mp_toolkit.optim.loss_scaler import Numerics
from mp_toolkit.optim.settings import Optim
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.partition.memstats import map_large_blocks, peak_rss_bytes, release_free_memory, reset_peak, rss_bytes
from mp_toolkit.run.families import loss_function


class ObservedStep:
    """Calls the engine's `OptimizerStep` and records what is held before it and its transient peak."""

    def __init__(self, engine: PipelineEngine):
        self.engine, self.inner, self.held, self.transient = engine, engine.step, 0, 0

    @property
    def loss_scale(self) -> float:
        return self.inner.loss_scale

    def __call__(self, **kwargs):
        e = self.engine
        params = [p for _, p in e.named_parameters()]
        tensors = [*params, *(p.grad for p in params), *e.masters.master, *(m.grad for m in e.masters.master),
                   *(v for state in e.optimizer.state.values() for v in state.values())]
        self.held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                         for t in tensors if isinstance(t, torch.Tensor) and t.numel() > 0}.values())
        del params, tensors  # no reference of ours may keep a gradient the step frees
        release_free_memory()
        reset_peak()
        before = rss_bytes()
        result = self.inner(**kwargs)
        self.transient = max(0, peak_rss_bytes() - before)
        return result


def measure(precision: str, optimizer: str) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=2048, n_positions=64, n_embd=256, n_layer=4, n_head=4))
    layers = LayerList.from_model(model)
    ctx = ParallelContext()
    engine = PipelineEngine(layers, ctx, [0, len(layers)], 1, "1f1b",
                            optimizer=lambda named: build_optimizer(Optim(optimizer, weight_decay=0.01), named),
                            loss_fn=loss_function(model, ctx), clip_grad=1.0, precision=precision,
                            loss_scaler=Numerics().scaler() if precision == "fp16" else None)
    del model, layers
    ids = torch.randint(0, 2048, (2, 17))
    engine.train_batch(iter([(ids[:, :-1], ids[:, 1:])]))  # the optimizer state exists from here on
    observed = engine.step = ObservedStep(engine)
    engine.train_batch(iter([(ids[:, :-1], ids[:, 1:])]))
    params = sum(p.numel() for _, p in engine.named_parameters())
    return dict(precision=precision, optimizer=optimizer, params=params, held=observed.held,
                transient=observed.transient)


if __name__ == "__main__":
    map_large_blocks()
    torch.set_num_threads(1)
    for precision in sys.argv[1].split(","):
        for optimizer in sys.argv[2].split(","):
            print(json.dumps(measure(precision, optimizer)), flush=True)
