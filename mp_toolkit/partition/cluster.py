"""A device and cluster profile: what the planner turns FLOPs, bytes and messages into seconds and
capacities with (issue 36).

A profile is a JSON or YAML file (``mpt plan --cluster FILE``, ``mpt train --cluster FILE``)::

    {"name": "8 nodes of 8 H100 SXM", "source": "specification",
     "nodes": 8, "devices_per_node": 8,
     "device": {"kind": "cuda", "name": "NVIDIA H100 SXM5 80GB", "memory_gb": 80,
                "tflops": {"fp32": 67, "bf16": 989, "fp16": 989}, "mem_gbps": 3350,
                "runtime_gb": 0.6},
     "intra_node": {"p2p_gbps": 450, "p2p_latency_us": 10, "collective_gbps": 450, "collective_latency_us": 15},
     "inter_node": {"p2p_gbps": 50, "p2p_latency_us": 15, "collective_gbps": 50, "collective_latency_us": 25}}

``device.kind`` names the allocator the memory model follows: ``cpu`` (the glibc heap; a process's
resident memory) or ``cuda`` (the caching allocator; `CUDA_ALLOCATOR`). ``tflops`` is the sustained
matrix-product rate per precision of one device; on a ``cpu`` device it is the rate of **one core**
and ``cores`` says how many cores a node has: the ranks of a node share them (`rank_tflops`), which
is how an oversubscribed world (4 ranks on 2 cores) is described. ``runtime_gb`` is what each process
holds beside the model's tensors (a CUDA context, the interpreter and torch's libraries).
``source`` says where the figures come from: ``measured`` (``mpt plan --profile-here``),
``specification`` (a datasheet: peaks, so predicted times are lower bounds) or ``default``.

Ranks are laid on the grid with tp fastest, then dp, then pp (DESIGN.md invariant 3), so a tp
group never leaves a node when tp divides the devices of a node, a dp group leaves it when
tp x dp exceeds them, and a pipeline hop crosses nodes when tp x dp x (stage + 1) is a multiple of
them (`Placement`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

import yaml

from mp_toolkit.errors import ConfigError, PartitionError
from mp_toolkit.names import PRECISIONS
from mp_toolkit.user_files import parse_json, read_config_text

__all__ = ["ALLOCATORS", "ClusterError", "ClusterProfile", "DeviceSpec", "Link", "Placement", "SHIPPED",
           "default_profile", "read_profile", "shipped_profile"]

ALLOCATORS = ("cpu", "cuda")
PROFILE_SOURCES = ("measured", "specification", "default")
SHIPPED_DIR = Path(__file__).with_name("profiles")
PROFILE_FIELDS = ("name", "source", "note", "nodes", "devices_per_node", "device", "intra_node", "inter_node")
MAX_PROFILE_BYTES = 1 << 20
"""A profile is a few hundred bytes; a file larger than this is not one."""


class ClusterError(PartitionError):
    """A cluster profile that cannot be used: one line naming the field."""


@dataclass(frozen=True)
class Link:
    """One kind of connection: point-to-point and collective bandwidth (GB/s, one direction) and
    latency (microseconds per message, per collective step)."""

    p2p_gbps: float
    p2p_latency_us: float
    collective_gbps: float
    collective_latency_us: float

    def p2p_s(self, nbytes: float) -> float:
        return self.p2p_latency_us * 1e-6 + nbytes / (self.p2p_gbps * 1e9)

    def allreduce_s(self, nbytes: float, ranks: int) -> float:
        """Ring all-reduce: 2 (r-1)/r of the bytes over the wire, 2 (r-1) latency steps."""
        if ranks <= 1:
            return 0.0
        return (2 * (ranks - 1) / ranks * nbytes / (self.collective_gbps * 1e9)
                + 2 * (ranks - 1) * self.collective_latency_us * 1e-6)


@dataclass(frozen=True)
class DeviceSpec:
    """One device (a GPU, or on a CPU machine one rank's share of the cores)."""

    kind: str
    """The allocator: ``cpu`` or ``cuda``."""
    name: str
    memory_gb: float
    """Capacity of one device (``cpu``: the node's memory, shared by its ranks)."""
    tflops: tuple[tuple[str, float], ...]
    """Sustained matrix-product TFLOP/s per precision (``cpu``: of one core)."""
    mem_gbps: float
    """Memory bandwidth (GB/s) the optimizer step streams its bytes at."""
    runtime_gb: float = 0.0
    """Held by each process beside the model's tensors."""
    cores: int = 0
    """``cpu``: the cores of a node, which its ranks share; 0 on other kinds."""
    peak_tflops: tuple[tuple[str, float], ...] = ()
    """The datasheet's peak per precision, the denominator of MFU; empty: ``tflops``."""
    layer_overhead_us: float = 0.0
    """The fixed time of one layer's forward + backward beside its FLOPs (microseconds): per-operation
    dispatch, autograd and hook costs on a CPU, kernel launches on a GPU. ``--profile-here`` times a
    block at a handful of tokens, where FLOPs are negligible; 0: not described."""
    comm_gb: float = 0.0
    """What a rank that communicates (pp, tp or dp > 1) holds beyond its tensors and runtime: the process
    group's buffers and threads (gloo's; NCCL's on a GPU). ``--profile-here`` reads how a link rank's
    resident memory grew over its round of messages; 0: not described."""
    heap_gb: float = 0.0
    """What every training rank holds at its peak beyond the tensors the planner counts: the allocator's
    fragmentation (a small model's tensors are many blocks of a few kB) and the kernels' own buffers.
    ``--profile-here --calibrate`` reads it off a one-rank run of the model (`calibrate`); 0: not
    described."""
    step_overhead_us: float = 0.0
    """The fixed time a step adds on a world of more than one rank (microseconds): its closing
    collectives over every rank (the loss, the non-finite check, the gradient norm) as a run meets
    them, each rank arriving when its schedule ends. ``--profile-here --calibrate`` fits it to short
    runs of the model at pp 2 (`calibrate`); 0: not described."""
    thread_speedup: float = 0.0
    """``cpu``: how much faster one rank runs a model's layers with all ``cores`` threads than with one
    (1 to ``cores``; small matrices gain little from more threads); 0: not described, taken as ``cores``
    (linear). A rank with c threads gets 1 + (c - 1) / (cores - 1) of the gain beyond one thread."""

    def rate(self, precision: str) -> float:
        return dict(self.tflops)[precision]

    def peak(self, precision: str) -> float:
        return dict(self.peak_tflops or self.tflops)[precision]


@dataclass(frozen=True)
class ClusterProfile:
    name: str
    source: str
    """``measured``, ``specification`` or ``default``."""
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: Link
    inter_node: Link
    note: str = ""
    """Where the figures come from, in words (a datasheet's, or how and where they were measured)."""

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def describe(self) -> str:
        """The line every plan prints: which profile, and where its figures come from."""
        d = self.device
        where = {"measured": "measured", "specification": "specification figures, not measurements",
                 "default": "defaults, not measurements"}[self.source]
        return (f"profile: {self.name} ({where}): {self.nodes} x {self.devices_per_node} {d.name}, "
                f"{d.memory_gb:g} GB each, {', '.join(f'{p} {t:g}' for p, t in d.tflops)} TFLOP/s"
                f"{' per core' if d.kind == 'cpu' else ''}")

    def rank_tflops(self, precision: str, ranks_per_node: int, threads: int | None = None) -> float:
        """A rank's matrix-product rate: the device's, or on a ``cpu`` device its cores' share
        (``threads`` each, at most the cores over the node's ranks)."""
        d = self.device
        if d.kind != "cpu":
            return d.rate(precision)
        share = d.cores / max(1, ranks_per_node)  # cores per rank; under 1 when oversubscribed
        cores = min(threads, share) if threads else (math.floor(share) if share >= 1 else share)
        return d.rate(precision) * self.speedup(cores)

    def speedup(self, cores: float) -> float:
        """A ``cpu`` rank's speed with ``cores`` cores over one core's (`DeviceSpec.thread_speedup`);
        under one core, that share of it."""
        d = self.device
        if cores <= 1 or d.cores <= 1 or not d.thread_speedup:
            return cores
        return 1 + (min(cores, d.cores) - 1) * (d.thread_speedup - 1) / (d.cores - 1)

    def rank_memory_bytes(self, ranks_per_node: int) -> int:
        """What one rank may hold: the device's memory, or on a ``cpu`` device the node's share."""
        per = self.device.memory_gb * 1e9
        return int(per / max(1, ranks_per_node) if self.device.kind == "cpu" else per)

    def placement(self, tp: int, dp: int, pp: int) -> "Placement":
        return Placement(self, tp, dp, pp)


@dataclass(frozen=True)
class Placement:
    """Which link each communication of a (tp, dp, pp) grid crosses on ``cluster``."""

    cluster: ClusterProfile
    tp: int
    dp: int
    pp: int

    @property
    def ranks_per_node(self) -> int:
        return min(self.cluster.devices_per_node, self.tp * self.dp * self.pp)

    def _link(self, crosses: bool) -> Link:
        return self.cluster.inter_node if crosses else self.cluster.intra_node

    @property
    def tp_link(self) -> Link:
        return self._link(self.tp > self.cluster.devices_per_node)

    @property
    def dp_link(self) -> Link:
        return self._link(self.tp * self.dp > self.cluster.devices_per_node)

    def hop_link(self, rank: int, nxt: int) -> Link:
        """The link from pipeline rank ``rank``'s devices to pipeline rank ``nxt``'s (the ranks of two
        neighbouring stages: the schedule's ``stage_to_rank`` places them)."""
        g, span = self.cluster.devices_per_node, self.tp * self.dp
        first, second = rank * span, nxt * span
        return self._link(any((first + i) // g != (second + i) // g for i in range(span)))


def _positive(where: str, value, integer: bool = False, zero_ok: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        kind = "a positive integer" if integer else "a non-negative number" if zero_ok else "a positive number"
        raise ClusterError(f"{where} is {value!r}: it must be {kind}")
    return int(value) if integer else float(value)


def _section(doc: dict, key: str, source: str) -> dict:
    if key not in doc:
        raise ClusterError(f"{source}: the field {key!r} is missing")
    if not isinstance(doc[key], dict):
        raise ClusterError(f"{source}: {key!r} must be a mapping, not {type(doc[key]).__name__}")
    return doc[key]


def _link(doc: dict, key: str, source: str) -> Link:
    sec = _section(doc, key, source)
    values = {}
    for f in fields(Link):
        if f.name not in sec:
            raise ClusterError(f"{source}: the field {key}.{f.name} is missing")
        values[f.name] = _positive(f"{source}: {key}.{f.name}", sec[f.name], zero_ok=f.name.endswith("latency_us"))
    return Link(**values)


def _rates(sec: dict, key: str, source: str, required: bool) -> tuple[tuple[str, float], ...]:
    if key not in sec:
        if required:
            raise ClusterError(f"{source}: the field device.{key} is missing")
        return ()
    rates = sec[key]
    if not isinstance(rates, dict) or not rates:
        raise ClusterError(f"{source}: device.{key} must map precisions ({', '.join(PRECISIONS)}) to TFLOP/s")
    out = []
    for p, v in rates.items():
        if p not in PRECISIONS:
            raise ClusterError(f"{source}: device.{key} names precision {p!r}: choose among {', '.join(PRECISIONS)}")
        out.append((p, _positive(f"{source}: device.{key}.{p}", v)))
    return tuple(out)


def _speedup(dev: dict, cores: int, source: str) -> float:
    """``device.thread_speedup``: 0 (not described) or between 1 and the cores."""
    v = _positive(f"{source}: device.thread_speedup", dev.get("thread_speedup", 0.0), zero_ok=True)
    if v and not 1 <= v <= max(1, cores):
        raise ClusterError(f"{source}: device.thread_speedup is {v:g}: it is between 1 and device.cores "
                           f"({cores}), or 0 for linear")
    return v


def profile_from_dict(doc, source: str = "profile") -> ClusterProfile:
    """A `ClusterProfile` from a parsed file; every missing or non-positive field is one `ClusterError`."""
    if not isinstance(doc, dict):
        raise ClusterError(f"{source}: a cluster profile is a mapping of fields, not {type(doc).__name__}")
    unknown = sorted(set(doc) - set(PROFILE_FIELDS))
    if unknown:
        raise ClusterError(f"{source}: unknown field {unknown[0]!r}: the fields are {', '.join(PROFILE_FIELDS)}")
    dev = _section(doc, "device", source)
    kind = dev.get("kind")
    if kind not in ALLOCATORS:
        raise ClusterError(f"{source}: device.kind is {kind!r}: choose {' or '.join(ALLOCATORS)} (the allocator)")
    for key in ("nodes", "devices_per_node"):
        if key not in doc:
            raise ClusterError(f"{source}: the field {key!r} is missing")
    for key in ("memory_gb", "mem_gbps"):
        if key not in dev:
            raise ClusterError(f"{source}: the field device.{key} is missing")
    cores = 0
    if kind == "cpu":
        if "cores" not in dev:
            raise ClusterError(f"{source}: a cpu device needs device.cores, the cores its node's ranks share")
        cores = _positive(f"{source}: device.cores", dev["cores"], integer=True)
    src = doc.get("source", "specification")
    if src not in PROFILE_SOURCES:
        raise ClusterError(f"{source}: source is {src!r}: choose one of {', '.join(PROFILE_SOURCES)}")
    tflops = _rates(dev, "tflops", source, required=True)
    if "fp32" not in dict(tflops):
        raise ClusterError(f"{source}: device.tflops needs an fp32 rate (the precision every run may use)")
    return ClusterProfile(
        name=str(doc.get("name") or Path(source).stem), source=src,
        nodes=_positive(f"{source}: nodes", doc["nodes"], integer=True),
        devices_per_node=_positive(f"{source}: devices_per_node", doc["devices_per_node"], integer=True),
        device=DeviceSpec(kind=kind, name=str(dev.get("name") or kind),
                          memory_gb=_positive(f"{source}: device.memory_gb", dev["memory_gb"]),
                          tflops=tflops, mem_gbps=_positive(f"{source}: device.mem_gbps", dev["mem_gbps"]),
                          runtime_gb=_positive(f"{source}: device.runtime_gb", dev.get("runtime_gb", 0.0),
                                               zero_ok=True),
                          cores=cores, peak_tflops=_rates(dev, "peak_tflops", source, required=False),
                          layer_overhead_us=_positive(f"{source}: device.layer_overhead_us",
                                                      dev.get("layer_overhead_us", 0.0), zero_ok=True),
                          comm_gb=_positive(f"{source}: device.comm_gb", dev.get("comm_gb", 0.0), zero_ok=True),
                          heap_gb=_positive(f"{source}: device.heap_gb", dev.get("heap_gb", 0.0), zero_ok=True),
                          step_overhead_us=_positive(f"{source}: device.step_overhead_us",
                                                     dev.get("step_overhead_us", 0.0), zero_ok=True),
                          thread_speedup=_speedup(dev, cores, source)),
        intra_node=_link(doc, "intra_node", source), inter_node=_link(doc, "inter_node", source),
        note=str(doc.get("note") or ""))


def profile_to_dict(p: ClusterProfile) -> dict:
    """What `read_profile` reads back (``mpt plan --profile-here`` writes it)."""
    d = p.device
    device = {"kind": d.kind, "name": d.name, "memory_gb": d.memory_gb, "tflops": dict(d.tflops),
              "mem_gbps": d.mem_gbps, "runtime_gb": d.runtime_gb}
    if d.kind == "cpu":
        device["cores"] = d.cores
    if d.peak_tflops:
        device["peak_tflops"] = dict(d.peak_tflops)
    if d.layer_overhead_us:
        device["layer_overhead_us"] = d.layer_overhead_us
    if d.comm_gb:
        device["comm_gb"] = d.comm_gb
    if d.heap_gb:
        device["heap_gb"] = d.heap_gb
    if d.step_overhead_us:
        device["step_overhead_us"] = d.step_overhead_us
    if d.thread_speedup:
        device["thread_speedup"] = d.thread_speedup
    link = lambda k: {f.name: getattr(k, f.name) for f in fields(Link)}
    return {"name": p.name, "source": p.source, **({"note": p.note} if p.note else {}), "nodes": p.nodes,
            "devices_per_node": p.devices_per_node, "device": device, "intra_node": link(p.intra_node),
            "inter_node": link(p.inter_node)}


def read_profile(path: str | Path) -> ClusterProfile:
    """A profile file (``.json``, ``.yaml`` / ``.yml``) or the name of a shipped one (`SHIPPED`)."""
    p = Path(path)
    if not p.exists() and str(path) in SHIPPED:
        p = SHIPPED_DIR / f"{path}.yaml"
    if not p.exists() and not p.is_symlink():
        raise ClusterError(f"--cluster {path}: no such file (shipped profiles: {', '.join(SHIPPED)})")
    try:
        text = read_config_text(p, "--cluster", MAX_PROFILE_BYTES)
    except ConfigError as e:
        raise ClusterError(str(e)) from None
    try:
        doc = yaml.safe_load(text) if p.suffix in (".yaml", ".yml") else parse_json(text)
    except (ValueError, yaml.YAMLError, RecursionError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ClusterError(f"--cluster {path}: not valid {'YAML' if p.suffix in ('.yaml', '.yml') else 'JSON'}: "
                           f"{first}") from None
    return profile_from_dict(doc, str(path))


def _shipped() -> tuple[str, ...]:
    return tuple(sorted(f.stem for f in SHIPPED_DIR.glob("*.yaml"))) if SHIPPED_DIR.is_dir() else ()


SHIPPED = _shipped()
"""The profiles shipped beside this module (from public specifications): pass the name to ``--cluster``."""


def shipped_profile(name: str, nodes: int | None = None) -> ClusterProfile:
    """A shipped profile, with ``nodes`` nodes instead of its own count when given."""
    p = read_profile(SHIPPED_DIR / f"{name}.yaml")
    return p if nodes is None else replace(p, nodes=nodes)


CUDA_SHIPPED = (("H200", "h200-sxm"), ("H100", "h100-sxm"), ("A100", "a100-sxm-80gb"), ("L4", "l4"))
"""A CUDA device name's shipped profile (the first whose key the name contains)."""
CPU_DEFAULT_TFLOPS = 0.05
"""fp32 TFLOP/s of one core in the CPU default profile: the order of a block's forward + backward on
the AVX2 EPYC and AVX-512 Xeons this project is tested on (a matrix product alone runs 0.06-0.08);
bf16 and fp16 at the same rate (machines with AMX run them faster: measure with --profile-here)."""
CPU_DEFAULT_LINK = Link(p2p_gbps=3.0, p2p_latency_us=150.0, collective_gbps=3.0, collective_latency_us=150.0)
"""gloo over loopback on one host (the figures `mpt plan`'s flags default to)."""


def default_profile(devices: int, cuda_name: str | None = None, cuda_memory_gb: float = 0.0,
                    cores: int = 1, memory_gb: float = 0.0) -> ClusterProfile:
    """The profile of this device kind when none is given: a CUDA device's shipped profile by its name
    (its figures, this device's memory), else the H100's figures marked as a default; on a CPU, one node
    of ``devices`` ranks sharing ``cores`` cores and ``memory_gb``, at `CPU_DEFAULT_TFLOPS` per core.
    Every input is a fact of the machine, so every rank of a run derives the same profile."""
    per_node = max(1, devices)
    if cuda_name is not None:
        name = next((ship for key, ship in CUDA_SHIPPED if key in cuda_name), None)
        base = shipped_profile(name or "h100-sxm")
        dev = replace(base.device, memory_gb=cuda_memory_gb or base.device.memory_gb, name=cuda_name)
        g = base.devices_per_node
        return replace(base, source=base.source if name else "default", device=dev,
                       nodes=max(1, -(-devices // g)), name=base.name if name else f"default for {cuda_name}")
    rates = tuple((p, CPU_DEFAULT_TFLOPS) for p in PRECISIONS)
    dev = DeviceSpec(kind="cpu", name="this CPU", memory_gb=memory_gb or 1.0, tflops=rates, mem_gbps=8.0,
                     runtime_gb=0.0, cores=max(1, cores))
    return ClusterProfile(name="cpu default", source="default", nodes=1, devices_per_node=per_node, device=dev,
                          intra_node=CPU_DEFAULT_LINK, inter_node=CPU_DEFAULT_LINK)
