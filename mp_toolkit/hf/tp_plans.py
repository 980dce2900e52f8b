"""`apply_hf_tensor_parallel`: an HF layer list split by its architecture's tensor-parallel plan.

The plans are data in the architecture records (`mp_toolkit.arch.architectures`, ``hf_tp_plan``); they
use the format of `model_zoo.gpt.TP_PLAN` ({module path suffix: style}, matched against
"{layer name}.{module path}") and Megatron-LM's split (Shoeybi et al. 2019): each attention and
MLP is a column -> row pair closed by one all-reduce; embedding and LM head split the vocab rows,
padded to a multiple of 128 x tp (a tied pair stays one shard), so the last layer returns local
logits (B, T, Vp / tp), padded ids at -inf (`mp_toolkit.parallel.vocab_parallel`), for
``causal_lm_loss(logits, labels, tp_group=ctx.tp_group)``. Norms and GPT-2's position embedding
stay replicated.

* GPT-2: c_attn / c_proj / c_fc are HF ``Conv1D`` (weight (in, out), transposed relative to
  nn.Linear). `apply_tensor_parallel` knows nn.Linear only, so the plan's Conv1D entries are
  sharded here in Conv1D's own layout (`mp_toolkit.hf.conv1d_parallel`); the rest goes to
  `apply_tensor_parallel`. GPT2Attention splits c_attn's output with ``split_size`` (C), so after
  sharding its local sizes are set: ``split_size = embed_dim = C / tp``, ``num_heads = n_head / tp``.
* Llama family: q/k/v column (whole heads; with grouped-query attention the k/v heads split too,
  so tp must divide ``num_key_value_heads``), o row, gate/up column, down row. HF's LlamaAttention
  reshapes with ``view(*input_shape, -1, head_dim)`` and keeps only ``num_key_value_groups =
  heads / kv_heads`` (unchanged when both divide by tp), so the local head counts follow from the
  shard shapes and nothing needs setting; rank r's q heads use exactly rank r's k/v heads.
* BERT (pre-training and MLM): query / key / value column (whole heads: BertSelfAttention
  reshapes with ``(..., -1, head_size)``, so the local head count follows from the shapes), both
  ``output.dense`` row, ``intermediate.dense`` column; the word embedding and the MLM decoder
  (tied, with a bias) "vocab". HF's ``predictions.bias`` is the decoder's bias under a second
  name: it is pointed at the decoder's shard. Position and token-type embeddings, LayerNorms,
  the pooler, the MLM transform and the NSP classifier stay replicated (`model_zoo.bert.TP_PLAN`).

    layers = apply_hf_tensor_parallel(from_hf(model), ctx)   # modifies the (shared) modules in place
"""

from __future__ import annotations

from torch import nn
from transformers.pytorch_utils import Conv1D

from mp_toolkit.arch.architectures import BY_MODEL_TYPE, architecture_of
from mp_toolkit.hf.adapters import architecture_of_list
from mp_toolkit.hf.conv1d_parallel import Conv1DColumnParallel, Conv1DRowParallel
from mp_toolkit.layers import LayerList
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.tensor_parallel import VocabParallelLMHead, apply_tensor_parallel, check_tensor_parallel


def check_hf_tensor_parallel(config, tp: int) -> None:
    """Raise ValueError (one line) unless ``tp`` divides every size the plan of ``config`` (an HF
    config) splits: its architecture's (`Architecture.tp_sizes`), and whole key/value heads."""
    arch = architecture_of(config.model_type)
    if arch is None:
        raise ValueError(f"no tensor-parallel plan for model_type {config.model_type!r}: plans exist for "
                         f"{', '.join(BY_MODEL_TYPE)}")
    shape = arch.read(config.to_dict(), config.model_type, True)
    check_tensor_parallel(tp, **arch.tp_sizes(shape))
    kv = shape.kvh
    if kv % tp:
        ok = [d for d in range(1, kv + 1) if kv % d == 0 and shape.heads % d == 0]
        raise ValueError(f"--tp {tp} does not divide num_key_value_heads={kv}: grouped-query attention splits "
                         f"whole k/v heads over the ranks; choose --tp in {ok}")


def _conv1d_matches(layer_list: LayerList, plan: dict[str, str]) -> tuple[list[tuple[int, str, str]], set[str]]:
    """(layer index, module path, style) of every Conv1D a plan key names, and those keys; such
    keys must name Conv1Ds only, with a Linear style."""
    found, kinds = [], {}
    for i, (name, layer) in enumerate(zip(layer_list.names, layer_list.layers)):
        for path, module in layer.named_modules():
            full = f"{name}.{path}" if path else name
            for key, style in plan.items():
                if full == key or full.endswith("." + key):
                    kinds.setdefault(key, set()).add(isinstance(module, Conv1D))
                    if isinstance(module, Conv1D):
                        found.append((i, path, style))
    for key, k in kinds.items():
        if k == {True, False}:
            raise ValueError(f"TP plan: key {key!r} names both Conv1D and other modules; make it more specific")
        if True in k and plan[key] not in ("column", "qkv", "row"):
            raise ValueError(f"TP plan: {key!r} names Conv1D modules; style {plan[key]!r} needs column, qkv or row")
    return found, {key for key, k in kinds.items() if k == {True}}


def _set_local_attention_sizes(layer_list: LayerList) -> None:
    """GPT2Attention splits c_attn's output in chunks of ``split_size``: make it the local C / tp."""
    for layer in layer_list.layers:
        for m in layer.modules():
            if isinstance(getattr(m, "c_attn", None), Conv1DColumnParallel) and hasattr(m, "split_size"):
                m.split_size = m.embed_dim = m.c_attn.weight.shape[1] // 3  # (C, 3C / tp) -> C / tp
                m.num_heads = m.split_size // m.head_dim


def _point_bias_names_at_shards(layer_list: LayerList) -> None:
    """HF BERT's ``predictions.bias`` is ``predictions.decoder.bias``: keep it so after the split."""
    for layer in layer_list.layers:
        for m in layer.modules():
            decoder = getattr(m, "decoder", None)
            if isinstance(decoder, VocabParallelLMHead) and isinstance(getattr(m, "bias", None), nn.Parameter):
                m.bias = decoder.bias


def _config_of(layer_list: LayerList):
    for layer in layer_list.layers:
        if getattr(layer, "config", None) is not None:
            return layer.config
    raise ValueError("layer list has no HF block (was it built by from_hf?)")


def apply_hf_tensor_parallel(layer_list: LayerList, ctx: ParallelContext, plan: dict[str, str] | None = None
                             ) -> LayerList:
    """This rank's tensor-parallel shard of a `from_hf` layer list (its architecture's plan by default).

    Sizes are checked first (one-line errors naming what tp must divide), the plan is validated
    even for tp == 1 (which returns ``layer_list`` itself), and for tp > 1 the layers are modified
    in place, as `apply_tensor_parallel` does; tied parameters stay one shard.
    """
    if plan is None:
        plan = architecture_of_list(layer_list).hf_tp_plan
    check_hf_tensor_parallel(_config_of(layer_list), ctx.tp)
    convs, conv_keys = _conv1d_matches(layer_list, plan)
    rest = {k: s for k, s in plan.items() if k not in conv_keys}
    if ctx.tp_group is None:
        return apply_tensor_parallel(layer_list, ctx, rest)  # validates the rest; returns layer_list
    for i, path, style in convs:
        parent_path, _, attr = path.rpartition(".")
        parent = layer_list.layers[i].get_submodule(parent_path) if parent_path else layer_list.layers[i]
        old = getattr(parent, attr)
        new: nn.Module = (Conv1DRowParallel(old, ctx) if style == "row"
                          else Conv1DColumnParallel(old, ctx, stride=3 if style == "qkv" else 1))
        setattr(parent, attr, new)
    out = apply_tensor_parallel(layer_list, ctx, rest)
    _set_local_attention_sizes(out)
    _point_bias_names_at_shards(out)
    return out
