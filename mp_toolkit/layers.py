"""LayerList: a model as an ordered list of named layers, and StageModule: a contiguous slice of it.

A layer takes what the previous layer returned (one tensor, or a tuple unpacked as arguments) and
returns one tensor or a tuple. Calling a LayerList runs every layer in order, so for a GPT
``logits = layer_list(input_ids)``.

Tie groups name parameters that are one weight in the unsplit model, e.g. GPT's token embedding
and LM head: ``[("embed", "wte.weight"), ("lm_head", "weight")]``. When the members land on
different pipeline stages each stage holds a copy; `mp_toolkit.engine.ties` sums their gradients
before the step so the copies stay identical, and norms count the weight once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

TieGroup = tuple[tuple[str, str], ...]  # ((layer name, parameter path inside that layer), ...)


def run_layers(layers: Sequence[nn.Module], *inputs):
    """Run ``layers`` in order; a tuple output is unpacked into the next layer's arguments.

    A layer whose ``recompute`` attribute is "full" keeps only its inputs for the backward and runs
    its forward again there (torch's non-reentrant checkpoint, which restores the random state
    first, so dropout masks are the same; `mp_toolkit.recompute`)."""
    x = inputs
    for layer in layers:
        args = x if isinstance(x, tuple) else (x,)
        if getattr(layer, "recompute", "none") == "full" and torch.is_grad_enabled():
            x = checkpoint(layer, *args, use_reentrant=False)
        else:
            x = layer(*args)
    return x


class LayerList(nn.Module):
    """Named layers in execution order plus tie groups; the planner cuts it into stages."""

    def __init__(self, layers: Sequence[tuple[str, nn.Module]], tie_groups: Sequence[Sequence[tuple[str, str]]] = ()):
        super().__init__()
        names = [name for name, _ in layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names must be unique, got {names}")
        self.names: tuple[str, ...] = tuple(names)
        self.layers = nn.ModuleList([module for _, module in layers])
        self.tie_groups: tuple[TieGroup, ...] = tuple(tuple((name, path) for name, path in g) for g in tie_groups)
        for group in self.tie_groups:
            for layer_name, param_path in group:
                if layer_name not in self.names:
                    raise ValueError(f"tie group names unknown layer {layer_name!r}")
                self[layer_name].get_parameter(param_path)  # raises if the path is wrong

    @classmethod
    def from_model(cls, model: nn.Module) -> "LayerList":
        """Wrap a model that exposes ``named_layers()`` (and optionally ``tie_groups()``)."""
        if not hasattr(model, "named_layers"):
            raise TypeError(
                f"{type(model).__name__} does not expose named_layers(); build a LayerList from "
                "[(name, module), ...] directly"
            )
        ties = model.tie_groups() if hasattr(model, "tie_groups") else ()
        return cls(model.named_layers(), ties)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, name: str) -> nn.Module:
        return self.layers[self.names.index(name)]

    def forward(self, *inputs):
        return run_layers(self.layers, *inputs)

    def layer_parameter_counts(self) -> list[int]:
        """Parameters per layer; a tied weight counts in every layer that holds it (each stores it)."""
        return [sum(p.numel() for p in layer.parameters()) for layer in self.layers]

    def slice(self, start: int, stop: int, index: int = 0) -> "StageModule":
        """The stage made of layers[start:stop] (pipeline stage number ``index``)."""
        if not 0 <= start < stop <= len(self):
            raise ValueError(f"stage slice [{start}, {stop}) is empty or outside 0..{len(self)}")
        return StageModule(self, start, stop, index)


class StageModule(nn.Module):
    """A contiguous slice of a LayerList: what one pipeline stage runs.

    ``tie_members`` maps a tie-group index to this stage's parameter for it (one Parameter even
    when several members of the group sit on this stage, since they are the same object).
    """

    def __init__(self, layer_list: LayerList, start: int, stop: int, index: int):
        super().__init__()
        self.index, self.start, self.stop = index, start, stop
        self.names = layer_list.names[start:stop]
        self.layers = nn.ModuleList(layer_list.layers[start:stop])
        self.tie_members: dict[int, nn.Parameter] = {}
        for g, group in enumerate(layer_list.tie_groups):
            for layer_name, param_path in group:
                if layer_name in self.names:
                    self.tie_members.setdefault(g, layer_list[layer_name].get_parameter(param_path))

    def forward(self, *inputs):
        return run_layers(self.layers, *inputs)

    def named_layer_parameters(self):
        """(``layer_name.param_path``, Parameter) with the names of the unsplit LayerList."""
        seen: set[int] = set()
        for name, layer in zip(self.names, self.layers):
            for path, param in layer.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield f"{name}.{path}", param


__all__ = ["LayerList", "StageModule", "run_layers"]
