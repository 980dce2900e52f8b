"""A LayerList as DeepSpeed's ``PipelineModule``: our cut, our tie groups, DeepSpeed's engine.

This module imports DeepSpeed at the top; `mp_toolkit.engine.deepspeed_bridge` imports it only when a
run asks for ``--engine deepspeed`` (``tools/peers.py`` uses it for the benchmark's DeepSpeed peer).

* **The cut.** ``PipelineModule(partition_method=...)`` knows ``uniform``, ``parameters`` and
  ``type:REGEX`` (balanced over a 0/1 weight per layer); none of them imposes an arbitrary list of
  boundaries. `ExactPartition` overrides ``PipelineModule._partition_layers``, the one method
  (deepspeed/runtime/pipe/module.py, 0.19) that sets ``self.parts`` and this stage's layer range:
  ``__init__`` calls it after the topology is known and before any layer is built, so the given
  cut is the one every later step uses (which layers are built here, ``stage_owner`` for tied
  weights, checkpoint layer names). Setting ``parts`` after construction would be too late.
* **Ties.** Each tie group becomes one ``TiedLayerSpec`` key. DeepSpeed builds the spec's module
  once per stage that holds a member, all-reduces the tied weight's gradient over those stages
  (``ReduceTiedGrads`` in its schedule) and broadcasts it once at start. The module is a
  `TiedLayers` holding every member layer (the way Megatron-DeepSpeed keeps its whole
  ``EmbeddingPipe`` at both ends): a stage runs only its own members, and the parameters of the
  other members it holds are frozen (`freeze_unused`), so they get no gradient and no step.
* **Layers take one argument.** DeepSpeed calls ``layer(inputs)`` with a tuple as one argument;
  our layers take a tuple unpacked (`mp_toolkit.layers.run_layers`), so each is called that way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial

import deepspeed
import deepspeed.ops
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from torch import nn

from mp_toolkit.layers import LayerList


def _call(module: nn.Module, inputs):
    return module(*inputs) if isinstance(inputs, tuple) else module(inputs)


class Unpacked(nn.Module):
    """A layer called as DeepSpeed calls layers, with one (possibly tuple) argument."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, inputs):
        return _call(self.layer, inputs)


class TiedLayers(nn.Module):
    """The member layers of one tie group, in the group's order: the module a TiedLayerSpec builds."""

    def __init__(self, members: Sequence[nn.Module]):
        super().__init__()
        self.members = nn.ModuleList(members)


def _run_member(holder: TiedLayers, inputs, index: int):
    return _call(holder.members[index], inputs)


def pipeline_layers(layer_list: LayerList) -> list:
    """DeepSpeed's layer list: a module per layer, a TiedLayerSpec per member of a tie group.

    The spec "builds" a TiedLayers around the modules already made (seeded alike on every rank), so
    DeepSpeed trains our initial weights. Its tied weight is the group's first member's parameter
    (``members.0.<path>``), which is the same Parameter object as every other member's.
    """
    out: list = [Unpacked(layer) for layer in layer_list.layers]
    for g, group in enumerate(layer_list.tie_groups):
        members = [layer_list[name] for name, _ in group]
        attr = f"members.0.{group[0][1]}"
        for i, (name, _) in enumerate(group):
            out[layer_list.names.index(name)] = TiedLayerSpec(
                f"tie{g}", TiedLayers, members, forward_fn=partial(_run_member, index=i), tied_weight_attr=attr)
    return out


class ExactPartition(PipelineModule):
    """A PipelineModule cut at ``boundaries`` ([0, b1, ..., n]); None: DeepSpeed's ``partition_method``."""

    def __init__(self, layers, boundaries: Sequence[int] | None = None, **kwargs):
        self.exact_boundaries = list(boundaries) if boundaries is not None else None
        super().__init__(layers, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        if self.exact_boundaries is None:
            return super()._partition_layers(method)
        if len(self.exact_boundaries) != self.num_stages + 1 or self.exact_boundaries[-1] != len(self._layer_specs):
            raise ValueError(f"boundaries {self.exact_boundaries} do not cut {len(self._layer_specs)} layers "
                             f"into {self.num_stages} stages")
        self.parts = list(self.exact_boundaries)
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])


def local_parameters(module: PipelineModule, layer_list: LayerList) -> list[tuple[str, nn.Parameter]]:
    """(name in the unsplit LayerList, Parameter) of the layers this stage runs, in layer order."""
    seen, out = set(), []
    start, stop = module.parts[module.stage_id], module.parts[module.stage_id + 1]
    for name, layer in list(zip(layer_list.names, layer_list.layers))[start:stop]:
        for path, p in layer.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((f"{name}.{path}", p))
    return out


def freeze_unused(module: PipelineModule, used: Sequence[nn.Parameter]) -> None:
    """Freeze the parameters this stage holds but never runs (other stages' members of a tie group)."""
    keep = {id(p) for p in used}
    for p in module.parameters():
        if id(p) not in keep:
            p.requires_grad_(False)


def count_in_norm_once(module: PipelineModule, used: Sequence[nn.Parameter]) -> None:
    """Make DeepSpeed's clipping norm the global norm over every stage, each tied weight once.

    DeepSpeed's fp32 clipping (``deepspeed.runtime.utils.clip_grad_norm_`` with the pipeline grid as
    ``mpu``) adds a gradient's square to the norm only on model-parallel rank 0 (stage 0 of the
    replica) unless the parameter is tagged ``model_parallel``, then sums over the replica's stages:
    untagged, the later stages' gradients are left out of the norm. Tagging every parameter this
    stage counts makes the sum cover all stages. A tied weight is counted by the first stage holding
    it only: DeepSpeed marks its copies on the later stages ``ds_pipe_replicated``, and those stay
    untagged (and are skipped by its bf16 norm). DeepSpeed marks *every* parameter of the tied
    module that way, so the used parameters of a later stage's members other than the tied weight
    itself (BERT's MLM head transform and bias) are unmarked, to be counted as they must be.
    """
    tied = {id(w) for w, _ in module.get_tied_weights_and_groups()}
    for p in used:
        if id(p) not in tied:
            p.ds_pipe_replicated = False
        p.model_parallel = not getattr(p, "ds_pipe_replicated", False)


def pipeline_module(layer_list: LayerList, num_stages: int, loss_fn: Callable, boundaries: Sequence[int] | None = None,
                    partition_method: str = "parameters",
                    dynamic_shape: bool = False) -> tuple[ExactPartition, list[tuple[str, nn.Parameter]]]:
    """(PipelineModule of this stage, its trainable (name, Parameter) in layer order).

    ``dynamic_shape``: DeepSpeed sends the shapes of every activation and gradient message ahead of
    it (micro-batches of several lengths); False: once, from the first micro-batch.

    Needs DeepSpeed's process group (`init_deepspeed`); every rank passes the same ``layer_list``.
    """
    module = ExactPartition(pipeline_layers(layer_list), boundaries, num_stages=num_stages, loss_fn=loss_fn,
                            partition_method=partition_method, activation_checkpoint_interval=0,
                            dynamic_shape=dynamic_shape)
    named = local_parameters(module, layer_list)
    used = [p for _, p in named]
    freeze_unused(module, used)
    count_in_norm_once(module, used)
    return module, named


def skip_shm_inference_op() -> None:
    """Keep DeepSpeed from building its shared-memory all-reduce op, which only its
    ``inference_all_reduce`` uses (training's collectives go through torch.distributed).

    On a CPU accelerator ``deepspeed.init_distributed`` JIT-compiles that op with ninja (about a minute
    of both cores on a fresh machine, again whenever the virtual environment's path changes) under a
    lock file in ``~/.cache/torch_extensions``; a run killed while compiling leaves the lock behind and
    every later DeepSpeed run waits on it for ever. DeepSpeed decides what to build from
    ``deepspeed.ops.__compatible_ops__``, a dict it keeps for edits like this one."""
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def init_deepspeed(device: torch.device, timeout_s: float) -> None:
    """DeepSpeed's communication over torch's default group (formed here when not yet): gloo on CPU.
    An existing group keeps its backend (ranks sharing a GPU joined gloo, `run.launch.device_and_backend`).
    DeepSpeed's inference-only shared-memory op is not built (`skip_shm_inference_op`)."""
    skip_shm_inference_op()
    backend = (torch.distributed.get_backend() if torch.distributed.is_initialized()
               else "nccl" if device.type == "cuda" else "gloo")
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timedelta(seconds=timeout_s))


def initialize(module: PipelineModule, optimizer: torch.optim.Optimizer, config: dict):
    """DeepSpeed's PipelineEngine over ``module`` with a client ``optimizer``; keeps torch's thread count
    (DeepSpeed's CPU set-up may change it)."""
    threads = torch.get_num_threads()
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    torch.set_num_threads(threads)
    return engine
