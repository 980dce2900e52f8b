"""LARS (You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks", Algorithm 1)
and its clipping variant LARC (NVIDIA apex ``apex.parallel.LARC(clip=True)``).

Per tensor ``w`` with gradient ``g``, at learning rate ``lr`` (the paper's global rate gamma)::

    local = eta ||w|| / (||g|| + wd ||w|| + eps)   (eta = trust_coefficient; 1 when ||w|| or ||g|| is 0)
    scale = local                                   LARS
    scale = min(local / lr, 1)                      LARC, clip=True: the effective rate is min(local, lr)
    d = g + wd w                                    weight decay inside the scaled step
    v = momentum v + lr scale d                     the paper's form: the rate is inside the buffer
    w = w - v                                       or, nesterov: w = w - (momentum v + lr scale d)

The buffer starts at zero, so the first step is ``w -= lr scale d``. With a constant ``lr`` this is
torch's SGD (``buf = mu buf + d'; w -= lr buf``) applied to ``d' = scale d``, i.e. apex's LARC
wrapped around SGD; the two differ only while ``lr`` changes. A group with ``adapt=False`` uses
scale 1: plain SGD with momentum and weight decay. ``last_trust_ratios()`` reports ``scale``, the
factor that multiplies ``lr``.

Tensor parallelism: for a shard (``p.tensor_model_parallel = True``) ``||w||^2`` and ``||g||^2`` are
summed over ``tp_group`` in one all-reduce per step for all shards together; no traffic ever
crosses pipeline stages. Under ZeRO-1 the partial squares of tensors split between data-parallel
ranks' pieces are summed over the dp group first, in one more all-reduce per step
(`mp_toolkit.optim.groups.whole_tensor_squares`); a step with no gradient to apply still joins
both with zero rows. The gradients are left untouched.
"""

from __future__ import annotations

import torch

from mp_toolkit.optim.groups import check_hparam, evaluate_closure, whole_tensor_squares

_FOREACH_DEVICES = ("cpu", "cuda")


class LARS(torch.optim.Optimizer):
    """LARS / LARC with tensor-parallel aware norms (see the module docstring).

    Args:
        params: tensors or param groups; a group may set ``adapt`` (default True), ``lr``,
            ``momentum``, ``weight_decay``, ``trust_coefficient``, ``eps``, ``nesterov``, ``clip``.
        foreach: multi-tensor (``torch._foreach_*``) path; None means True when every param is on
            CPU or CUDA. Both paths give the same result to within fp32 rounding.
        tp_group: the tensor-parallel process group, or None.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8, nesterov: bool = False, clip: bool = False,
                 foreach: bool | None = None, tp_group=None):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, nesterov=nesterov, clip=clip, adapt=True)
        super().__init__(params, defaults)
        self.foreach, self.tp_group = foreach, tp_group
        self._last: dict[torch.Tensor, float] = {}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        for name in ("lr", "momentum", "weight_decay", "trust_coefficient", "eps"):
            check_hparam("LARS", name, g[name])
        if g["nesterov"] and g["momentum"] == 0:
            raise ValueError("LARS: nesterov=True needs momentum > 0, got momentum=0")

    trust_rule = "lars"
    """The rule the trust ratios follow, for the metrics' rows (biases and norm weights not adapted)."""

    def last_trust_ratios(self) -> dict[torch.Tensor, float]:
        """The factor that multiplied ``lr`` for each tensor in the last step (``scale`` above;
        1.0 where ``adapt=False``), keyed by parameter; tensors without a gradient are absent."""
        return dict(self._last)

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        order = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not order:  # nothing to step, but the others' whole-tensor sums wait for this rank's share
            self._last = {}
            held = [p for g in self.param_groups for p in g["params"]]
            if held:  # zero rows (ZeRO-1: a replica may own no element of any tensor)
                whole_tensor_squares(held[0].new_zeros(len(held), 2, dtype=torch.float64), held, self.tp_group)
            return loss
        ps, gs = [p for p, _ in order], [p.grad for p, _ in order]
        if any(g.is_sparse for g in gs):
            raise RuntimeError("LARS does not support sparse gradients")
        squares = self._squares(ps, gs)
        squares = whole_tensor_squares(squares, ps, self.tp_group)
        scales = _scales(order, squares)
        self._last = {p: s for p, s in zip(ps, scales)}
        use_foreach = self.foreach if self.foreach is not None else all(
            p.device.type in _FOREACH_DEVICES for p in ps)
        update = _foreach_update if use_foreach else _single_update
        for group in self.param_groups:
            mine = [i for i, (_, g) in enumerate(order) if g is group]
            if mine:
                update(group, [ps[i] for i in mine], [gs[i] for i in mine], [scales[i] for i in mine],
                       [self._buffer(ps[i], group) for i in mine])
        return loss

    def _squares(self, ps, gs) -> torch.Tensor:
        """(n, 2) fp64 squared norms [||w||^2, ||g||^2], from one multi-tensor reduction."""
        norms = torch._foreach_norm(ps + gs) if self.foreach is not False else [
            torch.linalg.vector_norm(t) for t in ps + gs]
        dev = norms[0].device
        return torch.stack([n.double().to(dev) for n in norms]).square().view(2, -1).T.contiguous()

    def _buffer(self, p: torch.Tensor, group: dict) -> torch.Tensor | None:
        if group["momentum"] == 0:
            return None
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]


def _scales(order, squares: torch.Tensor) -> list[float]:
    """Per tensor, the factor that multiplies lr: LARS's local rate, or LARC's min(local / lr, 1)."""
    eta = torch.tensor([g["trust_coefficient"] for _, g in order], dtype=torch.float64)
    wd = torch.tensor([g["weight_decay"] for _, g in order], dtype=torch.float64)
    eps = torch.tensor([g["eps"] for _, g in order], dtype=torch.float64)
    lr = torch.tensor([g["lr"] for _, g in order], dtype=torch.float64)
    clip = torch.tensor([bool(g["clip"]) for _, g in order])
    adapt = torch.tensor([bool(g["adapt"]) for _, g in order])
    w, gn = squares.cpu().double().sqrt().unbind(1)
    local = eta * w / (gn + wd * w + eps)
    # lr = 0 (e.g. the first warm-up step) gives min(inf, 1) = 1: the effective rate is lr = 0.
    per_lr = torch.where(lr > 0, local / lr, torch.full((), float("inf"), dtype=torch.float64))
    local = torch.where(clip, torch.minimum(per_lr, torch.ones((), dtype=torch.float64)), local)
    return torch.where(adapt & (w > 0) & (gn > 0), local, 1.0).tolist()


def _foreach_update(group, ps, gs, scales, bufs) -> None:
    """v = mu v + lr scale (g + wd w); w -= v (or nesterov), with multi-tensor ops."""
    lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
    coeffs = [lr * s for s in scales]
    if wd != 0:
        d = torch._foreach_add(gs, ps, alpha=wd)               # new tensors: the grads stay as they are
        torch._foreach_mul_(d, coeffs)
    else:
        d = torch._foreach_mul(gs, coeffs)
    if mu == 0:
        torch._foreach_sub_(ps, d)
        return
    torch._foreach_mul_(bufs, mu)
    torch._foreach_add_(bufs, d)
    if group["nesterov"]:
        torch._foreach_add_(d, bufs, alpha=mu)
        torch._foreach_sub_(ps, d)
    else:
        torch._foreach_sub_(ps, bufs)


def _single_update(group, ps, gs, scales, bufs) -> None:
    """The same update, one tensor at a time."""
    lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
    for p, g, s, buf in zip(ps, gs, scales, bufs):
        d = g.add(p, alpha=wd).mul_(lr * s)
        if buf is None:
            p.sub_(d)
            continue
        buf.mul_(mu).add_(d)
        p.sub_(d.add_(buf, alpha=mu) if group["nesterov"] else buf)
