"""The zero-bubble split of one stage's backward (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism", section 2): ``I`` computes the input gradients now, ``W`` the weight gradients later,
and no part of the backward runs twice.

The autograd graph of one (stage, micro-batch), from its roots (the loss, or the stage outputs)
down to the leaves, falls into two regions:

* the *input region*: every node on a path from a root to a stage input. ``I`` is
  ``autograd.grad(roots, inputs, retain_graph=True)``: autograd runs exactly these nodes, and each
  computes only the outputs that lead to an input (a Linear's ``AddmmBackward`` computes
  ``grad_out @ W`` for its input, not ``x^T grad_out`` for its weight);
* the *weight region*: the nodes between the input region and the parameters' ``AccumulateGrad``.

The *intermediates* are the input-region nodes with an edge into the weight region (for a GPT
block: the four ``AddmmBackward`` and the two ``NativeLayerNormBackward``). During ``I`` a pre-hook
records the gradient each one receives; ``W`` re-enters the graph there, one
``autograd.grad(GradientEdge(intermediate), its group's parameters, recorded gradient)`` per
group of parameters that share intermediates: the intermediate runs again for its weight outputs
only, then the weight region below it. Every weight gradient is the very kernel call of an
unsplit backward on the very same operands, and ``W`` adds it to ``.grad`` as ``AccumulateGrad``
does (``grad += new``), so a pipeline's gradients stay bitwise those of a full backward. Groups of
vectors only (LayerNorm weights and biases) are not worth deferring (`worth_deferring`): ``I``
computes their gradients with the input gradients, in the same backward call, and adds them the
same way.

`split_backward_input` returns None (the caller then keeps the whole graph and runs an ordinary
backward towards the weights in ``W``) when the split does not apply or could be wrong: no stage
input needs a gradient (the first stage: the whole backward is weight work), a parameter reached
from a root without passing the input region, or a group whose intermediates lead into each
other (a weight used twice in a row: its second use's gradient already includes the first's
path, so re-entering at both would count it twice), or an intermediate that is a custom
``autograd.Function`` (its backward computes every output whatever is asked, and may communicate:
running it again in ``W`` would repeat that work and its collectives).

With activation recomputation (`mp_toolkit.recompute`: torch's non-reentrant checkpoint) the graph
is the same graph; only its saved tensors are dropped after the forward and rebuilt on first use in
each backward call, from the restored random state, so both ``I`` and ``W`` see bitwise the values
an unsplit backward sees. ``I`` is one backward call (one recomputation of each region it enters);
``W``'s calls run under one `GraphExecGroup` where torch has it (>= 2.9), so a region is recomputed
once for all groups, not once per group (its groups touch disjoint saved tensors, which is what
such a group requires); older torch recomputes per group, with the same result.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.utils import checkpoint as torch_checkpoint


@dataclass
class _Group:
    """Parameters whose weight gradients are reached from the same intermediates."""

    params: list[torch.nn.Parameter]
    nodes: list[Node]


@dataclass
class WeightPass:
    """What ``W`` needs of one (stage, micro-batch): the groups and their recorded gradients."""

    groups: list[_Group]
    recorded: dict[Node, tuple]

    def run(self) -> None:
        """Add every group's weight gradients to ``.grad`` (groups in parameter order)."""
        with one_recomputation():
            self._run_groups()
        self.recorded.clear()

    def _run_groups(self) -> None:
        for group in self.groups:
            self._run_group(group)

    def _run_group(self, group: _Group) -> None:
        """One group's weight gradients, added to ``.grad``. Its recorded gradients are dropped as
        it starts (its nodes are its own), and what autograd returns, a temporary after a step's
        first micro-batch, on return: a loop over the groups that kept it would hold one group's
        temporaries while the next group's are made."""
        edges, grads = [], []
        for node in group.nodes:
            for i, g in enumerate(self.recorded.pop(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:  # no gradient reached this group: its weights get none, as in a full backward
            return
        # Each group's nodes are its own (see `_groups`), so its part of the graph is freed here.
        got = torch.autograd.grad(edges, [get_gradient_edge(p) for p in group.params], grads, allow_unused=True)
        for p, g in zip(group.params, got):
            if g is not None:
                _accumulate(p, g)


def one_recomputation():
    """A context under which several backward calls recompute a checkpointed region once (torch's
    `GraphExecGroup`, torch >= 2.9); a no-op context on older torch."""
    group = getattr(torch_checkpoint, "GraphExecGroup", None)
    return group() if group is not None else contextlib.nullcontext()


def _accumulate(p: torch.nn.Parameter, g: torch.Tensor) -> None:
    """``AccumulateGrad``'s arithmetic: the first gradient is stored (in the parameter's layout),
    later ones are added in place."""
    if p.grad is None:
        p.grad = g if g.stride() == p.stride() else torch.empty_strided(p.size(), p.stride(), dtype=p.dtype,
                                                                         device=p.device).copy_(g)
    else:
        p.grad += g


def _reverse_graph(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes that feed it a gradient (its consumers in the forward), for every node
    reachable from ``roots``."""
    parents: dict[Node, list[Node]] = {r: [] for r in roots}
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _upward(start: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``start`` towards the roots without entering ``stop``; and the ``stop``
    nodes met on the way."""
    seen, met = set(start), set()
    queue = deque(start)
    while queue:
        for parent in parents[queue.popleft()]:
            if parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, met


def _reaches(src: Node, targets: set[Node], region: set[Node]) -> bool:
    """Whether a path from ``src`` through ``region`` nodes arrives at one of ``targets``."""
    seen, stack = {src}, [src]
    while stack:
        for child, _ in stack.pop().next_functions:
            if child in targets:
                return True
            if child in region and child not in seen:
                seen.add(child)
                stack.append(child)
    return False


def _groups(parents: dict[Node, list[Node]], roots: set[Node], region: set[Node],
            params: Sequence[torch.nn.Parameter]) -> list[_Group] | None:
    """Parameters grouped by shared intermediates, in parameter order; None when the split does not apply."""
    by_node: dict[Node, int] = {}   # intermediate -> index of its group
    groups: list[_Group] = []
    for p in params:
        acc = get_gradient_edge(p).node
        if acc not in parents:  # not used by this micro-batch: no gradient, as in a full backward
            continue
        above, met = _upward([acc], parents, region)
        if above & roots:  # a root leads to this weight without passing the input region
            return None
        mine = {by_node[n] for n in met if n in by_node}
        if not mine:
            groups.append(_Group([], []))
            mine = {len(groups) - 1}
        keep, *others = sorted(mine)
        for other in others:  # merge the groups that share an intermediate with this weight
            groups[keep].params += groups[other].params
            groups[keep].nodes += groups[other].nodes
            groups[other] = _Group([], [])
        groups[keep].params.append(p)
        groups[keep].nodes += [n for n in met if n not in groups[keep].nodes]
        for n in groups[keep].nodes:
            by_node[n] = keep
    groups = [g for g in groups if g.params]
    if any(isinstance(n, BackwardCFunction) for g in groups for n in g.nodes):
        return None
    for g in groups:
        if len(g.nodes) > 1 and any(_reaches(n, set(g.nodes) - {n}, region) for n in g.nodes):
            return None
    return groups


def split_backward_input(roots: Sequence[torch.Tensor | GradientEdge], grads: Sequence[torch.Tensor] | None,
                         leaves: Sequence[torch.Tensor], params: Sequence[torch.nn.Parameter]
                         ) -> tuple[tuple[torch.Tensor | None, ...], WeightPass | None]:
    """``I``: the gradients of ``leaves`` (the stage inputs that require one) and what ``W`` needs.

    ``roots`` are tensors (the loss) or gradient edges (stage outputs, whose storage may be freed).
    Returns the input gradients (None for an input the roots do not depend on) and the
    `WeightPass`, or None when the split does not apply (the graph is kept whole either way:
    ``retain_graph=True``).
    """
    if not roots or not leaves:
        return (None,) * len(leaves), None
    root_nodes = [(r if isinstance(r, GradientEdge) else get_gradient_edge(r)).node for r in roots]
    parents = _reverse_graph(root_nodes)
    input_nodes = [n for n in (get_gradient_edge(x).node for x in leaves) if n in parents]
    region, _ = _upward(input_nodes, parents, set())
    groups = _groups(parents, set(root_nodes), region, params) if input_nodes else None
    if groups is None:
        got = torch.autograd.grad(roots, leaves, grads, retain_graph=True, allow_unused=True)
        return got, None
    later, now = [], []  # groups for W; parameters whose gradients come with I's
    for g in groups:
        if worth_deferring(g):
            later.append(g)
        else:
            now += g.params
    recorded: dict[Node, tuple] = {}
    handles = [n.register_prehook(_recorder(recorded, n)) for g in later for n in g.nodes]
    try:
        got = torch.autograd.grad(roots, [*leaves, *now], grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for p, g in zip(now, got[len(leaves):]):
        if g is not None:
            _accumulate(p, g)
    return got[:len(leaves)], WeightPass(later, recorded)


def worth_deferring(group: _Group) -> bool:
    """Whether ``W`` should compute this group's weight gradients, rather than ``I`` with the input
    gradients: only a group holding a matrix does. A GEMM's weight gradient is as costly as its
    input gradient, so deferring it moves real work into the bubbles; a group of vectors only (a
    LayerNorm's weight and bias) costs a whole re-run of its node in ``W`` to save almost nothing
    (measured on a GPT stage of 3 blocks and the LM head, one CPU thread: I + W 94.5 ms with every
    group deferred, 91.3 with the LayerNorms in I, against 85.7 for the unsplit backward)."""
    return any(p.dim() >= 2 for p in group.params)


def _recorder(recorded: dict, node: Node):
    def hook(grad_outputs):
        recorded[node] = tuple(grad_outputs)
    return hook
