"""This machine's device and cluster profile, measured (``mpt plan --profile-here OUT``, issue 36).

`measure_profile` returns a `cluster.ClusterProfile` with ``source: measured``; `write_profile`
writes it where ``--cluster`` reads it back. What each figure is, and how it is measured:

* **device**: ``cuda`` when torch sees a GPU (its name and memory from
  ``torch.cuda.get_device_properties(0)``, ``cores`` 0), else ``cpu``: the processor's name
  (``/proc/cpuinfo``), the machine's RAM as ``memory_gb`` (all ranks of the node share it) and the
  cores this process may run on as ``cores`` (``sched_getaffinity``: a container's or ``taskset``'s
  limit, not the machine's count).
* **tflops** per precision: the **sustained rate in the cost model's FLOPs of a block and the LM
  head, forward + backward, at the model's shapes** (`compute_rates.sustained_tflops`). One
  model_zoo block of the model and its head with the loss (the layers after the last block; a
  final norm between them is run but not counted) are built (`compute_rates.model_ends`: on meta,
  only those layers drawn) and timed for micro_batch x seq_len tokens inside `measure_layers`'
  rounds, as ``--method time`` times layers (a warm-up round, then the median of three, gradients
  accumulating over a round's micro-batches); the cost model's ``flops_fwd + flops_bwd`` of those
  layers (`cost.layer_costs` at tp 1) over that time, weighted as the model has them: n_layer
  blocks and one head, total FLOPs over total time. So the planner's FLOP times
  (`planner.layer_times`) carry what the FLOPs leave out: norms, GELU, softmax, dropout, the
  backward's products at their own shapes, the LM head's memory-bound softmax and cross-entropy.
  On a GPU each layer's forward + backward is timed with the device synchronised
  (`compute_rates.synced_layer_seconds`). Models model_zoo does not build (the Llama family,
  ``hf``) keep the matrix-product rate below as ``tflops``, and the note says so. What it still
  misses: the embedding and a final norm, which have no FLOPs in the cost model; the per-action
  overheads of a pipeline run (sends, receives, the executor); co-located ranks' contention for
  memory bandwidth (each rate is timed alone).
* **peak_tflops** per precision: the rate of the block's four forward matrix products at the
  model's shapes, for the same N = micro_batch x seq_len tokens: (N x h)(h x 3h), (N x h)(h x h),
  (N x h)(h x f), (N x f)(f x h), their FLOPs over the sum of each product's median time
  (`compute_rates.matmul_tflops`): the denominator of MFU. Small models' products are far from a
  processor's peak, which is why the shapes are the model's, not a large square.

  Both rates are of **one core** (one torch thread) on a ``cpu`` device, as `cluster.DeviceSpec`
  defines it: the planner shares the cores out among a node's ranks (`ClusterProfile.rank_tflops`).
  A precision the processor has no fast kernel for (bf16 or fp16 on a CPU without AVX-512 BF16 /
  FP16) is still recorded at its measured, low rates: that is what a run in it gets. Each is
  measured in a bounded time (`compute_rates.device_rates`): where the full products would take
  over a precision's share of ``RATE_BUDGET_S``, fewer token rows are timed; where a block and the
  head would take over its share of ``SUSTAINED_BUDGET_S``, fewer tokens
  (`compute_rates.timed_tokens`; the note says which): a slow kernel's rate does not depend on
  the tokens.
* **layer_overhead_us**: a layer call's fixed cost beside its FLOPs: the intercept of a block's
  forward + backward time over its FLOPs, the block timed at `compute_rates.OVERHEAD_TOKENS` (1 x 8
  tokens, FLOPs negligible) and at the model's micro-batch, fp32, the median of
  `compute_rates.OVERHEAD_REPEATS` such pairs (`compute_rates.layer_overhead_us`). ``tflops`` is then
  the rate net of it: the FLOPs of the blocks and the head over their time less the fixed cost of
  each layer timed, so that FLOPs / tflops + layers x layer_overhead_us gives back the time measured
  at the model's shapes. Per-operation dispatch, autograd and elementwise work on a CPU, kernel
  launches on a GPU: what makes a small model's step many times its FLOPs. The planner adds a third
  of it to every layer's forward and two thirds to its backward (the embedding and final norm
  included), scaled as the FLOP time is by a rank's threads.
* **thread_speedup** (``cpu``, more than one core): the block and the head at all the cores' threads
  against one thread, at the model's shapes: how much a rank with the whole node gains (1.0-1.2 for
  gpt-tiny's 32-wide products on a 2-core VM, 1.6-1.9 for gpt-small-cpu's).
* **comm_gb**: how much a link rank's memory grew over its round of messages (after the group
  exists; freed heap returned first; resident pages less file pages, as a training rank's peak is
  read, so the library code the round first runs is not counted): gloo's buffers and threads,
  NCCL's on a GPU. The planner adds it to each rank of a world over one rank.
* **mem_gbps**: a copy of a `COPY_BYTES` fp32 tensor (larger than a processor's last-level cache),
  bytes read plus bytes written over the median time; one thread on a CPU, as the optimizer step
  of one rank streams its states. Not the machine's total bandwidth over all cores.
* **runtime_gb**: what a rank holds before it holds a tensor. ``cpu``: the resident memory of a
  fresh interpreter that has imported torch and joined its process group (`link_rank`, measured in
  each rank started below, the largest kept); a training rank imports more of the toolkit and
  grows gloo's buffers with its messages, so this is a floor. ``cuda``: the device memory rank 0's
  CUDA context and communicator take (``torch.cuda.mem_get_info`` in the rank, less what was in
  use before it started).
* **links**: `ranks` processes (`link_rank`, one thread each) join a process group over
  127.0.0.1: gloo, or NCCL between GPUs where there are two or more (one GPU: gloo through host
  memory, and the note says so). Point-to-point: rank 0 sends a 1-element and a `LARGE_BYTES`
  message to rank 1 and back, each receive posted before its message arrives, as a pipeline's
  are (a blocking receive posted after the message arrived costs gloo a handshake: a ~4 ms round
  trip instead of ~0.3 ms on a 2-core VM); half the median round trips, fitted to `Link.p2p_s`
  (latency + bytes / bandwidth) through both points. All-reduce: both sizes over all ranks, each
  in a loop with about a millisecond of compute before it on every rank, the loop's mean time less
  the compute's alone (`link_rank.after_compute_s`: a rank's wait includes its peers' skew and
  waking their threads), fitted to the ring formula of `Link.allreduce_s` through both points.
  Loopback messages are memory copies between processes, not a network: ``intra_node`` is this
  host's, and ``inter_node`` repeats it, since one host has no other node to measure (the note
  says so); a cluster's inter-node figures come from its own profile file.

**Calibrated** (``calibrated=True``, ``mpt plan --profile-here OUT --calibrate``): three figures
fitted to five short ``mpt train`` runs of the model (`calibrate`): ``step_overhead_us``, what a
step of several ranks adds (its closing collectives as the ranks reach them), the collective
latency as a tensor-parallel step meets it (~1 ms here, against the loop's ~0.2-0.6 ms), and
``heap_gb``, what a rank holds at its peak beyond the planned tensors (~1 MB for gpt-tiny).

``nodes`` is 1; ``devices_per_node`` is `ranks` on a CPU (the ranks this machine runs) or the GPU
count. The whole measurement takes ~7 s on 2 idle cores for ``gpt-small-cpu`` at 2 ranks with the
three precisions (~14 s while other work shares the cores), most of it the ranks' ``import torch``.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import fields, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mp_toolkit.optim.master import PRECISIONS
from mp_toolkit.user_files import write_output

from .calibrate import calibrate
from .cluster import ClusterError, ClusterProfile, DeviceSpec, Link, profile_to_dict
from .compute_rates import device_rates, synced_seconds
from .cost import model_shape

__all__ = ["fit_link", "measure_links", "measure_profile", "write_profile"]

COPY_BYTES = 256 << 20
"""The tensor `copy_gbps` copies (twice the largest last-level cache of a CPU die we know of)."""
LARGE_BYTES = {"gloo": 4 << 20, "nccl": 64 << 20}
"""The large message of the link measurement: its time well above the latency on each backend."""
LINK_TIMEOUT_S = 90.0
"""A bound on the whole link measurement (the ranks' ``import torch`` included) and on each wait."""


def copy_gbps(device: torch.device, nbytes: int = COPY_BYTES, repeats: int = 3) -> float:
    """Bytes read plus bytes written by a copy of ``nbytes`` of fp32, over its median time."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # the first copy also faults the destination's pages in
    t = statistics.median(synced_seconds(lambda: dst.copy_(src), device) for _ in range(repeats))
    return 2 * src.numel() * 4 / t / 1e9


def fit_link(p2p_one_way_s: tuple[float, float], allreduce_s: tuple[float, float],
             nbytes: tuple[int, int], ranks: int) -> Link:
    """A `Link` whose `Link.p2p_s` and `Link.allreduce_s` pass through both measured sizes."""
    def through(times, factor: float, steps: int) -> tuple[float, float]:  # (GB/s, microseconds)
        (t_small, t_large), (n_small, n_large) = times, nbytes
        if t_large <= t_small:  # noise at the small size: the large time bounds the bandwidth alone
            return factor * n_large / t_large / 1e9, t_small / steps * 1e6
        per_byte = (t_large - t_small) / (factor * (n_large - n_small))
        return 1 / per_byte / 1e9, max(0.0, t_small - factor * n_small * per_byte) / steps * 1e6

    p2p_gbps, p2p_us = through(p2p_one_way_s, 1.0, 1)
    ar_gbps, ar_us = through(allreduce_s, 2 * (ranks - 1) / ranks, 2 * (ranks - 1))
    return Link(p2p_gbps=p2p_gbps, p2p_latency_us=p2p_us, collective_gbps=ar_gbps, collective_latency_us=ar_us)


def _loopback_env() -> dict[str, str]:
    """The ranks' environment: gloo's sockets on the loopback interface unless the user named one."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    loops = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if loops:
        env.setdefault("GLOO_SOCKET_IFNAME", loops[0])
    return env


def _run_ranks(ranks: int, backend: str, kind: str, timeout_s: float) -> list[dict]:
    """Start the `link_rank` processes, collect their JSON lines; every one is ended on the way out."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))  # loopback only; the store takes the open socket, so no race for the port
    listener.listen(128)
    port = listener.getsockname()[1]
    with listener:
        store = dist.TCPStore("127.0.0.1", port, ranks, is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=listener.fileno())
        listener.detach()  # the store owns the socket now and closes it when it goes
    argv = [backend, kind, str(LARGE_BYTES[backend]), str(timeout_s)]
    procs = [subprocess.Popen([sys.executable, "-m", "mp_toolkit.partition.link_rank", str(r), str(ranks), str(port),
                               *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_loopback_env())
             for r in range(ranks)]
    deadline = time.monotonic() + timeout_s
    try:
        results = []
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            if p.returncode != 0:
                last = (err.strip().splitlines() or [f"exit code {p.returncode}"])[-1]
                raise ClusterError(f"measuring the links: rank {r} of {ranks} failed: {last}; "
                                   "give the cluster's figures in a file instead (--cluster FILE)")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    except subprocess.TimeoutExpired:
        raise ClusterError(f"measuring the links: {ranks} {backend} ranks did not finish within {timeout_s:g} s "
                           "(a loaded machine?); give the cluster's figures in a file instead (--cluster FILE)"
                           ) from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        del store


def measure_links(ranks: int, backend: str = "gloo", kind: str = "cpu",
                  timeout_s: float = LINK_TIMEOUT_S) -> tuple[Link, float, float]:
    """(the link between ``ranks`` processes of this host, the largest runtime bytes a rank held, the most
    a rank's memory (its resident set less file pages, `memstats.anon_bytes`) grew over its round of
    messages: the process group's buffers and threads)."""
    rows = _run_ranks(ranks, backend, kind, timeout_s)
    first = rows[0]
    link = fit_link(tuple(t / 2 for t in first["p2p_round_trip_s"]), tuple(first["allreduce_s"]),
                    (first["small_bytes"], first["large_bytes"]), ranks)
    held = first["cuda_used_bytes"] if kind == "cuda" else max(r["rss_bytes"] for r in rows)
    grew = max(max(0, r.get("anon_after_bytes", r["anon_bytes"]) - r["anon_bytes"]) for r in rows)
    return link, float(held), float(grew)


def cpu_facts() -> tuple[str, float, int]:
    """(the processor's name, the machine's RAM in GB, the cores this process may use)."""
    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return name or platform.processor() or "cpu", ram, cores


def _checked(ranks: int, precisions, micro_batch: int, seq_len: int) -> tuple[str, ...]:
    for what, v, least in (("ranks", ranks, 2), ("micro_batch", micro_batch, 1), ("seq_len", seq_len, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ClusterError(f"--profile-here: {what} is {v!r}: it must be an integer of at least {least}")
    chosen = tuple(precisions or ("fp32", "bf16", "fp16"))
    bad = [p for p in chosen if p not in PRECISIONS]
    if bad:
        raise ClusterError(f"--profile-here: precision {bad[0]!r}: choose among {', '.join(PRECISIONS)}")
    return chosen if "fp32" in chosen else ("fp32", *chosen)  # a profile needs fp32 (`profile_from_dict`)


def _sig(v: float) -> float:
    """4 significant digits: more than the run-to-run noise of any of these figures."""
    return float(f"{v:.4g}")


def _sigs(rates: dict[str, float]) -> tuple[tuple[str, float], ...]:
    return tuple((p, _sig(t)) for p, t in rates.items())


def measure_profile(model: str = "gpt-small-cpu", ranks: int = 2, precisions=None, micro_batch: int = 8,
                    seq_len: int = 128, name: str | None = None, hf: bool = False,
                    calibrated: bool = False) -> ClusterProfile:
    """This machine's profile (the module docstring says what each figure is and is not);
    ``calibrated``: its run-pattern figures fitted to short runs of ``model`` (`calibrate`)."""
    chosen = _checked(ranks, precisions, micro_batch, seq_len)
    shape = model_shape(model, hf_modules=hf)
    host = socket.gethostname()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    tflops, peak, how, overhead, speedup = device_rates(model, shape, micro_batch, seq_len, chosen, device,
                                                        0 if gpus else cpu_facts()[2])
    mem = copy_gbps(device, COPY_BYTES * (4 if gpus else 1))  # HBM copies 256 MiB in a tenth of a millisecond
    how = f"measured on {host}; {how}"
    if gpus:
        props = torch.cuda.get_device_properties(0)
        dev_name, memory_gb, cores = props.name, props.total_memory / 1e9, 0
        backend, world = ("nccl", min(ranks, gpus)) if gpus >= 2 else ("gloo", ranks)
        torch.cuda.empty_cache()  # what this process holds on the device now is the baseline
        free, total = torch.cuda.mem_get_info(0)
        link, held, comm = measure_links(world, backend, "cuda")
        runtime = max(0.0, held - (total - free))
        links = (f"links over NCCL between {world} GPUs" if backend == "nccl" else
                 f"links over gloo between {world} processes through host memory (one GPU: no NCCL peer)")
    else:
        dev_name, memory_gb, cores = cpu_facts()
        link, runtime, comm = measure_links(ranks, "gloo", "cpu")
        links = f"links over gloo on 127.0.0.1 between {ranks} processes of one thread each"
        how += "; both of one core (one torch thread), mem_gbps of one thread"
    kind = device.type
    note = (f"{how}; {links}; one node: inter_node repeats intra_node (no second node measured), "
            "give a cluster's own figures in a --cluster file")
    spec = DeviceSpec(kind=kind, name=dev_name, memory_gb=_sig(memory_gb), tflops=_sigs(tflops), mem_gbps=_sig(mem),
                      runtime_gb=_sig(runtime / 1e9), cores=cores, peak_tflops=_sigs(peak),
                      layer_overhead_us=_sig(overhead) if overhead else 0.0, comm_gb=_sig(comm / 1e9) if comm else 0.0,
                      thread_speedup=_sig(speedup) if speedup != 1.0 else 0.0)
    link = Link(*(_sig(getattr(link, f.name)) for f in fields(Link)))
    profile = ClusterProfile(name=name or f"{host}-{kind}", source="measured", nodes=1,
                             devices_per_node=gpus or ranks, device=spec, intra_node=link, inter_node=link, note=note)
    if not calibrated or hf:
        return profile
    profile, said = calibrate(profile, model, micro_batch, min(seq_len, shape.positions or seq_len))
    return replace(profile, note=f"{profile.note}; {said}")


def write_profile(profile: ClusterProfile, path: str | Path) -> Path:
    """Write ``profile`` as JSON (`profile_to_dict`) whole or not at all (`write_output`); one line when it
    cannot be written."""
    write_output("--profile-here", path, json.dumps(profile_to_dict(profile), indent=2) + "\n")
    return Path(path)
