"""``mpt train --layout auto | FILE[:K]``: a run laid out by the planner's search (issue 36).

``--layout auto --global-batch B`` searches the layouts of this run's world (pp x tp x dp as given, on its
device profile, `run.predict.run_profile`) for B sequences per step, as ``mpt plan --search`` does, and
trains the fastest predicted one that fits; ``--layout FILE[:K]`` (``--plan``) trains the K-th layout of a
``mpt plan --search --json`` output (default its first). Either sets the grid, the micro-batch size and
count, the sequence length, the schedule and its chunks, the recomputation, ZeRO and the cut, and a line
says which; everything after (checks, the run plan, the ranks) reads the result as if given by flags.
"""
from __future__ import annotations

from mp_toolkit.errors import ConfigError, PartitionError
from mp_toolkit.partition.cost import ACT_BYTES, CostModelError
from mp_toolkit.partition.search import SearchRequest, search
from mp_toolkit.partition.search_report import search_json
from mp_toolkit.run.config import TrainConfig
from mp_toolkit.run.predict import read_search, run_profile

__all__ = ["apply_layout"]

LAYOUT_KEYS = ("pp", "tp", "dp", "micro_batch", "microbatches", "schedule", "chunks", "recompute", "zero",
               "seq_len", "boundaries")


def apply_layout(cfg: TrainConfig) -> tuple[TrainConfig, str | None]:
    """``cfg`` with its ``--layout`` applied, and the line saying so (None without ``--layout``)."""
    par = cfg.parallel
    if par.layout is None:
        if cfg.batch.global_batch is not None and par.elastic is None:
            raise ConfigError(f"--global-batch {cfg.batch.global_batch} is what --layout auto searches a layout "
                              "for: add --layout auto or --elastic MIN:MAX (or give --dp, --microbatches and "
                              "--micro-batch)")
        return cfg, None
    if par.layout == "auto":
        entry, how = _searched(cfg)
    else:
        entry, how = _from_file(cfg, par.layout)
    missing = [k for k in LAYOUT_KEYS if k not in entry]
    if missing:
        raise ConfigError(f"--layout {par.layout}: the layout has no {missing[0]!r}: not a mpt plan --search output")
    auto = entry["recompute"] == "auto"
    cfg = cfg.replace(pp=entry["pp"], tp=entry["tp"], dp=entry["dp"], micro_batch=entry["micro_batch"],
                      microbatches=entry["microbatches"], seq_len=entry["seq_len"], schedule=entry["schedule"],
                      chunks=entry["chunks"], recompute=entry["recompute"], recompute_layers=None, zero=entry["zero"],
                      partition="flops" if auto else ",".join(map(str, entry["boundaries"])),
                      sequence_parallel=bool(entry.get("sequence_parallel", False)),  # older outputs: without
                      cp=int(entry.get("cp", 1)))
    sched = entry["schedule"] + (f" x{entry['chunks']}" if entry["chunks"] > 1 else "")
    sp = " (sequence parallel)" if cfg.parallel.sequence_parallel else ""
    cp = f" x cp {cfg.parallel.cp}" if cfg.parallel.cp > 1 else ""
    return cfg, (f"layout ({how}): pp {entry['pp']} x tp {entry['tp']}{sp}{cp} x dp {entry['dp']}, "
                 f"{entry['microbatches']} micro-batches of {entry['micro_batch']} x {entry['seq_len']}, {sched}, "
                 f"recompute {entry['recompute']}, ZeRO {entry['zero']}, cut {','.join(map(str, entry['boundaries']))}")


def _searched(cfg: TrainConfig) -> tuple[dict, str]:
    batch, par = cfg.batch, cfg.parallel
    if batch.global_batch is None:
        raise ConfigError("--layout auto searches a layout for a global batch: give --global-batch B (sequences "
                          "per step over all replicas)")
    precision = cfg.numerics.precision
    req = SearchRequest(model=cfg.hf or cfg.model, devices=par.world_size, global_batch=batch.global_batch,
                        seq_len=batch.seq_len, cluster=run_profile(cfg),
                        precision=precision if precision in ACT_BYTES else "fp32", optimizer=cfg.optim.optimizer,
                        momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay, hf=cfg.hf is not None,
                        memory_gb=cfg.recomputation.memory_gb, top=1,
                        sequence_parallel=not batch.length_buckets,  # bucket lengths need not split over tp
                        context_parallel=not batch.length_buckets)
    try:
        result = search(req)
    except (PartitionError, CostModelError) as e:
        raise ConfigError(f"--layout auto: {str(e).splitlines()[0]}") from None
    if not result.best:
        reasons = "; ".join(f"{n} {why}" for why, n in result.rejected.most_common(3))
        need = f"; one needs at least {result.least_memory_gb:.3g} GB per rank" if result.least_memory_gb else ""
        raise ConfigError(f"--layout auto: no layout of {par.world_size} devices fits ({reasons}){need}")
    return search_json(result)["layouts"][0], (f"--layout auto, the fastest predicted of {result.considered} "
                                               f"on {req.cluster.name}")


def _from_file(cfg: TrainConfig, spec: str) -> tuple[dict, str]:
    doc, k = read_search(spec)
    layouts = doc["layouts"]
    if not 1 <= k <= len(layouts):
        raise ConfigError(f"--layout {spec}: the search output has {len(layouts)} layouts: choose K in 1.."
                          f"{len(layouts)}" if layouts else f"--layout {spec}: the search found no layout that fits")
    model = cfg.hf or cfg.model
    if doc.get("model") != model:
        raise ConfigError(f"--layout {spec}: the search was for --model {doc.get('model')}, this run trains {model}")
    entry = {**layouts[k - 1], "seq_len": doc.get("seq_len")}
    return entry, f"--layout {spec}, layout {k} of {len(layouts)}"
