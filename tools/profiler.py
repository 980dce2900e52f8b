"""The rank side of ``python -m tools.bench_pipeline --profile`` (`tools.pipeline_profile`): `Profiler`,
created by `tools.peers.train` before the engine is built, wraps timers around the engine's own
functions -- nothing in the library is edited, the wrappers live only in the profiled process:

* compute: ``Executor._forward`` / ``_backward`` (and ZB-H1's ``_backward_input`` / ``_backward_weight``),
  per stage and per micro-batch;
* p2p: ``P2P.post`` (one batched call: its receives, and the next batch's where posted ahead; the
  post alone is ``dist.batch_isend_irecv``), ``Received.wait`` (waiting for a received message when
  the action that reads it runs) and ``P2P.wait_sends`` (forward sends waited for before their
  outputs are freed, and the rest at the end of the schedule);
* the step: ``OptimizerStep.__call__`` split into unscale (``grads_to_master``), the
  gradients' 2-norms (one pass, for the inf/nan test and the norm), the inf/nan test on them,
  the overflow all-reduce, the global norm (with its all-reduce), the optimizer step;
* ``global_mean_loss`` (the loss broadcast), and what is left: executor bookkeeping;
* for DeepSpeed's engine, each of its schedule instructions (``PipelineEngine._INSTRUCTION_MAP``).

After the steps, `ping_pong` times one activation message on its own, and the last step runs
under torch.profiler for the top operators. Not imported by the library.
"""
from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from mp_toolkit.engine import executor, pipeline, step
from mp_toolkit.optim import master
from mp_toolkit.parallel import p2p

TOP_OPS = 12


class Profiler:
    """Accumulates wall time per category over the timed steps of one rank."""

    def __init__(self, spec: dict):
        self.timed = False
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.actions: dict[str, list[float]] = defaultdict(list)  # "F s0" -> per micro-batch seconds
        self.actions_cpu: dict[str, list[float]] = defaultdict(list)  # the same in this thread's CPU time
        self.step_cpu: list[float] = []  # process CPU seconds (all threads) per timed step
        self.steps = 0
        self.torch_ops = None
        self.spec = spec
        if spec["peer"] == "deepspeed":
            self._patch_deepspeed()
        else:
            self._patch()

    # --- wrapping --------------------------------------------------------------------------
    def _add(self, key: str, dt: float) -> None:
        if self.timed:
            self.totals[key] += dt
            self.calls[key] += 1

    def _wrap(self, owner, name: str, key):
        original = owner[name] if isinstance(owner, dict) else getattr(owner, name)
        prof = self

        def wrapper(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                k = key(*args, **kwargs) if callable(key) else key
                prof._add(k, dt)
                if callable(key) and prof.timed:
                    prof.actions[k].append(dt)
                    prof.actions_cpu[k].append(time.thread_time() - c0)

        if isinstance(owner, dict):
            owner[name] = wrapper
        else:
            setattr(owner, name, wrapper)

    def _patch(self) -> None:
        for name, kind in (("_forward", "F"), ("_backward", "B"), ("_backward_input", "I"), ("_backward_weight", "W")):
            self._wrap(executor.Executor, name, lambda _self, a, kind=kind: f"{kind} s{a.stage}")
        self._wrap(executor.Executor, "run", "schedule (Executor.run)")
        if hasattr(p2p, "Received"):  # receives waited for where they are read
            self._wrap(p2p.P2P, "post", "p2p exchange")
            self._wrap(p2p.Received, "wait", "p2p recv wait")
        else:  # before issue 23: exchange posted and waited for its receives at once
            self._wrap(p2p.P2P, "exchange", "p2p exchange")
        self._wrap(p2p.dist, "batch_isend_irecv", "p2p post")
        self._wrap(p2p.P2P, "wait_sends", "p2p wait_sends")
        self._wrap(step.OptimizerStep, "__call__", "optimizer step (all)")
        self._wrap(master.MasterWeights, "grads_to_master", "step: grads_to_master")
        self._wrap(step, "tensor_norms", "step: grad 2-norms (inf/nan + norm)")
        self._wrap(step, "has_inf_or_nan", "step: inf/nan scan")
        self._wrap(step, "any_rank_true", "step: overflow all-reduce")
        self._wrap(step, "global_grad_norm", "step: grad norm + all-reduce")
        self._wrap(master.MasterWeights, "zero_grad", "step: zero_grad")
        self._wrap(pipeline, "global_mean_loss", "loss broadcast")

    def _patch_deepspeed(self) -> None:
        """DeepSpeed's pipeline engine runs each schedule instruction through ``_INSTRUCTION_MAP``."""
        from deepspeed.runtime.pipe.engine import PipelineEngine  # DeepSpeed's import: its peer's ranks only

        table = PipelineEngine._INSTRUCTION_MAP
        stage = os.environ.get("RANK", "0")  # one stage per rank
        for cls in list(table):
            holder = {"f": table[cls]}
            self._wrap(holder, "f", lambda *a, name=cls.__name__, **k: f"{name} s{stage}")
            table[cls] = holder["f"]

    def attach(self, peer) -> None:
        """Time the optimizer's own step (an instance attribute, so only this engine's)."""
        if self.spec["peer"] == "mpt":
            self._wrap(peer.engine.optimizer, "step", "step: AdamW")

    @contextmanager
    def step(self, timed: bool, op_profile: bool = False):
        """Time one step (``timed``), or record torch.profiler's op table for it instead."""
        if op_profile:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                yield
            ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:TOP_OPS]
            self.torch_ops = [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in ops]
            return
        self.timed = timed
        self.steps += int(timed)
        c0 = time.process_time()
        try:
            yield
        finally:
            self.timed = False
            if timed:
                self.step_cpu.append(time.process_time() - c0)

    # --- after training ----------------------------------------------------------------------
    def report(self, peer) -> dict:
        per_step = {k: 1e3 * v / max(1, self.steps) for k, v in self.totals.items()}
        action_ms = {k: 1e3 * statistics.median(v) for k, v in self.actions.items()}
        action_cpu_ms = {k: 1e3 * statistics.median(v) for k, v in self.actions_cpu.items()}
        return {"ms_per_step": per_step, "calls_per_step": {k: v / max(1, self.steps) for k, v in self.calls.items()},
                "action_median_ms": action_ms, "action_median_cpu_ms": action_cpu_ms,
                "cpu_ms_per_step": 1e3 * statistics.median(self.step_cpu) if self.step_cpu else None,
                "p2p_one_way_ms": ping_pong(peer), "torch_ops": self.torch_ops, "receives": receive_stats(peer)}


def receive_stats(peer) -> dict | None:
    """Receive buffers the transport allocated and reused, receives posted a batch ahead (issue 23)."""
    engine = getattr(peer, "engine", None)
    pool = getattr(getattr(engine, "p2p", None), "recv_buffers", None)
    if pool is None:
        return None
    return {"buffers_allocated": pool.allocated, "buffers_reused": pool.reused, "buffer_bytes": pool.bytes,
            "posted_ahead": engine.executor.posted_ahead}


def ping_pong(peer, repeats: int = 20) -> dict:
    """One-way time of a message the size of one stage's activations between ranks 0 and 1, sent
    as the engine sends it (batch_isend_irecv of preallocated buffers), and of a 4-byte message."""
    ours = getattr(peer.engine, "executor", None)
    rank = dist.get_rank()
    received = ours.input_specs[0] if ours is not None and ours.input_specs else {}  # the last step's
    spec = next(iter(received.values()), None)
    shape = spec[0].shape if spec else (4, 128, 256)
    dtype = spec[0].dtype if spec else torch.float32
    out = {}
    for label, buf in (("activation", torch.zeros(shape, dtype=dtype)), ("4 bytes", torch.zeros(1))):
        peer_rank = 1 - rank if rank < 2 else None
        if peer_rank is None:
            continue
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                for wk in dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, 1)]):
                    wk.wait()
                for wk in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 1)]):
                    wk.wait()
            else:
                for wk in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 0)]):
                    wk.wait()
                for wk in dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, 0)]):
                    wk.wait()
            times.append((time.perf_counter() - t0) / 2)
        out[label] = {"bytes": buf.numel() * buf.element_size(), "ms": 1e3 * statistics.median(times)}
    return out
