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
  optimizer step's temporaries (`step_bytes_per_param`); both match a measured step. Each optimizer's
  share (`OPTIMIZER_BYTES`) depends on its momentum and weight decay where the optimizer's own does.
* **Accumulation temporaries**: after a step's first micro-batch every backward hands each weight
  gradient to ``.grad`` as a temporary beside it (``grad += new``), the largest parameter's at once
  (`LayerCost.accumulated_bytes`); an embedding's, by rows, one row per distinct token (and one).

With tensor parallelism ``tp`` the sharded matrices (and their FLOPs and activations) divide by
``tp``; norms, position embeddings and biases of row-parallel layers are replicated.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mp_toolkit.arch.architectures import ARCHITECTURES
from mp_toolkit.arch.costs import dropout_mask_bytes
from mp_toolkit.arch.hf_config import MAX_LAYERS, shape_from_hf_config
from mp_toolkit.arch.shape import ModelShape
from mp_toolkit.arch.zoo import preset_family, preset_names
from mp_toolkit.errors import CostModelError
from mp_toolkit.user_files import link_note, parse_json, read_config_text, special_kind

__all__ = ["ACT_BYTES", "MAX_LAYERS", "OPTIMIZER_BYTES", "OPTIMIZER_STATE_BYTES", "CostModelError", "LayerCost",
           "ModelShape", "OptimizerBytes", "bytes_per_param", "dropout_mask_bytes", "layer_costs", "model_shape",
           "optimizer_bytes", "shape_from_hf_config", "step_bytes_per_param", "total_parameters"]

ACT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def model_shape(model: str, hf_modules: bool = False) -> ModelShape:
    """Our preset name (``gpt-tiny``, ``gpt2-xl``, ``bert-base``, ...) or a HF ``config.json`` path;
    ``hf_modules``: the config's model is built from transformers' modules (`ModelShape.hf_modules`)."""
    zoo = preset_family(model)
    if hf_modules and zoo is not None:
        raise CostModelError(f"{model} is a model_zoo preset: transformers' modules need a config.json path")
    if zoo is not None:
        return zoo.shape(zoo.presets[model])
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    special = special_kind(path)
    if special is not None:
        raise CostModelError(f"--model {model}{link_note(path)} is {special}, not a config.json")
    if not path.is_file():
        raise CostModelError(f"unknown model {model!r}: choose one of {', '.join(preset_names())} "
                             "or a config.json path")
    try:
        d = parse_json(read_config_text(path, "--model"))
    except ValueError as e:
        raise CostModelError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(d, dict):
        raise CostModelError(f"{path}: a config.json must hold a JSON object")
    if "model_type" not in d and "n_embd" in d:
        d = {"model_type": "gpt2", **d}  # our own GPTConfig.to_dict() files
    return shape_from_hf_config(d, str(path), hf_modules)


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
    accumulated_bytes: int = 0
    """The largest gradient its backward hands to ``.grad`` at once, a temporary beside ``.grad`` in
    every backward of a step after the first (`mp_toolkit.partition.memory.StageMemory.accumulated`)."""


def layer_costs(shape: ModelShape, micro_batch: int, seq_len: int, dtype: str = "fp32",
                tp: int = 1, sp: bool = False, cp: int = 1) -> list[LayerCost]:
    """Costs of every layer in layer-list order: each kind of layer as its architecture's record
    counts it (`mp_toolkit.arch.costs`). ``sp``: under sequence parallelism (tp > 1) each rank
    keeps 1 / tp of a block's split part (`LayerArithmetic.block_split`), of the final norm and of
    an LM head's input, and the hidden state every layer before the head sends is 1 / tp of the tokens.
    ``cp``: under context parallelism a rank holds seq / cp of every sequence: every per-token figure is its
    tokens', and its ring attention computes 1 / cp of the causal triangle's pairs, the zig-zag split's
    balanced share (`mp_toolkit.parallel.context_parallel`)."""
    arch = ARCHITECTURES[shape.family]
    kinds, rules = arch.layers, arch.costs
    b, s, d = micro_batch, seq_len // cp, ACT_BYTES[dtype]
    n, h, v = b * s, shape.hidden, shape.vocab_size
    parts = tp if sp else 1
    msg = n * h * d // parts + n * rules.mask_bytes
    largest = rules.largest(shape, tp)  # gradients are in the parameters' dtype: d bytes per element
    params, kept = rules.embedding(shape, b, s, d, tp)
    # at tp 1 the tables are nn.Embedding, accumulated by rows (`engine.embedding_rows`): a row per distinct
    # token and a padding row; a vocabulary-parallel table is dense. A stage holding both ends of a tie keeps
    # it dense too, beside the head's: its static bytes count the tied weight twice, which covers that.
    rows = (min(n, v) + 1) * h if tp == 1 else largest.embedding
    out = [LayerCost(*kinds.embedding, params, 0.0, 0.0, kept, msg, accumulated_bytes=rows * d)]
    params, flops, kept = rules.block(shape, b, s, d, tp)
    if cp > 1:  # the rule counted the local tokens' own triangle: the ring's share is cp times that
        flops += (2.0 if arch.causal else 4.0) * (cp - 1) * b * s * s * shape.hidden / tp
    if parts > 1:
        kept -= rules.block_split(shape, n, d) * (parts - 1) // parts
    name, kind = kinds.block
    out += [LayerCost(name.format(i=i), kind, params, flops, 2 * flops, kept, msg,
                      accumulated_bytes=largest.block * d) for i in range(shape.num_layers)]
    if rules.final_norm is not None:
        params, kept = rules.final_norm(shape, n, d)
        kept //= parts
        out.append(LayerCost(*kinds.final_norm, params, 0.0, 0.0, kept, msg, accumulated_bytes=largest.final_norm * d))
    params, flops, kept = rules.head(shape, b, s, d, tp)
    if parts > 1 and rules.head_input_split:  # its projection keeps the input's local slice
        kept -= n * h * d * (parts - 1) // parts
    workspace = n * (v // tp) * (d + 8)  # logits, their fp32 copy and gradient during backward
    out.append(LayerCost(*kinds.head, params, flops, 2 * flops, kept, n * (v // tp) * d, workspace,
                         largest.head * d))
    return out


@dataclass(frozen=True)
class OptimizerBytes:
    """fp32 bytes per parameter of one optimizer as the run builds it (`mp_toolkit.optim.factory`: torch's
    fused Adam / AdamW, torch's foreach SGD, Adagrad and RMSprop, our LAMB and LARS): the state it keeps
    between steps and the temporaries of its step. `tests/test_optimizer_bytes.py` counts both on the
    real optimizers at each momentum and weight decay."""

    state: int
    """Kept whatever its settings: Adam's and LAMB's two moments, Adagrad's and RMSprop's sum of squares."""
    step: int = 0
    """Made by every step: none by fused Adam / AdamW and LAMB (its direction goes into the gradient's
    memory, beside a fixed 1 MiB scratch); LARS's scaled (and decayed) copy of the gradients; Adagrad's
    square root of its sums and scaled gradients (or, with decay, the decayed copy they reuse); RMSprop's
    square root of its averages."""
    momentum: float | None = None
    """The momentum it takes when none is given; None: it has none. A momentum buffer (4 B) is kept only
    when the momentum is not 0 (torch's SGD ``momentum_buffer``, RMSprop's, LARS's)."""
    decay_copy: bool = False
    """Its step makes a decayed copy of the gradients (4 B, ``grad.add(p, alpha=wd)``) when weight decay is
    not 0 (torch's foreach SGD and RMSprop); AdamW, LAMB and LARS decay in their own arithmetic."""

    def state_bytes(self, momentum: float | None = None) -> int:
        """State per parameter at ``momentum`` (None: the optimizer's default)."""
        mu = self.momentum if momentum is None else momentum
        return self.state + (4 if self.momentum is not None and mu else 0)

    def step_bytes(self, weight_decay: float) -> int:
        """Step temporaries per parameter at ``weight_decay``."""
        return self.step + (4 if self.decay_copy and weight_decay else 0)


OPTIMIZER_BYTES = {
    "adamw": OptimizerBytes(8), "adam": OptimizerBytes(8), "lamb": OptimizerBytes(8),
    "lars": OptimizerBytes(0, step=4, momentum=0.9), "sgd": OptimizerBytes(0, momentum=0.9, decay_copy=True),
    "adagrad": OptimizerBytes(4, step=8), "rmsprop": OptimizerBytes(4, step=4, momentum=0.0, decay_copy=True),
}
"""Measured on CPU (`OptimizerBytes`); the default momenta are the factory's (SGD and LARS 0.9, RMSprop 0)."""
OPTIMIZER_STATE_BYTES = {name: o.state_bytes() for name, o in OPTIMIZER_BYTES.items()}
"""fp32 optimizer state per parameter at each optimizer's default momentum."""


def optimizer_bytes(optimizer: str) -> OptimizerBytes:
    """``optimizer``'s record; CostModelError (one line) for one the cost model does not know."""
    if optimizer not in OPTIMIZER_BYTES:
        raise CostModelError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_BYTES)}")
    return OPTIMIZER_BYTES[optimizer]


def bytes_per_param(precision: str, optimizer: str, zero_dp: int = 1, momentum: float | None = None) -> float:
    """Static bytes per parameter on its stage: what it holds from the first backward to the step.

    fp32: weight + gradient (4 + 4) + optimizer state. fp16/bf16: 2-byte weight and gradient and
    the fp32 master weight (2 + 2 + 4) + fp32 optimizer state: the fp32 master gradient exists only
    during the step (`MasterWeights.grads_to_master` frees each 2-byte gradient as it makes it;
    `step_bytes_per_param`). So 8 + state in every precision: 16 for AdamW and LAMB, 12 for SGD with
    momentum, 8 without (``momentum``: None is the optimizer's default, `OptimizerBytes.state_bytes`);
    `tests/test_cost_families.py` measures a real step.

    ``zero_dp``: ZeRO-1 over that many data-parallel replicas (`mp_toolkit.engine.zero`) divides
    what only a piece's owner keeps -- the optimizer state and, under fp16 / bf16, the fp32 master
    weight -- by it: fp32 + Adam 16 -> 8 + 8/dp, bf16 + Adam 16 -> 4 + 12/dp (Megatron's
    distributed-optimizer table, whose bf16 row keeps a 4-byte main gradient per parameter on every
    replica, reads 18 -> 6 + 12/dp). 1: no ZeRO.
    """
    state = optimizer_bytes(optimizer).state_bytes(momentum)
    kept, owned = (8, state) if precision == "fp32" else (4, 4 + state)  # replicated, partitioned by ZeRO-1
    return kept + owned / zero_dp


def step_bytes_per_param(precision: str, optimizer: str, weight_decay: float = 0.01) -> int:
    """Bytes per parameter above `bytes_per_param` at the optimizer step's peak (activations are
    freed by then): fp16/bf16 replace each 2-byte gradient by the fp32 master gradient (+2), and
    the optimizer's temporaries at ``weight_decay`` (`OptimizerBytes.step_bytes`)."""
    return (0 if precision == "fp32" else 2) + optimizer_bytes(optimizer).step_bytes(weight_decay)


def total_parameters(shape: ModelShape) -> int:
    """Unique parameters of the whole model (a tied weight counted once), tp=1."""
    costs = layer_costs(shape, 1, 1)
    tied = shape.vocab_size * shape.hidden if shape.tied else 0
    return sum(c.params for c in costs) - tied
