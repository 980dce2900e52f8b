"""Megatron sequence parallelism (Korthikanti et al. 2022, section 4.2.2), applied by a plan (data).

Tensor parallelism splits the attention heads and the MLP's inner width, but between the
column/row pairs -- the LayerNorms, the dropouts, the residual stream -- every tp rank holds the
whole activation. Under sequence parallelism each tp rank holds ``T / tp`` of the sequence there
(dim 1 of the batch-first tensors), so those regions' activations shrink by ``tp``, and so does
every message a pipeline stage sends:

* the embedding layer runs whole (its vocabulary-parallel all-reduce and its dropout as under
  plain tp, the same mask on every rank) and keeps its slice of the output (``"scatter"``);
* a ``"gather"`` module (attention, MLP, the LM head) all-gathers its input along the sequence
  before its column-parallel projections, which then skip ``f`` and keep only the input's local
  slice for their backward, gathering it again there (`tp_comms.gathered_projection`, Megatron's
  sequence-parallel linear); the all-gather's backward reduce-scatters their partial input
  gradients -- the all-reduce ``f`` did, in half the bytes;
* every row-parallel projection reduce-scatters its partial output instead of all-reducing it;
* a ``"gather_whole"`` module (BERT's heads: a replicated transform, the pooler on token 0)
  all-gathers its input and keeps its slice of the whole gradient its replicated work returns;
* a ``"dropout"`` module in a split region becomes `SequenceDropout`: it draws the whole
  sequence's mask from the generator every rank shares (the very draw ``nn.Dropout`` makes on the
  whole tensor) and keeps its slice, so the masks are the single process's, bit for bit, at any tp;
* the parameters of the split region that tp does not shard (LayerNorms, row-parallel biases,
  final norms) see ``T / tp`` of the tokens: their gradients are partial sums, marked
  ``sequence_parallel = True`` and summed over the tp group before the step (`OptimizerStep`).

A plan is a table next to the model (``model_zoo.gpt.SP_PLAN``), matched like a TP plan:
a key equal to a layer's name names the layer, otherwise a module path suffix, the outermost
match only. Layers the plan names as a whole ("scatter", "gather", "gather_whole") are the ends;
every other layer is in the split region. What is bitwise and what is not: the forward values of
every token and the dropout masks are the plain-tp run's; the partial sums of the replicated
parameters' gradients add in another order (within the oracle's floor).
"""

from __future__ import annotations

import torch
from torch import nn

from mp_toolkit.layers import LayerList
from mp_toolkit.optim.groups import is_tensor_parallel
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.tp_comms import gather_sequence, group_rank, group_size, mark_gathered, scatter_sequence

SP_STYLES = ("scatter", "gather", "gather_whole", "dropout")
ENDS = ("scatter", "gather", "gather_whole")


class SliceDropout(nn.Module):
    """``nn.Dropout`` on this rank's tokens of (B, T, ...) tensors split along dim 1 into ``parts``,
    with the mask of the whole tensor.

    Every rank draws the whole mask from the same generator state, exactly as ``nn.Dropout`` does
    on the whole tensor on CPU (``bernoulli_(1 - p)`` in the input's dtype, then divided by
    ``1 - p``), and keeps its own tokens' part (``select(whole) -> part``, a copy): the same masks
    as one process, and as a recomputation, which restores that generator. It costs one whole-size
    draw, freed at once; the kept mask is the part."""

    def __init__(self, p: float, parts: int, select):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p} must be in [0, 1)")
        self.p, self.parts, self.select = p, parts, select

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        whole = torch.empty((x.shape[0], x.shape[1] * self.parts, *x.shape[2:]), dtype=x.dtype, device=x.device)
        whole.bernoulli_(1.0 - self.p)
        mask = self.select(whole).clone().div_(1.0 - self.p)  # a copy: never a view of the whole
        return x * mask

    def extra_repr(self) -> str:
        return f"p={self.p}, the whole sequence's mask, this rank's part of {self.parts}"


class SequenceDropout(SliceDropout):
    """`SliceDropout` of a tp rank's contiguous slice (B, T / tp, ...) under sequence parallelism."""

    def __init__(self, p: float, group):
        n, rank = group_size(group), group_rank(group)
        super().__init__(p, n, lambda whole: whole.narrow(1, rank * (whole.shape[1] // n), whole.shape[1] // n))


def _first_tensor(args, kwargs) -> tuple[str | int, torch.Tensor]:
    """Where a module's hidden state is: its first positional argument or ``hidden_states=``."""
    if args and isinstance(args[0], torch.Tensor):
        return 0, args[0]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "hidden_states", kwargs["hidden_states"]
    raise ValueError("sequence parallelism: a gathered module takes its hidden state first or as hidden_states=")


def _gather_hook(group, whole_grad: bool):
    def hook(module, args, kwargs):
        where, hidden = _first_tensor(args, kwargs)
        whole = gather_sequence(hidden, group, whole_grad)
        if not whole_grad:  # its column-parallel projections keep the local slice (`gathered_projection`)
            mark_gathered(whole, hidden, group)
        if where == 0:
            return (whole, *args[1:]), kwargs
        return args, {**kwargs, where: whole}
    return hook


def _scatter_hook(group):
    def hook(module, args, output):
        if isinstance(output, torch.Tensor):
            return scatter_sequence(output, group)
        return (scatter_sequence(output[0], group), *output[1:])
    return hook


def _matches(layer_list: LayerList, plan: dict[str, str]) -> list[tuple[int, str, nn.Module, str, str]]:
    """(layer index, module path, module, style, key) of each module a key names: a key equal to a
    layer's name names that layer, otherwise the outermost modules whose path ends with it."""
    bad = {k: s for k, s in plan.items() if s not in SP_STYLES}
    if bad:
        raise ValueError(f"SP plan: unknown style(s) {bad}; choose one of {', '.join(SP_STYLES)}")
    found, used = [], set()
    for i, (layer_name, layer) in enumerate(zip(layer_list.names, layer_list.layers)):
        for key, style in plan.items():
            if key == layer_name:
                found.append((i, "", layer, style, key))
                used.add(key)
                continue
            taken: list[str] = []
            for path, module in layer.named_modules():
                full = f"{layer_name}.{path}" if path else layer_name
                if (full == key or full.endswith("." + key)) and not any(path.startswith(t + ".") for t in taken):
                    taken.append(path)
                    found.append((i, path, module, style, key))
                    used.add(key)
    missing = [k for k in plan if k not in used]
    if missing:
        raise ValueError(f"SP plan: key(s) {missing} match no module of layers {list(layer_list.names)}")
    return found


def _opens(module: nn.Module) -> bool:
    """A column-parallel projection (or vocabulary-parallel LM head): under tp it opens with ``f``."""
    return getattr(module, "tp_region", None) == "open"


def _closes(module: nn.Module) -> bool:
    """A row-parallel projection: under tp it closes with ``g``."""
    return getattr(module, "tp_region", None) == "close"


def apply_sequence_parallel(layer_list: LayerList, ctx: ParallelContext, plan: dict[str, str]) -> None:
    """Make a tensor-parallel layer list (after `apply_tensor_parallel`) sequence parallel, in place.

    The plan is validated for every tp (so a tp=1 check already reports a wrong plan); with no tp
    group nothing changes. Raises ValueError (one line) when a column-parallel projection of the
    split region is outside every "gather" module: it would read a slice as if it were whole.
    """
    matches = _matches(layer_list, plan)
    for _, _, module, style, key in matches:
        if style == "dropout" and not isinstance(module, nn.Dropout):
            raise ValueError(f"SP plan: {key!r} names a {type(module).__name__}; style 'dropout' needs an nn.Dropout")
    group = ctx.tp_group
    if group is None:
        return
    ends = {i for i, path, _, style, _ in matches if not path and style in ENDS}
    gathered: set[int] = set()  # ids of modules inside a "gather" region
    for i, path, module, style, _ in matches:
        if style == "dropout":
            layer_list.layers[i].set_submodule(path, SequenceDropout(module.p, group))
        elif style == "scatter":
            module.register_forward_hook(_scatter_hook(group))
        else:
            module.register_forward_pre_hook(_gather_hook(group, style == "gather_whole"), with_kwargs=True)
            if style == "gather":
                gathered.update(id(m) for m in module.modules())
    for i, (name, layer) in enumerate(zip(layer_list.names, layer_list.layers)):
        for path, m in layer.named_modules():
            if _closes(m):
                m.sequence_parallel = True
            elif _opens(m) and id(m) in gathered:
                m.sequence_parallel = True
            elif _opens(m) and i not in ends:
                raise ValueError(f"SP plan: {name}.{path} is a column-parallel projection in the sequence-split "
                                 "region outside every 'gather' module; add its module to the plan")
        if i not in ends:
            for p in layer.parameters():
                if not is_tensor_parallel(p):
                    p.sequence_parallel = True


def is_sequence_parallel(p: torch.Tensor) -> bool:
    """A replicated parameter of the sequence-split region: its gradient is a partial sum over tp."""
    return bool(getattr(p, "sequence_parallel", False))


__all__ = ["SP_STYLES", "SequenceDropout", "SliceDropout", "apply_sequence_parallel", "is_sequence_parallel"]
