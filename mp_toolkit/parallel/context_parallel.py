"""Context parallelism: one sequence split over ``cp`` ranks, causal attention as ring attention.

Each of the ``cp`` ranks of a context-parallel group holds ``T / cp`` of every sequence, in the
zig-zag split (Megatron CP, Llama 3's load balancing): the sequence is cut into ``2 cp`` equal chunks
and rank r holds chunks r and ``2 cp - 1 - r``, so under the causal mask every rank has the same
number of (query, key) pairs to compute. Everything outside attention is per token and runs on the
local tokens; attention needs every key and value the local queries may see:

* **ring attention** (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): the local
  keys and values travel around the ring of cp ranks, ``cp - 1`` sends; at each step the local
  queries attend to the block they hold -- under the zig-zag layout exactly half of it outside the
  own block: an earlier rank's first chunk (all our queries), or a later rank's whole block (our
  second chunk's queries), the own block causally -- each by one attention kernel that returns its
  log-sum-exp (on CPU torch's flash kernel, blocked, never the (T / cp)^2 scores), and the partial
  results are merged with the online softmax (Milakov and Gimelshein 2018). The forward keeps only
  q, k, v, the output and the log-sum-exp per query.
* or **all-to-all attention** (`ulysses_attention`, ``--cp-attention ulysses``): each rank trades its
  tokens of the other ranks' heads for their tokens of its own heads, attends over the whole sequence
  (put back in order) with one fused causal kernel, and trades the output back.
* the ring's backward runs the ring again (``cp`` sends): each step runs the kernel's backward on the block
  with the whole row's output and log-sum-exp (the block's share of the row's softmax), adds to the
  local queries' gradient, and adds the block's key and value gradients to accumulators that travel
  with the block and are home after the last send.

`zigzag_positions` gives a rank's global positions (the learned or rotary positions follow the
slice); `zigzag_slice` cuts a (B, T, ...) tensor. Partial results are merged in fp32 (float64 for
float64 inputs), without dropout: attention dropout under context parallelism is refused by the
run's checks.
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
from mp_toolkit.parallel.tp_comms import all_reduce, group_rank, group_size, region_function


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
    """What partial results are merged in: fp32, or the inputs' dtype where wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


def _scores(q, k, causal: bool) -> torch.Tensor:
    """A block's scaled scores in fp32 (or wider), -inf above the diagonal of a causal square block:
    the forward and the backward compute them alike."""
    w = _wide(q.dtype)
    s = torch.matmul(q.to(w), k.to(w).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _attend(q, k, v, causal: bool, fused: bool):
    """One block's attention: (output, log-sum-exp per query). ``causal``: the top-left causal mask of
    a square block. ``fused``: torch's CPU flash kernel (blocked, never the whole (tq, tk) scores);
    otherwise the block's scores in fp32 (or wider), as any device computes them."""
    if fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    s = _scores(q, k, causal)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse[..., None]), v.to(s.dtype)).to(q.dtype), lse


def _attend_backward(do, q, k, v, out, lse, causal: bool, fused: bool):
    """(dq, dk, dv) of one block, from the whole row's output and log-sum-exp (their probabilities are
    the block's share of the row's softmax): `_attend`'s backward, with the same kernel choice."""
    if fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal)
    s = _scores(q, k, causal)
    w, scale = s.dtype, 1.0 / math.sqrt(q.shape[-1])
    p = torch.exp(s - lse[..., None])
    do_w = do.to(w)
    dv = torch.matmul(p.transpose(-1, -2), do_w)
    ds = p * (torch.matmul(do_w, v.to(w).transpose(-1, -2)) - (do_w * out.to(w)).sum(-1, keepdim=True)) * scale
    return torch.matmul(ds, k.to(w)), torch.matmul(ds.transpose(-1, -2), q.to(w)), dv


def _zigzag_block(me: int, owner: int, half: int) -> tuple[slice, slice, bool]:
    """Which of this rank's queries attend to which of ``owner``'s keys, and whether causally. The
    zig-zag chunks of rank r are r and 2 cp - 1 - r: its own block is causal as laid out; an earlier
    rank's first chunk precedes both of ours and its second follows both; of a later rank's block,
    only our second chunk sees anything, and all of it."""
    every = slice(None)
    if owner == me:
        return every, every, True
    if owner < me:
        return every, slice(0, half), False
    return slice(half, None), every, False


def _merge(out, lse, part_out, part_lse, rows: slice) -> None:
    """Fold one block's (output, log-sum-exp) into the running ones for ``rows``, in place (the online
    softmax: each side weighted by its share of the merged normaliser)."""
    o, l_ = out[:, :, rows], lse[:, :, rows]
    merged = torch.logaddexp(l_, part_lse)
    o.mul_(torch.exp(l_ - merged)[..., None]).add_(part_out.to(o.dtype) * torch.exp(part_lse - merged)[..., None])
    l_.copy_(merged)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, fused):
        n, me = group_size(group), group_rank(group)
        half = q.shape[2] // 2
        out, lse = None, None
        kv = [k, v]
        for step in range(n):
            owner = (me - step) % n
            rows, cols, causal = _zigzag_block(me, owner, half)
            part_out, part_lse = _attend(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, fused)
            if out is None:  # step 0 is the own block: every row
                out, lse = part_out.to(_wide(q.dtype)), part_lse.to(_wide(q.dtype))
            else:
                _merge(out, lse, part_out, part_lse, rows)
            if step < n - 1:
                kv = _ring_exchange(kv, group)
        # laid out (B, T, H, hs) in memory, as the fused kernel's output is: the caller's transpose and
        # reshape to (B, T, C) are then a view of what is kept here, not a second copy
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.fused = group, fused
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, fused = ctx.group, ctx.fused
        n, me = group_size(group), group_rank(group)
        half = q.shape[2] // 2
        w = _wide(q.dtype)
        do = grad.contiguous()
        dq = torch.zeros(q.shape, dtype=w, device=q.device)
        travelling = [k, v, torch.zeros(k.shape, dtype=w, device=k.device),
                      torch.zeros(v.shape, dtype=w, device=v.device)]
        for step in range(n):
            owner = (me - step) % n
            kb, vb, dk, dv = travelling
            rows, cols, causal = _zigzag_block(me, owner, half)
            parts = (do[:, :, rows], q[:, :, rows], kb[:, :, cols], vb[:, :, cols], out[:, :, rows], lse[:, :, rows])
            bq, bk, bv = _attend_backward(*(t.contiguous() for t in parts), causal, fused)
            dq[:, :, rows] += bq
            dk[:, :, cols] += bk
            dv[:, :, cols] += bv
            if step < n - 1:
                travelling = _ring_exchange([kb, vb, dk, dv], group)
        dk, dv = _ring_exchange([dk, dv], group)  # the gradients of the block held last: home
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, fused: bool | None = None
                   ) -> torch.Tensor:
    """Causal attention of this rank's zig-zag slice of queries over the whole sequence's keys and
    values, held in slices by the ranks of ``group``: (B, H, T / cp, hs) x 3 -> (B, H, T / cp, hs).
    ``fused`` (default: on CPU): each block by torch's CPU flash kernel; False: by the block's scores
    (any device; holds a block's (T / cp)^2 scores per head). With one rank: causal attention."""
    if group_size(group) == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    if q.shape[2] % 2:
        raise ValueError(f"ring attention: a rank's {q.shape[2]} tokens are not its two zig-zag chunks")
    return _RingAttention.apply(q, k, v, group, q.device.type == "cpu" if fused is None else fused)


def _all_to_all(parts: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Part i to rank i of ``group``; rank i's part for this rank back, in rank order."""
    received = [torch.empty(p.shape, dtype=p.dtype, device=p.device) for p in parts]
    dist.all_to_all(received, [p.contiguous() for p in parts], group=group)
    return received


def _tokens_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H, t, hs) this rank's tokens of every head -> (B, H / n, n t, hs) every rank's tokens (rank
    order) of this rank's heads."""
    return torch.cat(_all_to_all(list(x.chunk(group_size(group), dim=1)), group), dim=2)


def _heads_to_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of `_tokens_to_heads`."""
    return torch.cat(_all_to_all(list(x.chunk(group_size(group), dim=2)), group), dim=1)


_TokensToHeads = region_function("_TokensToHeads", _tokens_to_heads, _heads_to_tokens,
                                 "All-to-all from token slices to head slices; backward the inverse.")
_HeadsToTokens = region_function("_HeadsToTokens", _heads_to_tokens, _tokens_to_heads,
                                 "All-to-all from head slices back to token slices; backward the inverse.")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """Causal attention of this rank's zig-zag tokens as all-to-all attention (DeepSpeed Ulysses,
    Jacobs et al. 2023): an all-to-all turns (every head, this rank's tokens) into (this rank's H / cp
    heads, every token); the heads attend over the whole sequence in its order (one fused kernel); a
    second all-to-all turns the output back. Needs the heads to divide over the group:
    (B, H, T / cp, hs) x 3 -> (B, H, T / cp, hs)."""
    n = group_size(group)
    if n == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    if q.shape[1] % n:
        raise ValueError(f"all-to-all attention splits the {q.shape[1]} heads over {n} ranks: they do not divide")
    length = q.shape[2] * n
    exchanged = torch.cat([zigzag_positions(length, n, r, q.device) for r in range(n)])  # positions after
    natural = torch.argsort(exchanged)
    qh, kh, vh = (_TokensToHeads.apply(t, group)[:, :, natural] for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return _HeadsToTokens.apply(out[:, :, exchanged], group)  # back to the exchange order


CP_ATTENTION = {"ring": "ring attention: key and value slices around the ring",
                "ulysses": "all-to-all attention: heads split over the cp ranks for the whole sequence"}
"""The attention a context-parallel run computes (``--cp-attention``)."""


def ring_core(group, attention: str = "ring") -> Callable:
    """An attention ``core`` (`model_zoo.gpt.CausalSelfAttention.core`, called as `attention_core` is)
    that runs `ring_attention` (``attention`` "ring") or `ulysses_attention` ("ulysses") over ``group``;
    selective recomputation runs it again in the backward (its exchanges included, in the same order on
    every rank)."""
    if attention not in CP_ATTENTION:
        raise ValueError(f"unknown context-parallel attention {attention!r}: choose {' or '.join(CP_ATTENTION)}")
    attend = ring_attention if attention == "ring" else ulysses_attention

    def core(q, k, v, recompute: bool, dropout_p: float = 0.0, is_causal: bool = True, **_):
        if dropout_p > 0:
            raise ValueError("context parallelism: its attention has no dropout on the probabilities (attn_pdrop 0)")
        if recompute and torch.is_grad_enabled():
            return checkpoint(attend, q, k, v, group, use_reentrant=False)
        return attend(q, k, v, group)
    return core


def apply_context_parallel(layer_list: LayerList, ctx: ParallelContext, attention: str = "ring") -> None:
    """Make a layer list context parallel over ``ctx.cp_group``, in place: the embedding takes this
    rank's zig-zag tokens and their positions (its ``tokens``), attention runs as ring attention (its
    ``core``), and every dropout draws the whole sequence's mask and keeps this rank's tokens
    (`SliceDropout`: the single process's masks; after sequence parallelism, its tp slice of them).
    The layers must expose ``tokens`` and ``core`` (model_zoo's GPT, HF's Llama family); anything else
    is one ValueError line. With no cp group nothing changes.
    """
    modules = [m for layer in layer_list.layers for m in layer.modules()]
    embeds = [m for m in modules if hasattr(type(m), "tokens")]
    cores = [m for m in modules if hasattr(type(m), "core")]
    if not embeds or not cores:
        raise ValueError("context parallelism is built for model_zoo's GPT and HF's Llama family (an embedding "
                         "that takes `tokens` and attention that takes a `core`): this model has no such layers")
    if ctx.cp_group is None:
        return
    cp, rank, group = ctx.cp, ctx.cp_rank, ctx.cp_group
    for m in embeds:
        m.tokens = lambda length, device: zigzag_positions(length, cp, rank, device)
    for m in cores:
        m.core = ring_core(group, attention)
    for layer in layer_list.layers:
        for path, m in list(layer.named_modules()):
            if isinstance(m, nn.Dropout):  # this rank's tokens of the whole sequence's mask
                new = SliceDropout(m.p, cp, lambda whole: zigzag_slice(whole, cp, rank))
            elif isinstance(m, SliceDropout):  # sequence parallel's tp slice of this rank's tokens
                new = SliceDropout(m.p, m.parts * cp,
                                   lambda whole, inner=m.select: inner(zigzag_slice(whole, cp, rank)))
            else:
                continue
            layer.set_submodule(path, new)


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


__all__ = ["CP_ATTENTION", "apply_context_parallel", "context_parallel_loss", "ring_attention", "ring_core",
           "ulysses_attention", "zigzag_positions", "zigzag_slice"]
