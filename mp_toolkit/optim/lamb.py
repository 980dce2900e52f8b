"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2).

Per tensor ``w`` with gradient ``g`` at step ``t``::

    m = b1 m + (1 - b1) g                 v = b2 v + (1 - b2) g^2
    m_hat = m / (1 - b1^t)                v_hat = v / (1 - b2^t)     (bias_correction=True)
    r = m_hat / (sqrt(v_hat) + eps)       eps outside the square root
    u = r + wd w                          decoupled weight decay, inside the update
    trust = ||w|| / ||u||                 1 when either norm is 0, else clamped to [min_trust, max_trust]
    w = w - lr trust u

A group with ``adapt=False`` uses trust 1. ``max_grad_norm`` turns on NVLAMB's global
pre-normalisation: every gradient is divided by ``max(1, ||g_all|| / max_grad_norm)`` first.

A group with ``correct_step_size=True`` follows DeepSpeed's FusedLamb (``csrc/lamb``) instead: the
moments stay uncorrected in the direction and the correction scales the step::

    u = m / (sqrt(v) + eps) + wd w        trust = ||w|| / ||u||  (1 when either is 0, else clamped)
    w = w - lr c trust u                  c = sqrt(1 - b2^t) / (1 - b1^t)  (1 without bias_correction)

It differs from the rule above only with bias correction on (eps and the decay term meet the
uncorrected moments, so the trust ratio differs). ``rule="deepspeed"`` in `build_optimizer` sets it
and adapts every tensor, 1-D ones included, as FusedLamb does (`names.LAMB_RULES`).

Tensor parallelism: for a shard (``p.tensor_model_parallel = True``) ``||w||^2`` and ``||u||^2`` are
summed over ``tp_group`` in one all-reduce per step for all shards together, so its trust ratio is
the whole tensor's; no traffic ever crosses pipeline stages. ZeRO-1 (a tensor is a rank's piece of
a parameter, ``p.zero_piece``): the partial squares of the tensors split between data-parallel
ranks are summed over the dp group first, in one more all-reduce per step
(`mp_toolkit.optim.groups.whole_tensor_squares`). A step with no gradient to apply still joins
both all-reduces with zero rows, so the ranks that do step are not left waiting.

The multi-tensor path (default on CPU and CUDA) makes two passes over memory. Pass 1 walks the
tensors in cache-sized *waves* of chunks: ``s = wd w`` in a wave scratch, then one fused kernel
(torch's multi-tensor Adam, ``torch._fused_adam_``, with ``lr = -1``: it computes
``s - lr m_hat / (sqrt(v_hat) + eps) = u`` while updating m and v in the same sweep over g, m, v);
the chunk norms of w and u are taken while the wave is in cache and u is stored into the gradient's
memory (as apex's FusedLAMB does). Pass 2 is ``w -= lr trust u``, one sweep per tensor. Without
``torch._fused_adam_`` the same wave is computed with ``torch._foreach_*`` ops.

**The step consumes the gradients:** afterwards each ``p.grad`` holds the update direction ``u``
(both paths). Zero the gradients before the next backward, as every training loop does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mp_toolkit.optim.groups import (
    allreduce_sharded_squares,
    check_betas,
    check_hparam,
    evaluate_closure,
    is_tensor_parallel,
    optional_hparam,
    whole_tensor_squares,
)

_WAVE = {"cpu": 1 << 18, "cuda": 1 << 22}
"""Elements per wave. CPU: 1 MiB per operand, so a wave's w, g, m, v and scratch (5 MiB) stay in
cache between the few ops of pass 1 (measured best of 2^16..2^19 with tools/bench_optim.py)."""
_ALIGN = 16
"""Scratch chunks start at multiples of 16 elements (64 bytes): BLAS's dot, which takes the norms
on CPU, rounds differently at different alignments."""
_HAS_FUSED_ADAM = hasattr(torch, "_fused_adam_")


@dataclass(frozen=True)
class _Plan:
    """How a list of tensors (by numel) is cut into chunks and the chunks into waves."""

    sizes: tuple[tuple[int, ...], ...]              # chunk sizes of each tensor
    waves: tuple[tuple[tuple[int, int], ...], ...]  # per wave: (tensor index, chunk index)
    offsets: tuple[tuple[int, ...], ...]            # per wave: each chunk's offset in the scratch
    owner: torch.Tensor                             # tensor index of every chunk, in wave order


@dataclass(frozen=True)
class _Wave:
    """One wave's chunk views (params, moments, scratch) and the step tensor of each chunk."""

    chunks: tuple[tuple[int, int], ...]
    p: list[torch.Tensor]
    m: list[torch.Tensor]
    v: list[torch.Tensor]
    s: list[torch.Tensor]
    steps: list[torch.Tensor]


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _plan(numels: tuple[int, ...], wave: int) -> _Plan:
    """Cut each tensor at offsets 0, wave, 2 wave, ... and pack whole chunks into waves whose
    scratch (chunks at 64-byte aligned offsets) holds at most ``wave`` elements.

    A tensor's chunks and their scratch alignment never depend on its neighbours, so its update
    and trust ratio are bitwise the same whichever other tensors share the optimizer (a pipeline
    stage holds a subset of the unsplit model's tensors: DESIGN.md invariant 1).
    """
    sizes = tuple(tuple(min(wave, n - off) for off in range(0, n, wave)) for n in numels)
    waves: list[list[tuple[int, int]]] = []
    offsets: list[list[int]] = []
    fill = wave
    for i, chunk_sizes in enumerate(sizes):
        for c, k in enumerate(chunk_sizes):
            if _align(fill) + k > wave:
                waves.append([])
                offsets.append([])
                fill = 0
            waves[-1].append((i, c))
            offsets[-1].append(_align(fill))
            fill = _align(fill) + k
    owner = torch.tensor([i for w in waves for i, _ in w], dtype=torch.long)
    return _Plan(sizes, tuple(map(tuple, waves)), tuple(map(tuple, offsets)), owner)


class LAMB(torch.optim.Optimizer):
    """LAMB with per-tensor trust ratios that are tensor-parallel aware (see the module docstring).

    Args:
        params: tensors or param groups; a group may set ``adapt`` (default True), ``lr``,
            ``betas``, ``eps``, ``weight_decay``, ``bias_correction``, ``min_trust``, ``max_trust``,
            ``correct_step_size`` (default False; True: FusedLamb's placement of the bias correction).
        min_trust, max_trust: clamp of the trust ratio (DeepSpeed's ``min_coeff`` / ``max_coeff``);
            None means unbounded. The ratio 1 used for a zero norm is not clamped (as DeepSpeed).
        max_grad_norm: NVLAMB global gradient pre-normalisation; None (default) is off.
        foreach: multi-tensor path; None means True when every param is on CPU or CUDA. Tensors it
            cannot take (other devices, non-contiguous ones) go through the per-tensor loop.
        tp_group: the tensor-parallel process group, or None.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, bias_correction: bool = True, min_trust: float | None = None,
                 max_trust: float | None = None, max_grad_norm: float | None = None,
                 foreach: bool | None = None, tp_group=None):
        optional_hparam("LAMB", "max_grad_norm", max_grad_norm, positive=True)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        min_trust=min_trust, max_trust=max_trust, adapt=True, correct_step_size=False)
        super().__init__(params, defaults)
        self.max_grad_norm, self.foreach, self.tp_group = max_grad_norm, foreach, tp_group
        self._last: dict[torch.Tensor, float] = {}
        self._waves: dict[tuple, tuple] = {}      # per bucket: (signature, plan, waves)
        self._scratch: dict[tuple, torch.Tensor] = {}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        for name in ("lr", "eps", "weight_decay"):
            check_hparam("LAMB", name, g[name])
        check_betas("LAMB", g["betas"])
        optional_hparam("LAMB", "min_trust", g["min_trust"])
        optional_hparam("LAMB", "max_trust", g["max_trust"])
        if g["min_trust"] is not None and g["max_trust"] is not None and g["min_trust"] > g["max_trust"]:
            raise ValueError(f"LAMB: min_trust ({g['min_trust']}) must not exceed max_trust ({g['max_trust']})")

    @property
    def trust_rule(self) -> str:
        """The rule the trust ratios follow, for the metrics' rows: "deepspeed" (FusedLamb's) when a
        group corrects the step size, else "mp_toolkit" (`names.LAMB_RULES`)."""
        return "deepspeed" if any(g.get("correct_step_size", False) for g in self.param_groups) else "mp_toolkit"

    def last_trust_ratios(self) -> dict[torch.Tensor, float]:
        """The trust ratio each tensor's update used in the last step (1.0 where ``adapt=False``),
        keyed by parameter; tensors without a gradient in that step are absent."""
        return dict(self._last)

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        work = [(g, self._tensors(g)) for g in self.param_groups]
        work = [(g, t) for g, t in work if t[0]]
        if not work:  # nothing to step, but the others' whole-tensor sums wait for this rank's share
            self._last = {}
            held = [p for g in self.param_groups for p in g["params"]]
            if held:  # zero rows (ZeRO-1: a replica may own no element of any tensor)
                whole_tensor_squares(held[0].new_zeros(len(held), 2, dtype=torch.float64), held, self.tp_group)
            return loss
        scale = self._pre_normalisation([p for _, t in work for p in t[0]])
        order, rows = [], []
        for group, tensors in work:
            for ps, sq in self._directions(group, *tensors, scale):
                order += [(p, group) for p in ps]
                rows.append(sq.to(rows[0].device) if rows else sq)
        squares = whole_tensor_squares(torch.cat(rows), [p for p, _ in order], self.tp_group)
        self._apply(order, squares)
        return loss

    def _tensors(self, group: dict):
        """(params, grads, exp_avgs, exp_avg_sqs, steps) of the group's params that have a gradient."""
        ps, gs, ms, vs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse or p.grad.dtype != p.dtype:
                raise RuntimeError(f"LAMB needs dense gradients of the parameter's dtype {p.dtype}, "
                                   f"got {p.grad.layout} {p.grad.dtype}")
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            ps.append(p), gs.append(p.grad), ms.append(state["exp_avg"]), vs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        return ps, gs, ms, vs, steps

    def _pre_normalisation(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        """NVLAMB: max(1, ||all grads|| / max_grad_norm) (shards summed over tp_group), or None."""
        if self.max_grad_norm is None:
            return None
        if any(hasattr(p, "zero_piece") for p in params):
            raise RuntimeError("LAMB's max_grad_norm (NVLAMB pre-normalisation) is per rank and would differ "
                               "between ZeRO-1 shards: clip by the global norm instead")
        norms = torch._foreach_norm([p.grad for p in params])
        sq = torch.stack([n.double().to(norms[0].device) for n in norms]).square().unsqueeze(1)
        sq = allreduce_sharded_squares(sq, [is_tensor_parallel(p) for p in params], self.tp_group)
        return (sq.sum().sqrt() / self.max_grad_norm).clamp(min=1.0).float()

    def _directions(self, group, ps, gs, ms, vs, steps, scale):
        """Yield (params, squared norms (k, 2) of [w, u]) per bucket; u is left in each grad."""
        use_foreach = self.foreach if self.foreach is not None else all(p.device.type in _WAVE for p in ps)
        buckets: dict[tuple, list[int]] = {}
        single = []
        for i, p in enumerate(ps):
            fast = (use_foreach and p.device.type in _WAVE and p.is_floating_point()
                    and all(t.is_contiguous() for t in (p, gs[i], ms[i], vs[i])))
            (buckets.setdefault((p.device, p.dtype), []) if fast else single).append(i)
        for idx in buckets.values():
            pick = lambda xs, idx=idx: [xs[i] for i in idx]
            yield pick(ps), self._wave_pass(group, pick(ps), pick(gs), pick(ms), pick(vs), pick(steps), scale)
        if single:
            rows = [_single_direction(group, ps[i], gs[i], ms[i], vs[i], steps[i], scale) for i in single]
            yield [ps[i] for i in single], torch.stack(rows)

    def _wave_pass(self, group, ps, gs, ms, vs, steps, scale) -> torch.Tensor:
        """Pass 1 of the multi-tensor path over one (device, dtype) bucket."""
        plan, waves = self._waves_of(group, ps, ms, vs, steps)
        wd, device = group["weight_decay"], ps[0].device
        out = torch.zeros(len(ps), 2, dtype=torch.float64, device=device)
        if not waves:  # only empty tensors
            return out
        inf_step = [torch.full((), math.inf, dtype=torch.float32, device=device)]
        G = [g.view(-1).split(sizes) for g, sizes in zip(gs, plan.sizes)]
        w_sq, u_sq = [], []
        for wave in waves:
            g = [G[i][c] for i, c in wave.chunks]
            torch._foreach_copy_(wave.s, wave.p)               # s = w, in the aligned scratch
            w_sq += _squares(wave.s)
            torch._foreach_mul_(wave.s, wd)                    # s = wd w
            # b^inf = 0: without bias correction (or with it in the step size) the kernels' corrections become 1.
            wave_steps = wave.steps if _corrects_moments(group) else inf_step * len(g)
            _adam_direction(group, wave.s, g, wave.m, wave.v, wave_steps, scale)  # s = u
            u_sq += _squares(wave.s)
            torch._foreach_copy_(g, wave.s)                    # keep u for pass 2
        chunk_sq = torch.stack([torch.stack(w_sq), torch.stack(u_sq)], dim=1).double()  # (chunks, 2)
        # Each tensor's chunk squares are summed in chunk order, in fp64.
        return out.index_add_(0, plan.owner.to(device), chunk_sq.to(device))

    def _waves_of(self, group, ps, ms, vs, steps) -> tuple[_Plan, list[_Wave]]:
        """The bucket's chunk views of params, moments, steps and scratch, built once and kept
        while the tensors stay the same (only the gradients' views are made every step)."""
        device, dtype, wave = ps[0].device, ps[0].dtype, _WAVE[ps[0].device.type]
        signature = tuple((p.data_ptr(), m.data_ptr(), v.data_ptr(), t.data_ptr(), p.numel())
                          for p, m, v, t in zip(ps, ms, vs, steps))
        slot = (id(group), device, dtype)
        cached = self._waves.get(slot)
        if cached is not None and cached[0] == (signature, wave):
            return cached[1], cached[2]
        if (device, dtype, wave) not in self._scratch:
            self._scratch[(device, dtype, wave)] = torch.empty(wave, dtype=dtype, device=device)
        scratch = self._scratch[(device, dtype, wave)]
        plan = _plan(tuple(p.numel() for p in ps), wave)
        P, M, V = ([t.view(-1).split(sizes) for t, sizes in zip(ts, plan.sizes)] for ts in (ps, ms, vs))
        waves = []
        for chunks, offs in zip(plan.waves, plan.offsets):
            p = [P[i][c] for i, c in chunks]
            s = [scratch.narrow(0, o, t.numel()) for o, t in zip(offs, p)]
            waves.append(_Wave(chunks, p, [M[i][c] for i, c in chunks], [V[i][c] for i, c in chunks], s,
                               [steps[i] for i, _ in chunks]))
        self._waves[slot] = ((signature, wave), plan, waves)
        return plan, waves

    def _apply(self, order, squares: torch.Tensor) -> None:
        """Pass 2: trust ratios from the whole-tensor norms, then ``w -= lr trust u``."""
        lo = torch.tensor([g["min_trust"] if g["min_trust"] is not None else 0.0 for _, g in order],
                          dtype=torch.float64)
        hi = torch.tensor([g["max_trust"] if g["max_trust"] is not None else math.inf for _, g in order],
                          dtype=torch.float64)
        adapt = torch.tensor([bool(g["adapt"]) for _, g in order])
        w, u = squares.cpu().double().sqrt().unbind(1)
        ratio = torch.where((w > 0) & (u > 0), torch.minimum(torch.maximum(w / u, lo), hi), 1.0)
        ratio = torch.where(adapt, ratio, 1.0).tolist()
        for (p, g), r in zip(order, ratio):
            p.add_(p.grad, alpha=-g["lr"] * r * self._step_size_correction(p, g))
        self._last = {p: r for (p, _), r in zip(order, ratio)}

    def _step_size_correction(self, p: torch.Tensor, group: dict) -> float:
        """FusedLamb's ``sqrt(1 - b2^t) / (1 - b1^t)`` (``correct_step_size``), else 1."""
        if not (group.get("correct_step_size", False) and group["bias_correction"]):
            return 1.0
        b1, b2 = group["betas"]
        t = float(self.state[p]["step"])
        return math.sqrt(1 - b2 ** t) / (1 - b1 ** t)


def _corrects_moments(group: dict) -> bool:
    """Whether the direction uses the bias-corrected moments (not under ``correct_step_size``)."""
    return group["bias_correction"] and not group.get("correct_step_size", False)


def _squares(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Squared 2-norms of 1-D chunks. On CPU BLAS's dot is both faster than ``vector_norm`` (it
    uses both threads) and closer to the fp64 value; elsewhere one multi-tensor norm."""
    if ts[0].device.type == "cpu" and ts[0].dtype in (torch.float32, torch.float64):
        return [torch.dot(t, t) for t in ts]
    return [n.float().square() for n in torch._foreach_norm(ts)]


def _adam_direction(group, s, g, m, v, steps, scale) -> None:
    """Update m, v and add ``m_hat / (sqrt(v_hat) + eps)`` to ``s``, for lists of chunks."""
    b1, b2 = group["betas"]
    if _HAS_FUSED_ADAM:
        # Adam's kernel computes param - lr * m_hat / (sqrt(v_hat) + eps); with param = s, lr = -1
        # that is s + r. grad_scale divides the gradients first (NVLAMB's pre-normalisation).
        torch._fused_adam_(s, g, m, v, [], steps, amsgrad=False, lr=-1.0, beta1=b1, beta2=b2, weight_decay=0.0,
                           eps=group["eps"], maximize=False, grad_scale=scale, found_inf=None)
        return
    if scale is not None:
        torch._foreach_div_(g, scale)
    t = [float(x) for x in steps]
    torch._foreach_lerp_(m, g, 1 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, g, g, value=1 - b2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, [math.sqrt(1 - b2 ** k) for k in t])
    torch._foreach_add_(denom, group["eps"])
    torch._foreach_addcdiv_(s, m, denom, [1 / (1 - b1 ** k) for k in t])


def _single_direction(group, p, g, m, v, step, scale) -> torch.Tensor:
    """The per-tensor path: update m, v, write u into g; return [||w||^2, ||u||^2] (fp64)."""
    b1, b2 = group["betas"]
    t = float(step)
    bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if _corrects_moments(group) else (1.0, 1.0)
    if scale is not None:
        g.div_(scale.to(g.device))
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v / bc2).sqrt_().add_(group["eps"])
    torch.div(m, bc1, out=g).div_(denom).add_(p, alpha=group["weight_decay"])
    return torch.stack([torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)]).double().square()
