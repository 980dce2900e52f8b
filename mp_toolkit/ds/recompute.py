"""DeepSpeed's activation checkpointing keys, mapped onto ``--recompute`` (`mp_toolkit.recompute`).

* ``pipeline.activation_checkpoint_interval`` N (PipelineModule's argument; 0, the default, is off):
  N >= 1 is ``recompute`` full for every block layer. DeepSpeed checkpoints runs of N layers, each
  keeping its first layer's input; mp_toolkit checkpoints each block on its own, which keeps the
  input of every block (at most N - 1 more per run; DeepSpeed's interval 1 exactly) and recomputes
  the same forward.
* ``activation_checkpointing`` (``deepspeed.checkpointing.configure``): how checkpoints are kept, not
  whether. ``partition_activations`` (split a kept input over the tensor-parallel ranks) and
  ``cpu_checkpointing`` (keep it in host memory) are refused when true: mp_toolkit keeps inputs
  whole on the device. ``contiguous_memory_optimization``, ``number_checkpoints`` (its buffer
  count), ``synchronize_checkpoint_boundary`` and ``profile`` leave the numbers unchanged and are
  listed as ignored.
"""
from __future__ import annotations

from mp_toolkit.ds.json_doc import Block

_REFUSED = {"partition_activations": "mp_toolkit keeps a recomputed layer's input whole on every tensor-parallel rank",
            "cpu_checkpointing": "mp_toolkit keeps a recomputed layer's input in device memory"}
_IGNORED = ("contiguous_memory_optimization", "number_checkpoints", "synchronize_checkpoint_boundary", "profile")
INTERVAL_KEY = "pipeline.activation_checkpoint_interval"


def read_recompute(root: Block, ignored: list[str]) -> tuple[str | None, set[str]]:
    """(``recompute`` the config asks for, or None; the dotted keys read here, which the rest of the
    reader must not list as ignored)."""
    read: set[str] = set()
    block = root.block("activation_checkpointing")
    if block is not None:
        for key, why in _REFUSED.items():
            block.only(key, False, f"{why}; set it false (or remove it)")
        block.finish(ignored, known=_IGNORED)
    pipeline = root.data.get("pipeline")
    if not isinstance(pipeline, dict) or pipeline.get("activation_checkpoint_interval") is None:
        return None, read
    interval = Block(root.where, "pipeline", pipeline).integer("activation_checkpoint_interval", 0, lowest=0)
    read.add(INTERVAL_KEY)
    return ("full" if interval > 0 else None), read
