"""Free a stage output once it has been sent, keeping its autograd graph (issue 18, item 5).

A stage's output is kept from its forward to its backward only as the root of the graph: the
backward starts at ``grad_fn`` with the gradient received from the next stage and never reads the
output's values, unless the node that produced it saved them. Once the send has completed, the
output's storage can go: its ``.data`` becomes a one-element tensor of the same dtype and device,
and the backward is started from its ``GradientEdge`` (whose recorded shape ``torch.autograd``
checks the gradient against) instead of from the shrunken tensor (Megatron-LM does the same with
``deallocate_output_tensor`` and a direct call into the autograd engine).

`releasable` says whether that is safe and worth it. It is, for an output tensor ``t``, when all of:

1. ``t`` is floating point and produced by the stage's graph (``t.grad_fn`` is not None): a leaf,
   an input passed through or a parameter is left alone;
2. ``t`` is not a view (``t._base is None``): its bytes would belong to its base, which stays;
3. ``t.grad_fn`` does not save its own result (no ``_saved_result`` attribute: tanh, sigmoid, exp,
   softmax ...), whose backward reads the output;
4. nothing else holds ``t`` or its bytes: the tensor is referenced by this Python object alone (a
   node that saved it as an input, a stage that cached it, a loss that reads it would hold
   another reference) and its storage by this tensor alone (no alias, no saved copy, no send
   still in flight). Freeing is then both safe and an actual saving.

Only tensors sent to another rank are offered (the executor calls this after the send
completed); outputs handed to a stage on the same rank are its inputs and are never freed.
"""
from __future__ import annotations

import torch


def _sole_owner(t: torch.Tensor) -> bool:
    """Rule 4: this Python tensor is the only holder of its TensorImpl, and that TensorImpl the only
    holder of its storage (the temporary ``untyped_storage()`` object counts one)."""
    return t._use_count() == 1 and torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2


def releasable(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage may be freed while its graph is kept (rules 1-4 above)."""
    return (t.is_floating_point() and t.grad_fn is not None and t._base is None
            and not hasattr(t.grad_fn, "_saved_result") and _sole_owner(t))


def release(t: torch.Tensor) -> int:
    """Swap ``t``'s storage for one element of its dtype; return the bytes released."""
    freed = t.untyped_storage().nbytes()
    t.data = torch.empty(1, dtype=t.dtype, device=t.device)
    return freed
