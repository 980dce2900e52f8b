"""Which layers of each pipeline stage recompute their activations, and setting it on the layers.

A choice is data: per stage, a mode and how many of the stage's *block* layers use it, counted
from the stage's first block (Megatron-LM's ``--recompute-method block``: the first N layers of
each stage). A block is a layer whose name ends in an index (``h.3``, ``encoder.layer.0``,
``layers.7``); embeddings, final norms and heads never recompute.

* ``full``: the layer keeps only its inputs; its whole forward runs again during its backward
  (`mp_toolkit.layers.run_layers`, torch's non-reentrant checkpoint, random state restored so
  dropout masks repeat). Any layer supports it, HF adapters included.
* ``selective``: the block keeps everything but its attention core (score matmuls, softmax,
  dropout), which runs again in the backward (Korthikanti et al. 2022). Only blocks that declare a
  ``recompute`` attribute (model_zoo's GPT and BERT blocks, `model_zoo.recompute`) support it.

The backward recomputes the same values with the same kernels, so gradients are bitwise those of
a run without recomputation, under every schedule (ZB-H1's split: `mp_toolkit.engine.split_backward`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mp_toolkit.flag_values import RecomputeError, parse_layer_counts
from mp_toolkit.layers import LayerList
from mp_toolkit.names import RECOMPUTE_MODES as MODES

__all__ = ["MODES", "RecomputeError", "StageRecompute", "apply_recompute", "is_block", "parse_layer_counts",
           "recomputed_layers", "stage_blocks", "stage_choices"]


@dataclass(frozen=True)
class StageRecompute:
    """One stage's choice: ``mode`` for its first ``layers`` block layers (None: all of them)."""

    mode: str = "none"
    layers: int | None = None

    def describe(self, blocks: int) -> str:
        n = blocks if self.layers is None else min(self.layers, blocks)
        return "none" if self.mode == "none" or n == 0 else f"{self.mode} x {n} of {blocks} blocks"


def is_block(name: str) -> bool:
    """Whether layer ``name`` is a transformer block (its last dotted part is an index)."""
    return name.rsplit(".", 1)[-1].isdigit()


def stage_choices(mode: str, counts: Sequence[int] | None, num_stages: int) -> list[StageRecompute]:
    """Per stage: ``mode`` for ``counts`` (one count for every stage, one per stage, or None: every block)."""
    if mode not in MODES:
        raise RecomputeError(f"--recompute {mode!r}: choose one of {', '.join(MODES)} (or auto)")
    if counts is None:
        return [StageRecompute(mode, None)] * num_stages
    if len(counts) not in (1, num_stages):
        raise RecomputeError(f"--recompute-layers gives {len(counts)} counts for {num_stages} stages: give one "
                             f"count, or {num_stages}")
    counts = list(counts) * num_stages if len(counts) == 1 else list(counts)
    return [StageRecompute(mode, c) for c in counts]


def stage_blocks(names: Sequence[str], boundaries: Sequence[int]) -> list[list[int]]:
    """Per stage, the indices of its block layers in order."""
    return [[i for i in range(a, b) if is_block(names[i])] for a, b in zip(boundaries, boundaries[1:])]


def recomputed_layers(names: Sequence[str], boundaries: Sequence[int],
                      choices: Sequence[StageRecompute]) -> dict[int, str]:
    """{layer index: mode} of every layer that recomputes."""
    out = {}
    for blocks, choice in zip(stage_blocks(names, boundaries), choices):
        if choice.mode != "none":
            for i in blocks[:choice.layers]:
                out[i] = choice.mode
    return out


def apply_recompute(layers: LayerList, boundaries: Sequence[int], choices: Sequence[StageRecompute]) -> dict[str, str]:
    """Set every layer's ``recompute`` attribute from ``choices`` (one per stage); returns {layer name:
    mode} of the layers that recompute. Refuses ``selective`` on a layer that does not support it."""
    if len(choices) != len(boundaries) - 1:
        raise RecomputeError(f"{len(choices)} recompute choices for {len(boundaries) - 1} stages")
    chosen = recomputed_layers(layers.names, boundaries, choices)
    for i, (name, layer) in enumerate(zip(layers.names, layers.layers)):
        mode = chosen.get(i, "none")
        if mode == "selective" and not hasattr(type(layer), "recompute"):
            raise RecomputeError(f"--recompute selective: layer {name} ({type(layer).__name__}) has no selective "
                                 f"recomputation (model_zoo's GPT and BERT blocks do); use --recompute full")
        if mode != "none" or hasattr(layer, "recompute"):
            layer.recompute = mode
    return {layers.names[i]: mode for i, mode in sorted(chosen.items())}
