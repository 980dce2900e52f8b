"""``--elastic MIN:MAX --global-batch B``: data parallelism that follows the world a launcher gives.

Under torchrun ``--nnodes MIN:MAX`` a node that is lost (or comes back) ends the workers' round; the
agents meet again with the nodes that are there and start every worker anew with another WORLD_SIZE.
With ``--elastic`` each start keeps pp, tp and cp, takes dp = WORLD_SIZE / (pp x tp x cp) (within
MIN..MAX replicas), and keeps the global batch: micro-batches per replica = B / (dp x micro-batch).
With ``--resume auto`` it continues from the latest checkpoint, which resumes on any dp
(`run.state`: the data position is kept in samples, so the sample stream goes on where it stopped).
torchrun must run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (checked): with the agents' shared store
torch 2.13's next rendezvous round after a membership change waits for a store address that no agent
writes. One line says the layout of each start; a world that pp x tp x cp does not divide, a dp outside
MIN..MAX, or a global batch that dp x micro-batch does not divide is refused in one line (exit 2).
"""

from __future__ import annotations

import os

from mp_toolkit.errors import ConfigError
from mp_toolkit.run.config import TrainConfig

__all__ = ["elastic_layout"]


def elastic_layout(cfg: TrainConfig, world_size: int | None, dp_given: bool) -> tuple[TrainConfig, str | None]:
    """``cfg`` with dp and micro-batches per replica taken from ``world_size`` (a launcher's) under
    --elastic, and the line saying so; ``cfg`` and None without --elastic."""
    par, batch = cfg.parallel, cfg.batch
    if par.elastic is None:
        return cfg, None
    lo, hi = par.elastic
    flag = f"--elastic {lo}:{hi}"
    if world_size is None:
        raise ConfigError(f"{flag} follows the world a launcher gives (torchrun --nnodes MIN:MAX --max-restarts N "
                          "... --resume auto); mpt train starting the ranks itself gives a fixed world: use --dp")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ConfigError(f"{flag}: start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment: "
                          "the agents' shared rendezvous store does not survive a change of membership (torch 2.13: "
                          "the next round waits for a MASTER_ADDR no agent writes)")
    if dp_given or par.layout is not None:
        raise ConfigError(f"{flag} takes dp from the launcher's world: drop --dp" if dp_given else
                          f"{flag} and --layout both decide dp: give one")
    if batch.global_batch is None:
        raise ConfigError(f"{flag} keeps the global batch as dp changes: give --global-batch B (sequences per step "
                          "over all replicas)")
    model = par.pp * par.tp * par.cp
    if world_size % model:
        raise ConfigError(f"{flag}: the launcher started {world_size} processes, not a multiple of pp x tp x cp = "
                          f"{model}")
    dp, b, mb = world_size // model, batch.global_batch, batch.micro_batch
    if not lo <= dp <= hi:
        raise ConfigError(f"{flag}: the launcher's {world_size} processes make dp {dp} (pp x tp x cp = {model}), "
                          f"outside {lo}..{hi}")
    if b < 1 or b % (dp * mb):
        raise ConfigError(f"{flag}: --global-batch {b} cannot be split over dp {dp} x --micro-batch {mb}: give a "
                          f"global batch that every dp in {lo}..{hi} times the micro-batch divides")
    m = b // (dp * mb)
    cp = f" x cp {par.cp}" if par.cp > 1 else ""
    line = (f"elastic: world {world_size} = pp {par.pp} x tp {par.tp}{cp} x dp {dp} (--elastic {lo}:{hi}); "
            f"global batch {b} = dp {dp} x {m} micro-batches x {mb} sequences")
    return cfg.replace(dp=dp, microbatches=m), line
