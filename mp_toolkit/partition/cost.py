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
* **Static bytes** per parameter depend on precision and optimizer (`bytes_per_param`).

With tensor parallelism ``tp`` the sharded matrices (and their FLOPs and activations) divide by
``tp``; norms, position embeddings and biases of row-parallel layers are replicated.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from model_zoo import bert, gpt

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


class CostModelError(ValueError):
    """A model description the cost model cannot read; one line for the user."""


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

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kvh(self) -> int:
        return self.kv_heads or self.heads


MAX_LAYERS = 10_000
"""More blocks than any model trained so far; beyond it a plan would not fit in memory."""


def shape_from_hf_config(d: dict, source: str = "config") -> ModelShape:
    """A `ModelShape` from a HuggingFace ``config.json`` dict of the GPT-2, BERT or Llama families."""
    shape = _read_shape(d, source)
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


def model_shape(model: str) -> ModelShape:
    """Our preset name (``gpt-tiny``, ``gpt2-xl``, ``bert-base``, ...) or a HF ``config.json`` path."""
    if model in gpt.PRESETS:
        c = gpt.PRESETS[model]
        return ModelShape("gpt2", c.vocab_size, c.n_embd, c.n_layer, c.n_head, c.inner_size, c.n_positions,
                          tied=c.tie_word_embeddings)
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
    return shape_from_hf_config(d, str(path))


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
    emb_act = n * 8 + s * 8 + (n * (h * d + 8 + 2 * d) + n * 8 if shape.family == "bert" else 0)
    out.append(LayerCost(emb[0], emb[1], emb_params, 0.0, 0.0, emb_act, msg))
    for i in range(shape.num_layers):
        p, ff, act = _block(shape, b, s, d, tp)
        out.append(LayerCost(block[0].format(i=i), block[1], p, ff, 2 * ff, act, msg))
    if norm is not None:
        out.append(LayerCost(norm[0], norm[1], h if shape.family == "llama" else 2 * h, 0.0, 0.0,
                             n * h * d + 2 * n * d, msg))
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
        # two norm inputs, q/k/v (k/v of the kv heads) and rotated q/k, attention out, o input,
        # gate/up inputs share the norm output; gate, up, SiLU and product outputs.
        act = n * d * (2 * h + (3 * qd + 3 * kvd) // tp + qd // tp + 4 * f // tp) + n * 4 * (2 + shape.heads // tp)
        return params, flops, act
    causal = shape.family == "gpt2"
    # weights and column-parallel biases (qkv, fc) shard; row-parallel biases and norms replicate
    params = (4 * h * h + 2 * h * f) // tp + (3 * h + f) // tp + 2 * h + 4 * h
    attn = (2.0 if causal else 4.0) * b * s * s * h / tp
    flops = 2.0 * n * (4 * h * h + 2 * h * f) / tp + attn
    act = n * d * (2 * h + 6 * h // tp + 2 * f // tp) + n * (4 * d + 4 * (shape.heads // tp))
    if shape.family == "bert":  # post-LN and eager attention keep the probabilities
        act += b * (shape.heads // tp) * s * s * d
    return params, flops, act


def bytes_per_param(precision: str, optimizer: str, zero_dp: int = 1) -> float:
    """Static bytes per parameter on its stage.

    fp32: weight + gradient (4 + 4) + optimizer state. fp16/bf16: 2-byte weight and gradient,
    fp32 master weight and master gradient (4 + 4), fp32 optimizer state (`MasterWeights`).

    ``zero_dp``: ZeRO-1 over that many data-parallel replicas (`mp_toolkit.engine.zero`) divides
    what only a piece's owner keeps -- the optimizer state and, under fp16 / bf16, the fp32 master
    weight and master gradient -- by it: fp32 + Adam 16 -> 8 + 8/dp, bf16 + Adam 20 -> 4 + 16/dp
    (Megatron's distributed-optimizer table, whose bf16 row keeps a 4-byte main gradient per
    parameter on every replica, reads 18 -> 6 + 12/dp). 1: no ZeRO.
    """
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise CostModelError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATE_BYTES)}")
    state = OPTIMIZER_STATE_BYTES[optimizer]
    kept, owned = (8, state) if precision == "fp32" else (4, 8 + state)  # replicated, partitioned by ZeRO-1
    return kept + owned / zero_dp


def total_parameters(shape: ModelShape) -> int:
    """Unique parameters of the whole model (a tied weight counted once), tp=1."""
    costs = layer_costs(shape, 1, 1)
    tied = shape.vocab_size * shape.hidden if shape.tied else 0
    return sum(c.params for c in costs) - tied
