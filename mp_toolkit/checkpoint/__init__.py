"""Layout-independent checkpoints: safetensors shards + a hashed JSON manifest (DESIGN.md invariant 8).

On disk, under a root directory::

    latest                         "step-00000012\\n": the committed checkpoint
    step-00000012/
      manifest.json                {"format", "format_version", "step", "meta": <caller's dict>,
                                    "files": {relative path: {"sha256", "bytes"}}}
      layers/<layer>.safetensors   FULL tensors of one layer under the unsplit model's names
      optim/<layer>.safetensors    per-parameter optimizer state, keys "<param name>.<state key>",
                                   scalar state as JSON in the safetensors metadata
      rng/rank-00003.safetensors   one global rank's RNG state
    .tmp-*                         scratch of unfinished saves: ignored, removed by the next begin

Nothing depends on the (pp, tp, dp) layout that wrote it: the caller gathers tensor-parallel shards
into full tensors before saving and shards them again after loading, and each rank of any layout
reads the layers it holds. No pickle anywhere: only safetensors and JSON are parsed, and each file
only after its SHA-256 matched the manifest, so opening an untrusted checkpoint cannot run code.
"""

from mp_toolkit.checkpoint.files import FORMAT_VERSION, CheckpointError
from mp_toolkit.checkpoint.optim_state import (
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    param_groups_by_name,
)
from mp_toolkit.checkpoint.reader import Checkpoint, latest_step, open_checkpoint
from mp_toolkit.checkpoint.rng import RngState, capture_rng, restore_rng
from mp_toolkit.checkpoint.writer import (
    begin,
    clear_scratch,
    commit,
    discard,
    save_checkpoint,
    split_by_layer,
    write_layer_shard,
    write_optimizer_shard,
    write_rng_shard,
    write_shard,
)

__all__ = [
    "FORMAT_VERSION", "CheckpointError", "Checkpoint", "open_checkpoint", "latest_step",
    "begin", "clear_scratch", "discard", "write_shard", "write_layer_shard", "write_optimizer_shard", "write_rng_shard",
    "commit",
    "save_checkpoint", "split_by_layer", "optimizer_state_by_name", "load_optimizer_state_by_name",
    "param_groups_by_name", "RngState", "capture_rng", "restore_rng",
]
