"""Rank functions for the tensor-parallel tests: each shard runs next to its unsharded twin.

Every rank seeds identically, builds the full module and its input, runs the full module as the
reference and the tensor-parallel shard on the same data, and returns ``{label: (got, expected)}``
for the test to compare. Labels start with the layer's name so one world run serves every test.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from model_zoo.gpt import GPT, PRESETS, TP_PLAN, GPTConfig, GPTLMHead, lm_loss
from mp_toolkit.layers import LayerList
from mp_toolkit.parallel.context import build_context
from mp_toolkit.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    apply_tensor_parallel,
    gather_full,
    shard_full,
    vocab_parallel_cross_entropy,
)
from mp_toolkit.parallel.tp_comms import gather_from_tensor_model_parallel_region


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _run_pair(full, shard, x, x_layout, dy, y_layout, ctx, prefix, out):
    """Forward + backward of ``full`` on x and of ``shard`` on this rank's view of x.

    ``x_layout`` / ``y_layout`` are (dim, stride) of the shard's input / output, or None when
    replicated. Records output, input grad and every parameter grad (as this rank's shard).
    """
    r, tp = ctx.tp_rank, ctx.tp
    xf = _leaf(x) if x.is_floating_point() else x
    yf = full(xf)
    yf.backward(dy)
    xs = x if x_layout is None else shard_full(x, x_layout, r, tp)
    xs = _leaf(xs) if x.is_floating_point() else xs
    ys = shard(xs)
    ys.backward(dy if y_layout is None else shard_full(dy, y_layout, r, tp))
    out[f"{prefix}/out"] = (ys, yf.detach() if y_layout is None else shard_full(yf.detach(), y_layout, r, tp))
    if x.is_floating_point():
        want = xf.grad if x_layout is None else shard_full(xf.grad, x_layout, r, tp)
        out[f"{prefix}/grad_in"] = (xs.grad, want)
    full_params = dict(full.named_parameters())
    for name, p in shard.named_parameters():
        out[f"{prefix}/grad_{name}"] = (p.grad, shard_full(full_params[name].grad, p, r, tp))
        # round trip: the gathered shard is the unsplit weight
        out[f"{prefix}/gather_{name}"] = (gather_full(p, ctx.tp_group), full_params[name].detach())


def layer_checks(rank, world):
    """Every TP layer and the vocab-parallel loss against the unsharded computation."""
    ctx = build_context(pp=1, tp=2, dp=1)
    torch.manual_seed(0)  # same full weights and data on every rank
    out, attrs = {}, {}
    x8 = torch.randn(2, 3, 8)

    lin = nn.Linear(8, 12)
    col = ColumnParallelLinear.from_full(lin, ctx)
    _run_pair(lin, col, x8, None, torch.randn(2, 3, 12), (2, 1), ctx, "column", out)

    lin = nn.Linear(8, 24)  # fused [q; k; v] with C = 8
    qkv = ColumnParallelLinear.from_full(lin, ctx, stride=3)
    _run_pair(lin, qkv, x8, None, torch.randn(2, 3, 24), (2, 3), ctx, "qkv", out)

    lin = nn.Linear(8, 12)
    gathered = ColumnParallelLinear.from_full(lin, ctx, gather_output=True)
    _run_pair(lin, gathered, x8, None, torch.randn(2, 3, 12), None, ctx, "column_gather", out)

    lin, x12 = nn.Linear(12, 8), torch.randn(2, 3, 12)
    row = RowParallelLinear.from_full(lin, ctx, input_is_parallel=True)
    _run_pair(lin, row, x12, (2, 1), torch.randn(2, 3, 8), None, ctx, "row", out)

    lin = nn.Linear(12, 8)
    row_scatter = RowParallelLinear.from_full(lin, ctx, input_is_parallel=False)
    _run_pair(lin, row_scatter, x12, None, torch.randn(2, 3, 8), None, ctx, "row_scatter", out)

    ids = torch.tensor([[0, 7, 8, 15, 3], [11, 11, 2, 9, 6]])  # both halves of the vocab (16 / 2)
    emb = nn.Embedding(16, 6, padding_idx=11)  # padding row owned by rank 1
    vemb = VocabParallelEmbedding.from_full(emb, ctx, divisible_by=1)  # unpadded (tests/test_vocab_padding.py pads)
    _run_pair(emb, vemb, ids, None, torch.randn(2, 5, 6), None, ctx, "embedding", out)

    head = GPTLMHead(GPTConfig(vocab_size=16, n_positions=8, n_embd=6, n_layer=1, n_head=1))
    nn.init.normal_(head.weight)
    vhead = VocabParallelLMHead.from_full(head, ctx, divisible_by=1)
    _run_pair(head, vhead, torch.randn(2, 3, 6), None, torch.randn(2, 3, 16), (2, 1), ctx, "lm_head", out)

    for name, p in (("column.weight", col.weight), ("column.bias", col.bias), ("qkv.weight", qkv.weight),
                    ("row.weight", row.weight), ("row.bias", row.bias), ("embedding.weight", vemb.weight),
                    ("lm_head.weight", vhead.weight)):
        attrs[name] = (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", None),
                       getattr(p, "partition_stride", None), tuple(p.shape))

    # the loss: logits ~ +-150 overflow exp() unless shifted by the max
    logits = torch.randn(4, 5, 16) * 50
    labels = torch.randint(0, 16, (4, 5))
    labels[0, :2] = -100
    labels[3, 4] = -100
    for ignore in (-100, 3):  # 3 is an in-vocab id on rank 0
        lab = labels.masked_fill(labels == -100, ignore)
        full = _leaf(logits)
        want = F.cross_entropy(full.reshape(-1, 16), lab.reshape(-1), ignore_index=ignore)
        want.backward()
        local = _leaf(shard_full(logits, (2, 1), ctx.tp_rank, ctx.tp))
        got = vocab_parallel_cross_entropy(local, lab, ctx.tp_group, ignore_index=ignore)
        got.backward()
        out[f"xent{ignore}/loss"] = (got, want.detach())
        out[f"xent{ignore}/grad"] = (local.grad, shard_full(full.grad, (2, 1), ctx.tp_rank, ctx.tp))

    errors = {}
    for what, build in (("column", lambda: ColumnParallelLinear(8, 9, ctx)),
                        ("qkv", lambda: ColumnParallelLinear(8, 9, ctx, stride=3)),
                        ("row", lambda: RowParallelLinear(7, 8, ctx))):
        try:
            build()
            errors[what] = None
        except ValueError as e:
            errors[what] = str(e)
    return {"pairs": out, "attrs": attrs, "errors": errors}


def _named(layer_list):
    """(layer_name.param_path, Parameter) with tied parameters listed under every name."""
    for lname, layer in zip(layer_list.names, layer_list.layers):
        for path, p in layer.named_parameters(remove_duplicate=False):
            yield f"{lname}.{path}", p


def gpt_checks(rank, world):
    """gpt-tiny under TP_PLAN on tp=2 vs the unsplit model: logits, loss, every gradient."""
    ctx = build_context(pp=1, tp=2, dp=1)
    torch.manual_seed(0)
    model = GPT(PRESETS["gpt-tiny"])
    ref = copy.deepcopy(model)  # apply_tensor_parallel swaps modules in place
    ids = torch.randint(0, 256, (2, 16))
    labels = torch.randint(0, 256, (2, 16))
    labels[0, :5] = -100

    ref_logits = ref(ids)
    ref_loss = lm_loss(ref_logits, labels)
    ref_loss.backward()

    layers = apply_tensor_parallel(LayerList.from_model(model), ctx, TP_PLAN)
    local_logits = layers(ids)  # (B, T, V / tp)
    loss = vocab_parallel_cross_entropy(local_logits, labels, ctx.tp_group)
    loss.backward()

    pairs = {"logits": (gather_from_tensor_model_parallel_region(local_logits.detach(), ctx.tp_group),
                        ref_logits.detach()),
             "loss": (loss.detach(), ref_loss.detach())}
    ref_params = dict(_named(LayerList.from_model(ref)))
    names = []
    for name, p in _named(layers):
        names.append(name)
        pairs[f"grad:{name}"] = (gather_full(p, ctx.tp_group, p.grad), ref_params[name].grad)
        pairs[f"weight:{name}"] = (gather_full(p, ctx.tp_group), ref_params[name].detach())
    stage = layers.slice(0, len(layers))
    facts = {
        "names_match": sorted(names) == sorted(ref_params),
        "tied": layers["embed"].wte.weight is layers["lm_head"].weight,
        "tie_members": len(stage.tie_members),
        "unique_params": len(list(layers.parameters())),
        "ref_unique_params": len(list(ref.parameters())),
        "qkv_local_shape": tuple(layers["h.0"].attn.qkv.weight.shape),
        "sharded": sorted(n for n, p in _named(layers) if getattr(p, "tensor_model_parallel", False)),
        "local_logits_shape": tuple(local_logits.shape),
    }
    return {"pairs": pairs, "facts": facts}


def fairscale_checks(rank, world):
    """Our Column/RowParallelLinear and loss vs fairscale.nn.model_parallel on the same weights."""
    from fairscale.nn.model_parallel import initialize as fs_init
    from fairscale.nn.model_parallel.cross_entropy import vocab_parallel_cross_entropy as fs_xent
    from fairscale.nn.model_parallel.layers import ColumnParallelLinear as FSColumn
    from fairscale.nn.model_parallel.layers import RowParallelLinear as FSRow

    fs_init.initialize_model_parallel(2)  # fairscale keeps its groups in module globals
    ctx = build_context(pp=1, tp=2, dp=1)
    r = ctx.tp_rank
    torch.manual_seed(0)  # fairscale draws its master weight from the global RNG on every rank
    pairs = {}

    def twin(fs_layer, full_bias, ours_from_full):
        """Our layer built from fairscale's master weight and a random full bias."""
        lin = nn.Linear(fs_layer.in_features, fs_layer.out_features)
        with torch.no_grad():
            lin.weight.copy_(fs_layer.master_weight)
            lin.bias.copy_(full_bias)
        return ours_from_full(lin)

    for label, stride in (("column", 1), ("qkv", 3)):
        fs = FSColumn(8, 24, gather_output=False, stride=stride, keep_master_weight_for_test=True)
        bias = torch.randn(24)
        with torch.no_grad():
            fs.bias.copy_(shard_full(bias, (0, stride), r, 2))
        ours = twin(fs, bias, lambda lin, stride=stride: ColumnParallelLinear.from_full(lin, ctx, stride=stride))
        pairs[f"{label}/weight"] = (ours.weight.detach(), fs.weight.detach())
        x, dy = torch.randn(3, 8), torch.randn(3, 12)
        xa, xb = _leaf(x), _leaf(x)
        ya, yb = ours(xa), fs(xb)
        ya.backward(dy)
        yb.backward(dy)
        pairs[f"{label}/out"] = (ya, yb)
        pairs[f"{label}/grad_in"] = (xa.grad, xb.grad)
        pairs[f"{label}/grad_weight"] = (ours.weight.grad, fs.weight.grad)
        pairs[f"{label}/grad_bias"] = (ours.bias.grad, fs.bias.grad)

    fs = FSRow(12, 8, input_is_parallel=False, keep_master_weight_for_test=True)
    bias = torch.randn(8)
    with torch.no_grad():
        fs.bias.copy_(bias)  # replicated in both libraries
    ours = twin(fs, bias, lambda lin: RowParallelLinear.from_full(lin, ctx, input_is_parallel=False))
    x, dy = torch.randn(3, 12), torch.randn(3, 8)
    xa, xb = _leaf(x), _leaf(x)
    ya, yb = ours(xa), fs(xb)
    ya.backward(dy)
    yb.backward(dy)
    pairs["row/weight"] = (ours.weight.detach(), fs.weight.detach())
    pairs["row/out"] = (ya, yb)
    pairs["row/grad_in"] = (xa.grad, xb.grad)
    pairs["row/grad_weight"] = (ours.weight.grad, fs.weight.grad)
    pairs["row/grad_bias"] = (ours.bias.grad, fs.bias.grad)

    # fairscale's loss is per token with no ignore_index; our mean over all tokens must match its mean
    local, labels = torch.randn(6, 8) * 10, torch.randint(0, 16, (6,))
    la, lb = _leaf(local), _leaf(local)
    mine = vocab_parallel_cross_entropy(la, labels, ctx.tp_group)
    theirs = fs_xent(lb.clone(), labels).mean()  # clone: fairscale shifts its input in place
    mine.backward()
    theirs.backward()
    pairs["xent/loss"] = (mine, theirs)
    pairs["xent/grad"] = (la.grad, lb.grad)
    return pairs
