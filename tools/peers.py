"""The peers of `tools.bench_pipeline` and `tools.bench_memory`: one GPT workload trained by

* ``mpt``:       mp_toolkit's PipelineEngine (any schedule, any cut);
* ``deepspeed``: DeepSpeed's ``PipelineModule`` + ``deepspeed.initialize`` -> ``PipelineEngine.train_batch``;
* ``torch``:     ``torch.distributed.pipelining`` (``PipelineStage`` built by hand, one per stage of the
                 rank; every schedule of `TORCH_SCHEDULES`);
* ``single``:    one process, plain gradient accumulation over the same micro-batches.

Every peer is the real library. All build the same weights: ``torch.manual_seed(seed)`` then
``model_zoo.gpt.GPT`` (untied embedding and LM head, so no peer needs tied-weight machinery),
whose ordered layers each peer wraps its own way. All use torch's AdamW (foreach), no gradient
clipping, the mean loss over the micro-batches, and the same global batches. Under bf16 every
peer computes in bf16, accumulates the micro-batch gradients in bf16 and steps fp32 master
weights (DeepSpeed's BF16_Optimizer, which ZeRO stage 0 + pipeline selects; our MasterWeights;
`Fp32Masters` below for the torch and single peers).

One process per rank, started by `run_peer` (`tools.ranks.run_ranks`); `train` returns each rank's
step times, losses, parameter count, boundaries, and memory or profile figures when asked::

    run_peer({"peer": "mpt", "schedule": "1f1b", "workload": {...}, "warmup": 2, "steps": 5}, nprocs=2)
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from model_zoo.gpt import GPT, GPTConfig, lm_loss
from mp_toolkit.engine.pipeline import PipelineEngine
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.factory import build_optimizer
from mp_toolkit.optim.settings import Optim
from mp_toolkit.parallel.context import build_context
from mp_toolkit.partition import memstats
from mp_toolkit.recompute import StageRecompute, apply_recompute
from mp_toolkit.run.cut import plan_boundaries
from mp_toolkit.run.launch import init_distributed, launcher_env
from tools.held_outputs import HeldOutputs
from tools.profiler import Profiler
from tools.ranks import run_ranks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Workload:
    """The benchmarked training job (issue 8 defaults)."""

    n_layer: int = 8
    n_embd: int = 256
    n_head: int = 8
    seq_len: int = 128
    vocab: int = 8192
    micro_batch: int = 4
    microbatches: int = 8
    pp: int = 2
    threads: int = 1
    precision: str = "fp32"
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.01

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab, n_positions=self.seq_len, n_embd=self.n_embd, n_layer=self.n_layer,
                         n_head=self.n_head, tie_word_embeddings=False)

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches * self.micro_batch * self.seq_len

    @classmethod
    def from_dict(cls, d: dict) -> "Workload":
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def global_batch(w: Workload, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of global batch ``step``: (m * b, T) int64 each, the same for every peer."""
    g = torch.Generator().manual_seed(1000 * w.seed + step)
    ids = torch.randint(0, w.vocab, (w.microbatches * w.micro_batch, w.seq_len + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def split(x: torch.Tensor, y: torch.Tensor, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """m micro-batches of consecutive rows, as torch.distributed.pipelining splits a batch."""
    return list(zip(torch.tensor_split(x, m), torch.tensor_split(y, m)))


def fp32_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """lm_loss on fp32 logits (what our executor does under bf16; a no-op cast in fp32)."""
    return lm_loss(logits.float(), labels)


def adamw(w: Workload, params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(params), lr=w.lr, weight_decay=w.weight_decay, foreach=True)


def optimizer(w: Workload, spec: dict, named) -> torch.optim.Optimizer:
    """The peers' shared torch AdamW (foreach), or with ``spec["optimizer"] == "mpt"`` the one
    ``mpt train --optimizer adamw`` builds (`build_optimizer`: torch's fused AdamW kernel)."""
    if spec.get("optimizer") == "mpt":
        return build_optimizer(Optim("adamw", lr=w.lr, weight_decay=w.weight_decay), list(named))
    return adamw(w, (p for _, p in named))


class Fp32Masters:
    """AdamW over fp32 copies of bf16 parameters (the identity in fp32), for the torch and single peers."""

    def __init__(self, w: Workload, params):
        self.model = list(params)
        self.separate = any(p.dtype != torch.float32 for p in self.model)
        self.master = [nn.Parameter(p.detach().float().clone()) for p in self.model] if self.separate else self.model
        self.optimizer = adamw(w, self.master)

    def step(self) -> None:
        if self.separate:
            for p, m in zip(self.model, self.master):
                m.grad, p.grad = p.grad.float(), None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.separate:
            with torch.no_grad():
                torch._foreach_copy_(self.model, self.master)


def build_gpt(w: Workload) -> GPT:
    torch.manual_seed(w.seed)
    return GPT(w.gpt_config())


def _timeout(spec: dict) -> timedelta:
    return timedelta(seconds=max(30.0, spec.get("timeout_s", 600.0) / 2))


# --- the peers: each has .step(x, y) -> mean loss or None (ranks without the loss), .params, .boundaries


class MptPeer:
    """mp_toolkit's PipelineEngine; boundaries from the spec or our default ("parameters")."""

    def __init__(self, w: Workload, spec: dict):
        device = init_distributed(launcher_env(), _timeout(spec).total_seconds())
        ctx = build_context(w.pp, device=device)
        chunks = spec.get("chunks", 1)
        layers = LayerList.from_model(build_gpt(w))
        self.boundaries = spec.get("boundaries") or plan_boundaries(layers, w.pp, "parameters", chunks)
        if spec.get("recompute"):  # [[mode, layers or None], ...] per stage (`mp_toolkit.recompute`)
            apply_recompute(layers, self.boundaries, [StageRecompute(m, n) for m, n in spec["recompute"]])
        self.engine = PipelineEngine(layers, ctx, self.boundaries, w.microbatches, spec["schedule"],
                                     optimizer=lambda named: optimizer(w, spec, named), loss_fn=lm_loss,
                                     clip_grad=None, precision=w.precision, chunks=chunks,
                                     free_sent_outputs=spec.get("free_sent", True))
        del layers  # the stages keep this rank's layers; the rest of the model is freed
        self.params = sum(p.numel() for _, p in self.engine.named_parameters())
        self.dtype = str(self.engine.named_parameters()[0][1].dtype)
        self.m = w.microbatches

    def step(self, x, y):
        return self.engine.train_batch(iter(split(x, y, self.m))).loss


class DeepSpeedPeer:
    """DeepSpeed's pipeline engine over the same layers (built as ``mpt train --engine deepspeed`` builds
    it, `mp_toolkit.engine.deepspeed_pipe`); DeepSpeed's own partition_method."""

    def __init__(self, w: Workload, spec: dict):
        # DeepSpeed's import takes seconds and sets up its accelerator: only in this peer's processes
        from mp_toolkit.engine import deepspeed_pipe as ds_pipe
        from mp_toolkit.engine.deepspeed_bridge import deepspeed_config

        ds_pipe.init_deepspeed(torch.device("cpu"), _timeout(spec).total_seconds())
        module, named = ds_pipe.pipeline_module(LayerList.from_model(build_gpt(w)), w.pp, fp32_loss,
                                                partition_method=spec["partition"])
        params = [p for _, p in named]
        config = deepspeed_config(w.micro_batch, w.microbatches, dp=1, clip_grad=None, precision=w.precision)
        self.engine = ds_pipe.initialize(module, adamw(w, params), config)
        torch.set_num_threads(w.threads)  # whatever DeepSpeed's set-up chose, the same threads as the others
        self.boundaries = [int(b) for b in module.parts]
        self.params = sum(p.numel() for p in params)
        self.dtype = str(next(self.engine.module.parameters()).dtype)  # what it computes in
        self.m = w.microbatches

    def step(self, x, y):
        return float(self.engine.train_batch(data_iter=iter(split(x, y, self.m))))


TORCH_SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved": "ScheduleInterleaved1F1B",
                   "interleavedzb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}
"""Our names for torch.distributed.pipelining's schedules; the last four run several stages per rank."""
V_SHAPED = ("zbv", "dualpipev")  # rank r holds stages r and 2p-1-r; the others loop: stage s on rank s % p


def torch_stages_of(schedule: str, rank: int, world: int, num_stages: int) -> list[int]:
    """The stages ``rank`` holds under torch's ``schedule`` with ``num_stages`` stages on ``world`` ranks."""
    if schedule in V_SHAPED:
        if num_stages != 2 * world:
            raise ValueError(f"torch's {TORCH_SCHEDULES[schedule]} runs two stages per rank: pass {2 * world + 1} "
                             f"boundaries, not {num_stages + 1}")
        return [rank, num_stages - 1 - rank]
    return list(range(rank, num_stages, world))


class TorchPipePeer:
    """torch.distributed.pipelining: each stage's layers as an nn.Sequential in a PipelineStage (one per
    stage this rank holds), run by the torch schedule the spec names (`TORCH_SCHEDULES`)."""

    def __init__(self, w: Workload, spec: dict):
        env = launcher_env()
        rank, world = env.rank, env.world_size
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=_timeout(spec))
        layers = [m for _, m in build_gpt(w).named_layers()]
        self.boundaries = spec["boundaries"]
        num_stages = len(self.boundaries) - 1
        mine = torch_stages_of(spec["schedule"], rank, world, num_stages)
        subs = [nn.Sequential(*layers[self.boundaries[s]:self.boundaries[s + 1]]).to(DTYPES[w.precision])
                for s in mine]
        del layers
        stages = [pipelining.PipelineStage(sub, s, num_stages, torch.device("cpu")) for s, sub in zip(mine, subs)]
        schedule = getattr(pipelining, TORCH_SCHEDULES[spec["schedule"]])
        # scale_grads=True: gradients of the mean loss over the micro-batches, as the other peers
        self.schedule = schedule(stages if num_stages > world else stages[0], w.microbatches,
                                 loss_fn=fp32_loss, scale_grads=True)
        params = [p for sub in subs for p in sub.parameters()]
        self.masters = Fp32Masters(w, params)
        self.params = sum(p.numel() for p in params)
        self.dtype = str(params[0].dtype)
        self.first, self.last = 0 in mine, num_stages - 1 in mine

    def step(self, x, y):
        losses: list = []
        kwargs = {"target": y, "losses": losses} if self.last else {}
        self.schedule.step(*((x,) if self.first else ()), **kwargs, return_outputs=False)
        self.masters.step()
        return float(torch.stack([loss.detach().float() for loss in losses]).mean()) if losses else None


class SinglePeer:
    """One process: forward + backward of each micro-batch (loss / m), then one AdamW step."""

    def __init__(self, w: Workload, spec: dict):
        self.model = build_gpt(w).to(DTYPES[w.precision])
        self.masters = Fp32Masters(w, self.model.parameters())
        self.params = self.model.num_parameters()
        self.dtype = str(next(self.model.parameters()).dtype)
        self.boundaries = [0, len(self.model.named_layers())]
        self.m = w.microbatches

    def step(self, x, y):
        total = 0.0
        for xk, yk in split(x, y, self.m):
            loss = fp32_loss(self.model(xk), yk) / self.m
            loss.backward()
            total += loss.item()
        self.masters.step()
        return total


PEERS = {"mpt": MptPeer, "deepspeed": DeepSpeedPeer, "torch": TorchPipePeer, "single": SinglePeer}


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def train(spec: dict) -> dict:
    """Build the peer, run ``warmup + steps`` global batches; each timed from a barrier to this
    rank's end of the step (the step's time is the slowest rank's, taken by the parent), and its
    process CPU time (every thread; waiting costs none, so other load barely changes it)."""
    w = Workload.from_dict(spec["workload"])
    torch.set_num_threads(w.threads)
    memory = spec.get("memory", False)
    if memory or spec.get("map_large_blocks"):
        memstats.map_large_blocks()  # RSS then follows live tensors (slows CPU kernels: memory runs only)
    elif spec.get("keep_freed_memory"):
        # as `mpt train` keeps freed memory on CPU (freed pages reused, not re-faulted)
        memstats.DeviceMemory.of("cpu").keep_freed()
    if memory:
        memstats.warm_runtime()
    n_steps = spec["warmup"] + spec["steps"]
    profiler = None
    if spec.get("profile"):
        profiler = Profiler(spec)  # wraps our engine's functions before it is built
        n_steps += 1  # one more step under torch.profiler, not timed
    batches = [global_batch(w, i) for i in range(n_steps)]
    base = memstats.anon_bytes() if memory else 0
    peer = PEERS[spec["peer"]](w, spec)
    if memory:
        memstats.release_free_memory()
    if profiler is not None:
        profiler.attach(peer)
    times, cpu, losses = [], [], []
    for i, (x, y) in enumerate(batches):
        _barrier()
        with profiler.step(i >= spec["warmup"], op_profile=i == n_steps - 1) if profiler else nullcontext():
            t0, c0 = time.perf_counter(), time.process_time()
            loss = peer.step(x, y)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i < spec["warmup"] + spec["steps"]:
            times.append(dt)
            cpu.append(dc)
            losses.append(loss)
        if memory and i == 0:  # steady state: later steps' peak (the first adds one-time set-up)
            memstats.release_free_memory()
            memstats.reset_peak()
        if i == 0 and spec.get("held_outputs"):  # our executor exists from the first step on
            held = HeldOutputs(peer.engine.executor, peer.engine.p2p)
    _barrier()
    out = {"rank": dist.get_rank() if dist.is_initialized() else 0, "times": times, "cpu_times": cpu,
           "losses": losses, "params": peer.params, "dtype": peer.dtype, "boundaries": list(peer.boundaries),
           "threads": torch.get_num_threads(), "workload": asdict(w)}
    if memory:
        out["peak_bytes"] = memstats.peak_anon_bytes() - base  # as mpt train reads it: no library code
    if spec.get("held_outputs"):
        out["held_outputs_peak_bytes"] = held.peak
        out["freed_bytes_last_step"] = peer.engine.executor.freed_bytes
    if profiler is not None:
        out["profile"] = profiler.report(peer)
    return out


PEER_ENV = {"DS_ACCELERATOR": "cpu"}
"""Every peer runs on CPU: DeepSpeed would otherwise pick its accelerator from the machine."""


def run_peer(spec: dict, nprocs: int, timeout_s: float = 600.0, threads: int = 1) -> list[dict]:
    """`train` on ``nprocs`` ranks (`tools.ranks.run_ranks`); each rank's result in rank order."""
    return run_ranks("tools.peers:train", spec, nprocs, timeout_s=timeout_s, threads=threads, env=PEER_ENV)
