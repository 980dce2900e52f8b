"""Per-layer cost model of a Transformer: parameters, FLOPs, activation and static bytes.

Everything here is arithmetic on a model's shape (`ModelShape`), so a plan for GPT-2 XL or a
70B Llama costs nothing to compute and needs no weights. Formulas, for a micro-batch of ``b``
sequences of ``s`` tokens (``N = b*s``), hidden size ``h``, MLP size ``f``, vocabulary ``V``,
``d`` bytes per activation element:

* **FLOPs** count matrix products, 2 per multiply-add (Kaplan et al. 2020; Narayanan et al.
  2021, section 5.1). Causal attention counts the lower triangle only (half of ``QK^T`` and of
  ``PV``), as the fused CPU and GPU kernels skip the masked blocks. Backward is twice the
  forward for layers with weights (input and weight gradients); an embedding's backward is a
  scatter-add, counted as 0. Elementwise work (norms, GELU, softmax) is not counted.
* **Activation bytes** are what autograd keeps for backward per micro-batch, derived from what
  `torch.autograd.graph.saved_tensors_hooks` records for `model_zoo`'s GPT in torch 2.x: a
  pre-LN block keeps ``N*(8h + 2f)`` activations (its two norm inputs, the QKV input and
  output, the attention output, the MLP input, the GELU input and output) plus norm statistics
  and the attention log-sum-exp; the LM head with its cross-entropy keeps its input and the
  fp32 log-softmax ``N*V*4``. `tests/test_cost.py` checks these against the hooks. BERT and
  Llama blocks follow the same accounting for their layers (Llama: gated MLP, rotated q/k).
* **Static bytes** per parameter depend on precision and optimizer (`bytes_per_param`), and so do the
  optimizer step's temporaries (`step_bytes_per_param`); both match a measured step.

With tensor parallelism ``tp`` the sharded matrices (and their FLOPs and activations) divide by
``tp``; norms, position embeddings and biases of row-parallel layers are replicated.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from model_zoo import bert, gpt
from mp_toolkit.errors import CostModelError

FAMILIES = ("gpt2", "bert", "llama")
HF_MODEL_TYPES = {"gpt2": "gpt2", "bert": "bert", "llama": "llama", "mistral": "llama", "qwen2": "llama"}
ACT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "lamb": 8, "lars": 4, "sgd": 4, "adagrad": 4, "rmsprop": 4}
"""fp32 optimizer state per parameter: two moments (Adam, LAMB) or one buffer (the others)."""

# Layer names and class names per family; `type:REGEX` partitions match the class names.
_KINDS = {
    "gpt2": (("embed", "GPTEmbedding"), ("h.{i}", "GPTBlock"), ("ln_f", "GPTFinalNorm"), ("lm_head", "GPTLMHead")),
    "bert": (("embeddings", "BertEmbeddings"), ("encoder.layer.{i}", "BertLayer"), None, ("heads", "BertPreTrainingHeads")),
    "llama": (("embed_tokens", "Embedding"), ("layers.{i}", "LlamaDecoderLayer"), ("norm", "LlamaRMSNorm"), ("lm_head", "LMHead")),
}


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about a Transformer."""

    family: str
    """"gpt2" (pre-LN, learned positions), "bert" (post-LN encoder, pretraining heads) or "llama"
    (RMSNorm, rotary positions, gated MLP; also Mistral and Qwen2)."""
    vocab_size: int
    hidden: int
    num_layers: int
    heads: int
    ffn: int
    """MLP inner size."""
    positions: int = 0
    """Learned position embeddings (gpt2, bert); rotary models have none."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means ``heads``."""
    head_dim: int = 0
    """0 means ``hidden // heads``."""
    tied: bool = True
    """Input embedding and LM head share one weight (each stage that holds one stores it)."""
    type_vocab: int = 0
    """BERT token-type embeddings."""
    qkv_bias: bool = False
    """Biases on q/k/v (Qwen2); gpt2 and bert always have biases."""
    attn_dropout: float = 0.0
    """Dropout on the attention probabilities (GPT-2 ``attn_pdrop``, BERT ``attention_probs_dropout_prob``)."""
    hidden_dropout: float = 0.0
    """Dropout on each sub-layer's output (GPT-2 ``resid_pdrop``, BERT ``hidden_dropout_prob``)."""
    embd_dropout: float = 0.0
    """Dropout on the embedding's output (GPT-2 ``embd_pdrop``; BERT's is ``hidden_dropout_prob``)."""
    hf_modules: bool = False
    """Built from transformers' own modules (``mpt train --hf``), not model_zoo's: HF GPT-2's
    ``gelu_new`` is composed of elementwise ops that keep four (b, s, f) tensors, and an absent
    dropout key means HF's default 0.1 (model_zoo's GPT: 0)."""

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kvh(self) -> int:
        return self.kv_heads or self.heads


MAX_LAYERS = 10_000
"""More blocks than any model trained so far; beyond it a plan would not fit in memory."""


def shape_from_hf_config(d: dict, source: str = "config", hf_modules: bool = False) -> ModelShape:
    """A `ModelShape` from a HuggingFace ``config.json`` dict of the GPT-2, BERT or Llama families;
    ``hf_modules``: the model is built from transformers' modules (`ModelShape.hf_modules`)."""
    shape = _with_dropout(_read_shape(d, source), d, hf_modules)
    if shape.num_layers > MAX_LAYERS:
        raise CostModelError(f"{source}: {shape.num_layers} layers is more than the planner handles "
                             f"(at most {MAX_LAYERS})")
    if not shape.head_dim and shape.hidden % shape.heads:
        raise CostModelError(f"{source}: hidden size {shape.hidden} is not divisible by {shape.heads} heads")
    if shape.heads % shape.kvh:
        raise CostModelError(f"{source}: {shape.heads} attention heads are not a multiple of {shape.kvh} "
                             f"key/value heads")
    return shape


def _read_shape(d: dict, source: str) -> ModelShape:
    mt = d.get("model_type")
    if mt not in HF_MODEL_TYPES:
        raise CostModelError(f"{source}: model_type {mt!r} is not supported: choose a config of "
                             f"{', '.join(sorted(HF_MODEL_TYPES))}")
    family = HF_MODEL_TYPES[mt]
    try:
        if family == "gpt2":
            h = d.get("n_embd", 768)
            return ModelShape("gpt2", d.get("vocab_size", 50257), h, d.get("n_layer", 12), d.get("n_head", 12),
                              d.get("n_inner") or 4 * h, d.get("n_positions", 1024),
                              tied=d.get("tie_word_embeddings", True))
        if family == "bert":
            return ModelShape("bert", d["vocab_size"], d["hidden_size"], d["num_hidden_layers"],
                              d["num_attention_heads"], d["intermediate_size"], d.get("max_position_embeddings", 512),
                              tied=d.get("tie_word_embeddings", True), type_vocab=d.get("type_vocab_size", 2))
        return ModelShape("llama", d["vocab_size"], d["hidden_size"], d["num_hidden_layers"], d["num_attention_heads"],
                          d["intermediate_size"], kv_heads=d.get("num_key_value_heads") or 0,
                          head_dim=d.get("head_dim") or 0, tied=d.get("tie_word_embeddings", False),
                          qkv_bias=mt == "qwen2" or bool(d.get("attention_bias", False)))
    except KeyError as e:
        raise CostModelError(f"{source}: a {mt} config needs the key {e.args[0]!r}") from None


def _with_dropout(shape: ModelShape, d: dict, hf_modules: bool) -> ModelShape:
    """The dropout probabilities a run of this config applies in training (`ModelShape`'s fields)."""
    if shape.family == "gpt2":
        absent = 0.1 if hf_modules else 0.0  # HF GPT2Config's default; model_zoo GPTConfig's is 0
        p = {k: float(d.get(k, absent) or 0.0) for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop")}
        return replace(shape, attn_dropout=p["attn_pdrop"], hidden_dropout=p["resid_pdrop"],
                       embd_dropout=p["embd_pdrop"], hf_modules=hf_modules)
    if shape.family == "bert":  # HF's and model_zoo's BertConfig both default to 0.1
        hidden = float(d.get("hidden_dropout_prob", 0.1) or 0.0)
        return replace(shape, attn_dropout=float(d.get("attention_probs_dropout_prob", 0.1) or 0.0),
                       hidden_dropout=hidden, embd_dropout=hidden, hf_modules=hf_modules)
    return replace(shape, hf_modules=hf_modules)  # Llama-family attention_dropout is 0 in practice: not modelled


def model_shape(model: str, hf_modules: bool = False) -> ModelShape:
    """Our preset name (``gpt-tiny``, ``gpt2-xl``, ``bert-base``, ...) or a HF ``config.json`` path;
    ``hf_modules``: the config's model is built from transformers' modules (`ModelShape.hf_modules`)."""
    if hf_modules and (model in gpt.PRESETS or model in _bert_presets()):
        raise CostModelError(f"{model} is a model_zoo preset: transformers' modules need a config.json path")
    if model in gpt.PRESETS:
        c = gpt.PRESETS[model]
        return ModelShape("gpt2", c.vocab_size, c.n_embd, c.n_layer, c.n_head, c.inner_size, c.n_positions,
                          tied=c.tie_word_embeddings, attn_dropout=c.attn_pdrop, hidden_dropout=c.resid_pdrop,
                          embd_dropout=c.embd_pdrop)
    bert_presets = _bert_presets()
    if model in bert_presets:
        return shape_from_hf_config({"model_type": "bert", **bert_presets[model]}, model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        names = list(gpt.PRESETS) + list(bert_presets)
        raise CostModelError(f"unknown model {model!r}: choose one of {', '.join(names)} or a config.json path")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CostModelError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(d, dict):
        raise CostModelError(f"{path}: a config.json must hold a JSON object")
    if "model_type" not in d and "n_embd" in d:
        d = {"model_type": "gpt2", **d}  # our own GPTConfig.to_dict() files
    bad = [k for k, v in d.items() if k in _INT_KEYS and (isinstance(v, bool) or not isinstance(v, int) or v <= 0)]
    if bad:
        raise CostModelError(f"{path}: {bad[0]}={d[bad[0]]!r} must be a positive integer")
    return shape_from_hf_config(d, str(path), hf_modules)


_INT_KEYS = ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "hidden_size", "num_hidden_layers",
             "num_attention_heads", "intermediate_size", "num_key_value_heads", "max_position_embeddings")


def _bert_presets() -> dict[str, dict]:
    return {name: c.to_dict() for name, c in bert.PRESETS.items()}


@dataclass(frozen=True)
class LayerCost:
    """One layer of the layer list, for one micro-batch on one tensor-parallel rank."""

    name: str
    kind: str
    """Class name (what ``type:REGEX`` partitions match)."""
    params: int
    flops_fwd: float
    flops_bwd: float
    activation_bytes: int
    """Kept from forward to backward, per micro-batch."""
    output_bytes: int
    """The message this layer sends when a stage ends after it."""
    workspace_bytes: int = 0
    """Transient bytes during its backward beyond the kept activations (logits gradients)."""


def layer_costs(shape: ModelShape, micro_batch: int, seq_len: int, dtype: str = "fp32",
                tp: int = 1) -> list[LayerCost]:
    """Costs of every layer in layer-list order."""
    b, s, d = micro_batch, seq_len, ACT_BYTES[dtype]
    n, h, v = b * s, shape.hidden, shape.vocab_size
    emb, block, norm, head = _KINDS[shape.family]
    msg = n * h * d + (n * 8 if shape.family == "bert" else 0)  # BERT also passes its int64 mask
    out: list[LayerCost] = []
    # Embedding: saves the int64 ids (and positions); the vocabulary table shards over tp.
    pos_params = shape.positions * h if shape.family != "llama" else 0
    emb_params = v * h // tp + pos_params + shape.type_vocab * h + (2 * h if shape.family == "bert" else 0)
    emb_act = n * 8 + (s * 8 if shape.family != "llama" else 0)  # ids (and GPT's positions; rotary: none)
    if shape.family == "bert":  # token types (HF: a slice of its buffer, with its position-id buffer), LayerNorm
        emb_act += n * (h * d + 2 * d) + (shape.positions * 8 if shape.hf_modules else n * 8)
    emb_act += n * h * dropout_mask_bytes(shape.embd_dropout, d)
    out.append(LayerCost(emb[0], emb[1], emb_params, 0.0, 0.0, emb_act, msg))
    for i in range(shape.num_layers):
        p, ff, act = _block(shape, b, s, d, tp)
        out.append(LayerCost(block[0].format(i=i), block[1], p, ff, 2 * ff, act, msg))
    if norm is not None:  # LayerNorm: input, mean, rstd; HF RMSNorm: fp32 input copy, rstd, normalised value
        norm_act = n * (4 * h + 4 + h * d) if shape.family == "llama" else n * h * d + 2 * n * d
        out.append(LayerCost(norm[0], norm[1], h if shape.family == "llama" else 2 * h, 0.0, 0.0, norm_act, msg))
    head_params = v * h // tp
    head_flops = 2.0 * n * h * v / tp
    head_act = n * h * d + n * (v // tp) * 4 + n * 8
    if shape.family == "bert":  # pooler + NSP, MLM transform (h x h, LayerNorm), decoder bias
        head_params += 2 * h * h + 2 * h + 2 * h + 2 + 2 * h + v // tp
        head_flops += 2.0 * n * h * h + 2.0 * b * (h * h + 2 * h)
        head_act += 3 * n * h * d
    workspace = n * (v // tp) * (d + 8)  # logits, their fp32 copy and gradient during backward
    out.append(LayerCost(head[0], head[1], head_params, head_flops, 2 * head_flops, head_act, n * (v // tp) * d,
                         workspace))
    return out


def _block(shape: ModelShape, b: int, s: int, d: int, tp: int) -> tuple[int, float, int]:
    """(parameters, forward FLOPs, activation bytes) of one transformer block on one tp rank."""
    n, h, f = b * s, shape.hidden, shape.ffn
    if shape.family == "llama":
        qd, kvd = shape.heads * shape.hd, shape.kvh * shape.hd
        params = (2 * h * qd + 2 * h * kvd + 3 * h * f) // tp + 2 * h
        if shape.qkv_bias:
            params += (qd + 2 * kvd) // tp
        flops = 2.0 * n * (2 * h * qd + 2 * h * kvd + 3 * h * f) / tp + 2.0 * b * s * s * qd / tp
        return params, flops, _llama_kept(shape, b, s, d, tp)
    causal = shape.family == "gpt2"
    # weights and column-parallel biases (qkv, fc) shard; row-parallel biases and norms replicate
    params = (4 * h * h + 2 * h * f) // tp + (3 * h + f) // tp + 2 * h + 4 * h
    attn = (2.0 if causal else 4.0) * b * s * s * h / tp
    flops = 2.0 * n * (4 * h * h + 2 * h * f) / tp + attn
    return params, flops, _gpt_bert_kept(shape, b, s, d, tp)


def dropout_mask_bytes(p: float, d: int) -> int:
    """Bytes per element a training-mode ``nn.Dropout`` keeps for backward: on CPU its mask, in the
    activation's dtype (``d`` bytes; CUDA's fused kernel keeps 1-byte masks: not modelled)."""
    return d if p > 0 else 0


def _attention_kept(shape: ModelShape, b: int, s: int, d: int, tp: int) -> int:
    """What scaled_dot_product_attention keeps beyond its q/k/v input's producer, on CPU.

    Without dropout the fused (flash) kernel keeps the fused qkv output (3h), its output (h) and
    the fp32 log-sum-exp per head. With dropout on the probabilities it falls back to the math
    kernel, which computes in fp32 whatever the dtype: fp32 copies of q, k and v (3h x 4 bytes),
    and three fp32 (heads, s, s) tensors per sequence (the softmax, the dropout mask and the
    dropped probabilities); its output reaches the projection in the activation dtype (h x d).
    """
    n, hl, heads = b * s, shape.hidden // tp, shape.heads // tp
    if shape.attn_dropout > 0:
        return n * hl * (3 * 4 + d) + 3 * b * heads * s * s * 4
    return n * hl * 4 * d + n * heads * 4


def _gpt_bert_kept(shape: ModelShape, b: int, s: int, d: int, tp: int) -> int:
    """Kept bytes of a GPT-2 (pre-LN) or BERT (post-LN) block, as saved-tensor hooks count them on CPU
    (`tests/test_cost.py`): two LayerNorm inputs and their mean / rstd (replicated over tp), the qkv
    input, the attention (`_attention_kept`), the MLP input, the activation's input and the second
    projection's input (HF GPT-2's composed ``gelu_new`` keeps three (b, s, f) tensors more), each
    sub-layer's dropout mask, and BERT's fp32 padding mask (model_zoo's; the flash path keeps it)."""
    n, h, fl = b * s, shape.hidden, shape.ffn // tp
    kept = n * d * (2 * h + 2 * h // tp + 2 * fl) + 4 * n * d + _attention_kept(shape, b, s, d, tp)
    kept += 2 * n * h * dropout_mask_bytes(shape.hidden_dropout, d)
    if shape.family == "gpt2" and shape.hf_modules:
        kept += 3 * n * fl * d
    if shape.family == "bert" and not shape.hf_modules and shape.attn_dropout == 0:
        kept += n * d
    return kept


def _llama_kept(shape: ModelShape, b: int, s: int, d: int, tp: int) -> int:
    """Kept bytes of an HF Llama / Mistral / Qwen2 decoder layer on CPU (`tests/test_cost.py`).

    Each of the two RMSNorms upcasts its input to fp32 and keeps that copy (h x 4; in fp32 the input
    itself), its fp32 rstd, the normalised value it multiplies by the weight and the output the
    projections read (2 x h x d). Rotary positions keep cos and sin (s x head_dim each, shared by the
    micro-batch). Attention (the fused kernel, grouped-query heads as they are) keeps the rotated q,
    k, v, its output and the fp32 log-sum-exp. The gated MLP keeps gate, up and SiLU outputs and the
    down projection's input (4 x f).
    """
    n, h = b * s, shape.hidden
    qd, kvd, fl = shape.heads * shape.hd // tp, shape.kvh * shape.hd // tp, shape.ffn // tp
    norms = 2 * n * (4 * h + 4 + 2 * h * d)
    attention = n * d * (2 * qd + 2 * kvd) + n * (shape.heads // tp) * 4 + 2 * s * shape.hd * d
    return norms + attention + 4 * n * fl * d


def bytes_per_param(precision: str, optimizer: str, zero_dp: int = 1) -> float:
    """Static bytes per parameter on its stage: what it holds from the first backward to the step.

    fp32: weight + gradient (4 + 4) + optimizer state. fp16/bf16: 2-byte weight and gradient and
    the fp32 master weight (2 + 2 + 4) + fp32 optimizer state: the fp32 master gradient exists only
    during the step (`MasterWeights.grads_to_master` frees each 2-byte gradient as it makes it;
    `step_bytes_per_param`). So 8 + state in every precision: 16 for AdamW and LAMB, 12 for SGD;
    `tests/test_cost_families.py` measures a real step.

    ``zero_dp``: ZeRO-1 over that many data-parallel replicas (`mp_toolkit.engine.zero`) divides
    what only a piece's owner keeps -- the optimizer state and, under fp16 / bf16, the fp32 master
    weight -- by it: fp32 + Adam 16 -> 8 + 8/dp, bf16 + Adam 16 -> 4 + 12/dp (Megatron's
    distributed-optimizer table, whose bf16 row keeps a 4-byte main gradient per parameter on every
    replica, reads 18 -> 6 + 12/dp). 1: no ZeRO.
    """
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise CostModelError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATE_BYTES)}")
    state = OPTIMIZER_STATE_BYTES[optimizer]
    kept, owned = (8, state) if precision == "fp32" else (4, 4 + state)  # replicated, partitioned by ZeRO-1
    return kept + owned / zero_dp


OPTIMIZER_STEP_BYTES = {"adamw": 0, "adam": 0, "lamb": 0, "lars": 4, "sgd": 4, "adagrad": 8, "rmsprop": 8}
"""Temporaries per parameter of the optimizer's own step, measured on CPU (weight decay 0.01): torch's
fused Adam / AdamW and our LAMB (u in the gradient's memory, a fixed 1 MiB scratch) make none; torch's
foreach SGD and our LARS a decayed copy of the gradients; Adagrad and RMSprop two fp32 buffers."""


def step_bytes_per_param(precision: str, optimizer: str) -> int:
    """Bytes per parameter above `bytes_per_param` at the optimizer step's peak (activations are
    freed by then): fp16/bf16 replace each 2-byte gradient by the fp32 master gradient (+2), and
    the optimizer's temporaries (`OPTIMIZER_STEP_BYTES`)."""
    if optimizer not in OPTIMIZER_STEP_BYTES:
        raise CostModelError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STEP_BYTES)}")
    return (0 if precision == "fp32" else 2) + OPTIMIZER_STEP_BYTES[optimizer]


def total_parameters(shape: ModelShape) -> int:
    """Unique parameters of the whole model (a tied weight counted once), tp=1."""
    costs = layer_costs(shape, 1, 1)
    tied = shape.vocab_size * shape.hidden if shape.tied else 0
    return sum(c.params for c in costs) - tied
