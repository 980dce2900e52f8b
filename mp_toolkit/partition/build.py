"""Build the model a plan describes and measure its layers here (``mpt plan --method time``).

GPT-2-family configs build `model_zoo.gpt.GPT`, BERT configs `model_zoo.bert.BertForPreTraining`
(their `mp_toolkit.arch.zoo` records give the model, its config and the batch it is measured on);
the planner then uses the measured per-layer forward/backward medians and kept bytes, and one
measured optimizer step shared out over the layers by parameter count. With ``--tp T`` the
unsharded layers are measured and their times divided by T (ideal scaling of the sharded math).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from mp_toolkit.arch.architectures import ARCHITECTURES
from mp_toolkit.arch.zoo import zoo_family_on
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.factory import build_optimizer
from mp_toolkit.optim.master import PRECISIONS
from mp_toolkit.optim.settings import Optim
from mp_toolkit.schedule import SPLIT_SCHEDULES

from .contention import concurrent_load, default_threads, helpers_for
from .cost import CostModelError, ModelShape
from .measure import TIMED_MICROBATCHES, LayerTiming, measure_layers, measure_optimizer_step
from .memstats import DeviceMemory, anon_bytes, release_free_memory, warm_runtime


def build_layer_list(model: str, shape: ModelShape):
    """(LayerList, make_batch(b, s) -> (inputs, labels), loss_fn) for a preset or config path: the
    model_zoo model of the shape's architecture (`mp_toolkit.arch.zoo`) and its measurement batch."""
    zoo = zoo_family_on(ARCHITECTURES[shape.family])
    if zoo is None:
        raise CostModelError(f"--method time measures GPT-2 and BERT models so far; {model} is a {shape.family} "
                             f"model: use --method flops or memory (FLOP-based times)")
    config = zoo.get_config(model)
    return (LayerList.from_model(zoo.model_class(config)), *zoo.measure_batch(config))


def measure_model(req, shape: ModelShape) -> tuple[list[LayerTiming], list[float], list[int], int, str]:
    """Measured per-layer timings; the optimizer step's seconds and transient bytes shared out
    over the layers by parameter count; the bytes that running the layers leaves resident (a
    per-process constant every stage pays); and how the times were taken, for ``req``.

    Times are taken with the run's threads per rank and (``req.load``) beside helper processes
    that stand in for the run's other ranks on this machine (`contention`); bytes afterwards,
    alone (the helpers' memory is theirs)."""
    ranks = req.pp * req.tp * req.dp
    threads = req.threads or default_threads(ranks)
    helpers = helpers_for(ranks, threads) if req.load else 0
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    # the heap as `mpt train` runs it (map_large_blocks below overrides it for bytes)
    DeviceMemory.of("cpu").keep_freed()
    try:
        warm_runtime()
        torch.manual_seed(0)
        layers, batch, loss_fn = build_layer_list(req.model, shape)
        layers = layers.to(PRECISIONS[req.precision])
        inputs, labels = batch(req.micro_batch, req.seq_len)
        named = [(n, torch.nn.Parameter(p.detach().float().clone())) for n, p in layers.named_parameters()]
        # the run's weight decay and momentum: they decide what the step makes (`cost.OptimizerBytes`)
        settings = Optim(req.optimizer, lr=1e-3, weight_decay=req.weight_decay, momentum=req.momentum)
        build = lambda nps: build_optimizer(settings, nps)  # noqa: E731
        rounds = min(req.microbatches, TIMED_MICROBATCHES)  # per timing round: gradients accumulate as in a step
        with concurrent_load(req.model, req.micro_batch, req.seq_len, req.precision, threads, helpers):
            release_free_memory()
            before = anon_bytes()
            timings = measure_layers(layers, inputs, loss_fn, labels, microbatches=rounds,  # default allocator
                                     split=req.schedule in SPLIT_SCHEDULES,
                                     order="gpipe" if req.schedule == "gpipe" else "1f1b", bar="timing layers")
            release_free_memory()
            residue = max(0, anon_bytes() - before)  # what computing leaves: kernel scratch, caches (not code)
            step_s, _ = measure_optimizer_step(build, named)
        # then bytes, with large blocks mapped one by one so that RSS follows the live tensors
        sized = measure_layers(layers, inputs, loss_fn, labels, warmup=1, repeats=1, memory=True,
                               bar="measuring layer memory")
        timings = [replace(t, workspace_bytes=m.workspace_bytes) for t, m in zip(timings, sized)]
        _, transient = measure_optimizer_step(build, named, repeats=1)
    finally:
        torch.set_num_threads(saved_threads)
    if req.tp > 1:
        timings = [t.per_shard(req.tp) for t in timings]
    counts = layers.layer_parameter_counts()
    total = sum(p.numel() for _, p in named) or 1
    how = (f"{threads} thread{'s' * (threads > 1)}, beside {helpers} helper process{'es' * (helpers != 1)} "
           f"running the model as the run's other ranks would" if helpers else
           f"{threads} thread{'s' * (threads > 1)}, no other rank computing beside")
    return (timings, [step_s * c / total / req.tp for c in counts],
            [int(transient * c / total / req.tp) for c in counts], residue, how)
