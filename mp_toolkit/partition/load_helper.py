"""A helper process of `mp_toolkit.partition.contention.concurrent_load`: it runs the model's forward
and backward in a loop, as another rank of the run would, until its stdin closes.

    python -m mp_toolkit.partition.load_helper MODEL MICRO_BATCH SEQ DTYPE THREADS
"""

from __future__ import annotations

import sys
import threading

import torch

from mp_toolkit.layers import run_layers
from mp_toolkit.optim.master import PRECISIONS
from mp_toolkit.partition.build import build_layer_list
from mp_toolkit.partition.cost import model_shape


def serve(model: str, micro_batch: int, seq_len: int, dtype: str, threads: int) -> None:
    torch.set_num_threads(threads)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    torch.manual_seed(1)
    layers, batch, loss_fn = build_layer_list(model, model_shape(model))
    layers = layers.to(PRECISIONS[dtype])
    inputs, labels = batch(micro_batch, seq_len)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    first = True
    while not stop.is_set():
        loss_fn(run_layers(layers.layers, *inputs), labels).backward()
        for p in layers.parameters():
            p.grad = None
        if first:
            print("ready", flush=True)
            first = False


if __name__ == "__main__":
    name, b, s, dt, th = sys.argv[1:6]
    serve(name, int(b), int(s), dt, int(th))
