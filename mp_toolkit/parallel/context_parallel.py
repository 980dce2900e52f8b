"""Context parallelism: one sequence split over ``cp`` ranks, causal attention as ring attention.

Each of the ``cp`` ranks of a context-parallel group holds ``T / cp`` of every sequence, in the
zig-zag split (Megatron CP, Llama 3's load balancing): the sequence is cut into ``2 cp`` equal chunks
and rank r holds chunks r and ``2 cp - 1 - r``, so under the causal mask every rank has the same
number of (query, key) pairs to compute. Everything outside attention is per token and runs on the
local tokens; attention needs every key and value the local queries may see:

* **ring attention** (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): the local
  keys and values travel around the ring of cp ranks, ``cp - 1`` sends; at each step the local
  queries attend to the block they hold under the causal mask of the blocks' global positions, and
  the partial results are merged with the online softmax (a running maximum, denominator and
  numerator, Milakov and Gimelshein 2018). The forward keeps only q, k, v, the output and the
  log-sum-exp per query.
* the backward runs the ring again (``cp`` sends): each step recomputes the block's probabilities
  from the kept log-sum-exp, adds to the local queries' gradient, and adds the block's key and value
  gradients to accumulators that travel with the block and are home after the last send.

`zigzag_positions` gives a rank's global positions (the learned or rotary positions follow the
slice); `zigzag_slice` cuts a (B, T, ...) tensor. The probabilities are computed in fp32 (inputs of
another dtype are upcast per block), without dropout: attention dropout under context parallelism is
refused by the run's checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from mp_toolkit.layers import LayerList
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.sequence_parallel import SliceDropout
from mp_toolkit.parallel.tp_comms import all_reduce, group_rank, group_size


def zigzag_positions(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens of a ``length``-token sequence: chunks ``rank``
    and ``2 cp - 1 - rank`` of ``2 cp``, in that order."""
    if length % (2 * cp):
        raise ValueError(f"sequence length {length} is not a multiple of 2 x cp = {2 * cp}: the zig-zag split "
                         "cuts every sequence into 2 x cp equal chunks")
    c = length // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def zigzag_slice(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``x`` along ``dim`` (a copy)."""
    return x.index_select(dim, zigzag_positions(x.shape[dim], cp, rank, x.device))


def _ring_exchange(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Send ``tensors`` to the next rank of the ring and receive the previous rank's."""
    n, me = group_size(group), group_rank(group)
    nxt, prv = dist.get_global_rank(group, (me + 1) % n), dist.get_global_rank(group, (me - 1) % n)
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]  # contiguous
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, group) for r in received]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return received


def _wide(dtype: torch.dtype) -> torch.dtype:
    """What the probabilities are computed in: fp32, or the inputs' dtype where wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


def _block_scores(q, k, q_pos, k_pos, scale):
    """Scaled scores of a query block against a key block (fp32 or wider), -inf where the key is in the future."""
    w = _wide(q.dtype)
    s = torch.matmul(q.to(w), k.to(w).transpose(-1, -2)) * scale  # (B, H, tq, tk)
    return s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, length):
        n, me = group_size(group), group_rank(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        q_pos = zigzag_positions(length, n, me, q.device)
        w = _wide(q.dtype)
        m = torch.full(q.shape[:-1], float("-inf"), dtype=w, device=q.device)  # running max
        den = torch.zeros_like(m)
        num = torch.zeros(q.shape, dtype=w, device=q.device)
        kv = [k, v]
        for step in range(n):
            owner = (me - step) % n
            s = _block_scores(q, kv[0], q_pos, zigzag_positions(length, n, owner, q.device), scale)
            new_m = torch.maximum(m, s.amax(-1))
            safe = torch.where(torch.isinf(new_m), torch.zeros_like(new_m), new_m)  # rows that saw no key yet
            p = torch.exp(s - safe[..., None])
            corr = torch.exp(m - safe)
            den = den * corr + p.sum(-1)
            num = num * corr[..., None] + torch.matmul(p, kv[1].to(w))
            m = new_m
            if step < n - 1:
                kv = _ring_exchange(kv, group)
        # laid out (B, T, H, hs) in memory, as the fused kernel's output is: the caller's transpose and
        # reshape to (B, T, C) are then a view of what is kept here, not a second copy
        out = (num / den[..., None]).transpose(1, 2).contiguous().transpose(1, 2)
        lse = m + torch.log(den)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.length = group, length
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, length = ctx.group, ctx.length
        n, me = group_size(group), group_rank(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        q_pos = zigzag_positions(length, n, me, q.device)
        w = _wide(q.dtype)
        do = grad.to(w)
        delta = (do * out).sum(-1)  # (B, H, tq)
        dq = torch.zeros(q.shape, dtype=w, device=q.device)
        travelling = [k, v, torch.zeros(k.shape, dtype=w, device=k.device),
                      torch.zeros(v.shape, dtype=w, device=v.device)]
        for step in range(n):
            owner = (me - step) % n
            kb, vb, dk, dv = travelling
            s = _block_scores(q, kb, q_pos, zigzag_positions(length, n, owner, q.device), scale)
            p = torch.exp(s - lse[..., None])  # the block's probabilities, exactly as the forward's
            dv = dv + torch.matmul(p.transpose(-1, -2), do)
            dp = torch.matmul(do, vb.to(w).transpose(-1, -2))
            ds = p * (dp - delta[..., None]) * scale
            dq = dq + torch.matmul(ds, kb.to(w))
            dk = dk + torch.matmul(ds.transpose(-1, -2), q.to(w))
            if step < n - 1:
                travelling = _ring_exchange([kb, vb, dk, dv], group)
        dk, dv = _ring_exchange([dk, dv], group)  # the gradients of the block held last: home
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, length: int) -> torch.Tensor:
    """Causal attention of this rank's zig-zag slice of queries over the whole sequence's keys and
    values, held in slices by the ranks of ``group``: (B, H, T / cp, hs) x 3 -> (B, H, T / cp, hs).
    ``length``: the whole sequence's T. With one rank: causal attention of the sequence."""
    if group_size(group) == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _RingAttention.apply(q, k, v, group, length)


def ring_core(group, cp: int) -> Callable:
    """An attention ``core`` (`model_zoo.gpt.CausalSelfAttention.core`, called as `attention_core` is)
    that runs `ring_attention` over ``group``; selective recomputation runs it again in the backward
    (the ring's exchanges included, in the same order on every rank)."""
    def core(q, k, v, recompute: bool, dropout_p: float = 0.0, is_causal: bool = True, **_):
        if dropout_p > 0:
            raise ValueError("context parallelism: ring attention has no dropout on the probabilities (attn_pdrop 0)")
        if recompute and torch.is_grad_enabled():
            return checkpoint(ring_attention, q, k, v, group, q.shape[2] * cp, use_reentrant=False)
        return ring_attention(q, k, v, group, q.shape[2] * cp)
    return core


def apply_context_parallel(layer_list: LayerList, ctx: ParallelContext) -> None:
    """Make a layer list context parallel over ``ctx.cp_group``, in place: the embedding takes this
    rank's zig-zag tokens and their positions (its ``tokens``), attention runs as ring attention (its
    ``core``), and every dropout draws the whole sequence's mask and keeps this rank's tokens
    (`SliceDropout`: the single process's masks). The layers must expose ``tokens`` and ``core``
    (model_zoo's GPT); anything else is one ValueError line. With no cp group nothing changes."""
    modules = [m for layer in layer_list.layers for m in layer.modules()]
    embeds = [m for m in modules if hasattr(type(m), "tokens")]
    cores = [m for m in modules if hasattr(type(m), "core")]
    if not embeds or not cores:
        raise ValueError("context parallelism is built for model_zoo's GPT (an embedding that takes `tokens` and "
                         "attention that takes a `core`): this model has no such layers")
    if ctx.cp_group is None:
        return
    cp, rank, group = ctx.cp, ctx.cp_rank, ctx.cp_group
    for m in embeds:
        m.tokens = lambda length, device: zigzag_positions(length, cp, rank, device)
    for m in cores:
        m.core = ring_core(group, cp)
    for layer in layer_list.layers:
        for path, m in list(layer.named_modules()):
            if isinstance(m, nn.Dropout):
                parent, _, attr = path.rpartition(".")
                owner = layer.get_submodule(parent) if parent else layer
                setattr(owner, attr, SliceDropout(m.p, cp, lambda whole: zigzag_slice(whole, cp, rank)))


def context_parallel_loss(loss_fn: Callable, ctx: ParallelContext, ignore_index: int = -100) -> Callable:
    """The last stage's loss on this rank's tokens: ``loss_fn`` (a mean over the tokens whose label is
    not ``ignore_index``) on the zig-zag slice of the labels, scaled to this rank's share of the whole
    micro-batch's labelled tokens (counted over ``ctx.cp_group``) times cp. The cp ranks' losses then
    average, as the replicas' do over ``grad_group``, to the whole sequence's mean, and so do their
    gradients."""
    if ctx.cp_group is None:
        return loss_fn
    cp, rank, group = ctx.cp, ctx.cp_rank, ctx.cp_group

    def loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mine = zigzag_slice(labels, cp, rank)
        counted = (mine != ignore_index).sum().to(torch.float32)
        total = all_reduce(counted, group)
        if counted == 0:  # this rank's tokens are all unlabelled: its mean is nan, its share 0
            return outputs.sum() * 0.0
        return loss_fn(outputs, mine) * (counted * cp / total)
    return loss


__all__ = ["apply_context_parallel", "context_parallel_loss", "ring_attention", "ring_core", "zigzag_positions",
           "zigzag_slice"]
