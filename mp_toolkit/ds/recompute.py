"""DeepSpeed's activation checkpointing keys, mapped onto ``--recompute`` (`mp_toolkit.recompute`).

* ``pipeline.activation_checkpoint_interval`` N (PipelineModule's argument; 0, the default, is off):
  N >= 1 is ``recompute`` full for every block layer. DeepSpeed checkpoints runs of N layers, each
  keeping its first layer's input; mp_toolkit checkpoints each block on its own, which keeps the
  input of every block (at most N - 1 more per run; DeepSpeed's interval 1 exactly) and recomputes
  the same forward.
* ``activation_checkpointing`` (``deepspeed.checkpointing.configure``): how checkpoints are kept, not
  whether. ``partition_activations`` (Megatron's: each tensor-parallel rank keeps 1/tp of a
  checkpointed input and all-gathers it before the recomputation) is refused when true at tp > 1,
  where mp_toolkit keeps inputs whole; at tp 1 there is nothing to split over, DeepSpeed trains
  with it as without, and so does mp_toolkit, listing it as ignored. ``cpu_checkpointing`` (keep
  the input in host memory) is refused when true. ``contiguous_memory_optimization``,
  ``number_checkpoints`` (its buffer count), ``synchronize_checkpoint_boundary`` and ``profile``
  leave the numbers unchanged and are listed as ignored.
"""
from __future__ import annotations

from mp_toolkit.ds.json_doc import Block

_REFUSED = {"partition_activations": "mp_toolkit keeps a recomputed layer's input whole on every tensor-parallel "
                                    "rank (partitioning is a no-op only at tp 1)",
            "cpu_checkpointing": "mp_toolkit keeps a recomputed layer's input in device memory"}
_IGNORED = ("contiguous_memory_optimization", "number_checkpoints", "synchronize_checkpoint_boundary", "profile")
INTERVAL_KEY = "pipeline.activation_checkpoint_interval"


def read_recompute(root: Block, ignored: list[str], tp: int = 1) -> tuple[str | None, set[str]]:
    """(``recompute`` the config asks for, or None; the dotted keys read here, which the rest of the
    reader must not list as ignored). ``tp``: the run's tensor-parallel degree."""
    read: set[str] = set()
    block = root.block("activation_checkpointing")
    if block is not None:
        refused = dict(_REFUSED)
        if tp == 1:  # one rank holds the whole input already: partitioning it is a no-op
            del refused["partition_activations"]
            if block.boolean("partition_activations", False):
                ignored.append(f"{block.key('partition_activations')} (a no-op at tp 1)")
        for key, why in refused.items():
            block.only(key, False, f"{why}; set it false (or remove it)")
        block.finish(ignored, known=_IGNORED)
    pipeline = root.data.get("pipeline")
    if not isinstance(pipeline, dict) or pipeline.get("activation_checkpoint_interval") is None:
        return None, read
    interval = Block(root.where, "pipeline", pipeline).integer("activation_checkpoint_interval", 0, lowest=0)
    read.add(INTERVAL_KEY)
    return ("full" if interval > 0 else None), read
