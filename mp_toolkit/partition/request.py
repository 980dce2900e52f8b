"""What ``mpt plan`` is asked (`PlanRequest`), and `check_request`: every bad combination of it
as one line, before anything is measured or cut.

Imports no torch: `mp_toolkit.cli_args` reads `PlanRequest`'s defaults for ``mpt plan``'s flags."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mp_toolkit.errors import PartitionError
from mp_toolkit.names import PLAN_METHODS, PRECISIONS, SCHEDULES, V_SCHEDULES, stages_per_rank

if TYPE_CHECKING:  # the argument's types only
    from .cluster import ClusterProfile
    from .cost import ModelShape, OptimizerBytes

__all__ = ["MAX_GLOBAL_BATCH", "MAX_MICROBATCHES", "PLAN_METHODS", "PlanRequest", "check_request",
           "too_large_global_batch", "too_many_microbatches"]

MAX_MICROBATCHES = 65536
"""The simulator keeps every action of a step; beyond this a plan would take minutes."""


@dataclass(frozen=True)
class PlanRequest:
    """What ``mpt plan`` is asked."""

    model: str
    """Preset name or a HuggingFace config.json (GPT-2, BERT, Llama families)."""
    pp: int = 2
    tp: int = 1
    dp: int = 1
    micro_batch: int = 8
    microbatches: int = 4
    seq_len: int = 128
    method: str = "parameters"
    """uniform, parameters, flops, time, type:REGEX (DeepSpeed's) or memory."""
    memory_gb: float | None = None
    """Per-device cap; required by ``memory``, a warning threshold otherwise."""
    precision: str = "fp32"
    optimizer: str = "adamw"
    momentum: float | None = None
    """Momentum of SGD, LARS and RMSprop (``mpt train --momentum``); None: the optimizer's default
    (SGD and LARS 0.9, RMSprop 0). Its buffer is 4 bytes per parameter of state, kept only when the
    momentum is not 0 (`cost.OptimizerBytes`)."""
    weight_decay: float = 0.01
    """The run's weight decay (``mpt train --weight-decay``, whose default this is): torch's SGD and
    RMSprop make a decayed copy of the gradients in each step (4 bytes per parameter) unless it is 0."""
    schedule: str = "1f1b"
    chunks: int = 1
    """Stages per rank: model chunks of the interleaved schedule, 2 for the V schedules, else 1
    (`mp_toolkit.names.stages_per_rank`)."""
    tflops: float | None = None
    """Throughput turning FLOPs into time; None measures a GEMM on this machine."""
    measure: bool = False
    """Time each layer here even when the method does not need it."""
    threads: int | None = None
    """Torch threads per rank while timing layers; None: as ``mpt train`` picks them (this
    machine's cores shared out over the pp x tp x dp ranks)."""
    load: bool = True
    """Time layers beside helper processes standing in for the run's other ranks on this machine
    (`contention.concurrent_load`); False: on an otherwise idle machine."""
    p2p_latency_us: float = 150.0
    """Per message (gloo on one host; NCCL across NVLink is ~10)."""
    p2p_gbps: float = 3.0
    """Point-to-point and collective bandwidth, GB/s."""
    mem_gbps: float = 8.0
    """Memory bandwidth for the FLOP-free optimizer step estimate, GB/s."""
    hf: bool = False
    """The model is a HuggingFace config trained from transformers' own modules (``mpt train --hf``):
    count what they keep (`ModelShape.hf_modules`); formula times only."""
    recompute: str = "none"
    """Activation recomputation: none, full, selective (`mp_toolkit.recompute`), or auto: per stage,
    chosen jointly with the cut (``method`` memory), the fastest that fits ``memory_gb``."""
    recompute_layers: tuple[int, ...] | None = None
    """full / selective: the first N block layers of every stage (one count), or of each stage (one
    count per stage); None: every block layer."""
    recompute_modes: tuple[str, ...] = ("full", "selective")
    """The modes ``recompute`` auto may choose (selective only where the family has it)."""
    boundaries: tuple[int, ...] | None = None
    """A given cut (``mpt train``'s own, to predict what its ranks hold): ``method`` is not consulted."""
    cp: int = 1
    """Context-parallel degree (``mpt train --cp``): each rank holds seq / cp of every sequence
    (`cost.layer_costs`'s ``cp``); its gradients are averaged over dp x cp ranks."""
    cp_attention: str = "ring"
    """``mpt train --cp-attention``: ring (the key and value slices around the ring) or ulysses (four
    all-to-alls of the activations a block's attention each way); the same FLOPs and kept bytes."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (tp > 1, ``mpt train --sequence-parallel``): a block's norms and
    dropout masks and the messages between stages hold seq / tp of the tokens (`cost.layer_costs`'s
    ``sp``); the all-gathers and reduce-scatters move the bytes the all-reduces did."""
    zero: int = 0
    """ZeRO stage 0 or 1: masters and optimizer state partitioned over the dp replicas
    (`bytes_per_param`'s ``zero_dp``); each replica's optimizer step touches 1/dp of them."""
    cluster: ClusterProfile | None = None
    """The device and cluster profile (`cluster.ClusterProfile`): FLOP times at its rate for the
    precision (``tflops`` not consulted), each message and collective over the link it crosses
    (``p2p_*`` not consulted), the optimizer step at its memory bandwidth, and a rank's memory
    against its capacity when ``memory_gb`` is not given. None: the flags' figures, this machine's GEMM."""


def too_many_microbatches(m: int) -> str | None:
    """The line `mpt plan`, `mpt simulate` and `mpt train` all give for more than `MAX_MICROBATCHES`
    micro-batches a step; None within the bound."""
    if m <= MAX_MICROBATCHES:
        return None
    return f"--microbatches {m} is more than a step schedules (at most {MAX_MICROBATCHES}: a step keeps every action)"


MAX_GLOBAL_BATCH = 1 << 24
"""Sequences a step may take (16.8 million: hundreds of times the largest published pretraining batch)."""


def too_large_global_batch(b: int) -> str | None:
    """The line `mpt plan --search` and `mpt train --global-batch` give for more than `MAX_GLOBAL_BATCH`
    sequences a step; None within the bound."""
    if b <= MAX_GLOBAL_BATCH:
        return None
    return f"--global-batch {b} is more sequences than a step takes (at most {MAX_GLOBAL_BATCH})"


def check_request(req: PlanRequest, shape: ModelShape, layers: int, optimizers: Mapping[str, OptimizerBytes]) -> None:
    """Every bad combination as one line; ``layers``: how many the model's layer list has; ``optimizers``:
    what each optimizer keeps (`cost.OPTIMIZER_BYTES`; an unknown one is the cost model's error)."""

    for name in ("pp", "tp", "dp", "cp", "micro_batch", "microbatches", "seq_len", "chunks"):
        v = getattr(req, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PartitionError(f"--{name.replace('_', '-')} {v!r} must be a positive integer")
    if too_many_microbatches(req.microbatches):
        raise PartitionError(too_many_microbatches(req.microbatches))
    if req.schedule not in SCHEDULES:
        raise PartitionError(f"unknown --schedule {req.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if not (req.method in PLAN_METHODS[:4] or req.method == "memory" or req.method.startswith("type:")):
        raise PartitionError(f"unknown --method {req.method!r}: choose one of {', '.join(PLAN_METHODS)}")
    if req.zero not in (0, 1):
        raise PartitionError(f"--zero {req.zero}: ZeRO stage 0 (off) or 1 (optimizer state partitioned over dp)")
    if req.momentum is not None and req.optimizer in optimizers:
        if optimizers[req.optimizer].momentum is None:
            takers = [name for name, o in optimizers.items() if o.momentum is not None]
            raise PartitionError(f"--momentum {req.momentum:g} is not an option of --optimizer {req.optimizer}: "
                                 f"it applies to {', '.join(takers)}")
        if not 0 <= req.momentum < 1:
            raise PartitionError(f"--momentum {req.momentum:g} must be in [0, 1)")
    if not (math.isfinite(req.weight_decay) and req.weight_decay >= 0):
        raise PartitionError(f"--weight-decay {req.weight_decay:g} must be a non-negative finite number")
    if req.precision not in PRECISIONS:
        raise PartitionError(f"unknown --precision {req.precision!r}: choose one of {', '.join(PRECISIONS)}")
    if req.memory_gb is not None and not (math.isfinite(req.memory_gb) and req.memory_gb > 0):
        raise PartitionError(f"--memory-gb {req.memory_gb:g} must be a positive finite number")
    stages = req.pp * req.chunks
    if stages > layers:
        what = f"--pp {req.pp}" if req.chunks == 1 else f"--pp {req.pp} x --chunks {req.chunks} = {stages} stages"
        raise PartitionError(f"{what} exceeds the model's {layers} layers: use at most {layers}")
    if req.schedule != "interleaved" and req.chunks != stages_per_rank(req.schedule):
        held = "two stages per rank in a V" if req.schedule in V_SCHEDULES else "one stage per rank"
        raise PartitionError(f"--chunks {req.chunks} needs --schedule interleaved: {req.schedule} runs {held}")
    if req.schedule == "dualpipev" and req.microbatches < 2 * req.pp:
        raise PartitionError(f"--schedule dualpipev needs --microbatches >= 2 x --pp = {2 * req.pp}, "
                             f"got {req.microbatches}")
    if req.schedule == "interleaved" and req.chunks > 1 and req.microbatches % req.pp:
        raise PartitionError(f"--schedule interleaved needs --microbatches a multiple of --pp {req.pp}, "
                             f"got {req.microbatches}")
    if req.cp > 1 and req.seq_len % (2 * req.cp):
        raise PartitionError(f"--cp {req.cp}: --seq-len {req.seq_len} must be a multiple of 2 x cp = {2 * req.cp} "
                             "(the zig-zag split)")
    if req.cp_attention not in ("ring", "ulysses"):
        raise PartitionError(f"unknown --cp-attention {req.cp_attention!r}: choose ring or ulysses")
    if req.cp > 1 and req.cp_attention == "ulysses" and shape.heads % (req.cp * req.tp):
        raise PartitionError(f"--cp-attention ulysses: cp x tp = {req.cp * req.tp} does not divide the model's "
                             f"{shape.heads} heads")
    if req.cp > 1 and shape.family not in ("gpt2", "llama"):
        raise PartitionError(f"--cp {req.cp}: context parallelism is built for the GPT-2 and Llama families only")
    if req.sequence_parallel and req.tp < 2:
        raise PartitionError(f"--sequence-parallel splits the sequence over the tensor-parallel ranks: it needs "
                             f"--tp 2 or more (got --tp {req.tp})")
    if req.sequence_parallel and req.seq_len % req.tp:
        raise PartitionError(f"--sequence-parallel: --seq-len {req.seq_len} must be a multiple of --tp {req.tp}")
    if req.tp > 1:
        for what, value in (("attention heads", shape.heads), ("key/value heads", shape.kvh),
                            ("MLP size", shape.ffn)):
            if value % req.tp:
                raise PartitionError(f"--tp {req.tp} does not divide the model's {what} ({value}): "
                                     f"choose a tp that divides {value}")
    if shape.positions and req.seq_len > shape.positions:
        raise PartitionError(f"--seq-len {req.seq_len} exceeds the model's {shape.positions} positions")
    if req.threads is not None and (isinstance(req.threads, bool) or not isinstance(req.threads, int)
                                    or req.threads < 1):
        raise PartitionError(f"--threads {req.threads!r} must be a positive integer")
    for name in ("tflops", "p2p_gbps", "mem_gbps", "p2p_latency_us"):
        v = getattr(req, name)
        if v is not None and not (math.isfinite(v) and (v > 0 or (name == "p2p_latency_us" and v == 0))):
            raise PartitionError(f"--{name.replace('_', '-')} {v:g} must be a positive finite number")
