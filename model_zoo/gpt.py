"""A single-device GPT-2 that exposes an ordered layer list.

The model is a plain ``nn.Module``; pipeline and tensor parallelism are applied afterwards by
functions in ``mp_toolkit`` (see DESIGN.md, invariant 2). Every layer's ``forward`` takes one
tensor and returns one tensor, so ``named_layers()`` can be cut anywhere into pipeline stages:

    embed -> h.0 -> ... -> h.{n_layer-1} -> ln_f -> lm_head

Parameter names follow nanoGPT / HuggingFace GPT-2 (``attn.qkv`` is HF's ``attn.c_attn``,
``attn.proj`` is ``attn.c_proj``, ``mlp.fc`` is ``mlp.c_fc``, ``mlp.proj`` is ``mlp.c_proj``).
This module imports nothing distributed and nothing from ``mp_toolkit``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from model_zoo.config_io import check_type, read_config_json
from model_zoo.init import InitRule, draw_seed, initial_value, reset_from_rules, transformer_rules
from model_zoo.recompute import attention_core

# activation_function -> the ``approximate`` argument of F.gelu.
# HF's "gelu_new" is the tanh approximation; "gelu" is the exact erf form.
_GELU_APPROX = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2 hyper-parameters, spelled like HuggingFace's ``GPT2Config``."""

    vocab_size: int = 50257
    """Number of token ids (rows of the embedding and of the LM head)."""
    n_positions: int = 1024
    """Longest sequence the learned position embedding covers."""
    n_embd: int = 768
    """Hidden size C."""
    n_layer: int = 12
    """Number of transformer blocks."""
    n_head: int = 12
    """Attention heads per block; must divide n_embd."""
    n_inner: Optional[int] = None
    """MLP hidden size; None means 4 * n_embd."""
    activation_function: str = "gelu_new"
    """"gelu_new" (tanh approximation, GPT-2's choice) or "gelu" (exact)."""
    resid_pdrop: float = 0.0
    """Dropout on the attention and MLP outputs before the residual add."""
    embd_pdrop: float = 0.0
    """Dropout on token + position embeddings."""
    attn_pdrop: float = 0.0
    """Dropout on attention probabilities (training only)."""
    layer_norm_epsilon: float = 1e-5
    """LayerNorm epsilon."""
    initializer_range: float = 0.02
    """Std of the normal init of Linear and Embedding weights."""
    tie_word_embeddings: bool = True
    """Share one Parameter between the token embedding and the LM head."""
    bias: bool = True
    """Biases in Linear layers and LayerNorms (GPT-2 has them)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_type("GPTConfig", f.name, getattr(self, f.name), f.type)
            if f.type == "float":  # JSON may spell 0.0 as 0
                object.__setattr__(self, f.name, float(getattr(self, f.name)))
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be a positive integer")
        if self.n_inner is not None and self.n_inner <= 0:
            raise ValueError(f"GPTConfig.n_inner={self.n_inner} must be a positive integer or None (4 * n_embd)")
        if self.n_embd % self.n_head != 0:
            divisors = [h for h in range(1, min(self.n_embd, 64) + 1) if self.n_embd % h == 0]
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                f"choose n_head in {divisors} or change n_embd to a multiple of {self.n_head}"
            )
        if self.activation_function not in _GELU_APPROX:
            raise ValueError(
                f"GPTConfig.activation_function={self.activation_function!r} is not supported: "
                f"choose one of {', '.join(_GELU_APPROX)}"
            )
        for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"GPTConfig.{name}={p} must be in [0, 1)")
        for name in ("layer_norm_epsilon", "initializer_range"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be > 0")

    @property
    def inner_size(self) -> int:
        """The MLP hidden size after resolving ``n_inner=None``."""
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPTConfig":
        """Build from a dict such as HF's config.json; unknown keys ("architectures", ...) are ignored."""
        if not isinstance(d, dict):
            raise ValueError(f"GPT config must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, path: str | Path) -> "GPTConfig":
        """Read a GPT-2 ``config.json`` (or a directory holding one)."""
        return cls.from_dict(read_config_json(path, "GPT"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS: dict[str, GPTConfig] = {
    # Used by the tests: a forward/backward takes milliseconds.
    "gpt-tiny": GPTConfig(vocab_size=256, n_positions=64, n_embd=32, n_layer=4, n_head=4),
    # The 2-minute CPU demo.
    "gpt-small-cpu": GPTConfig(vocab_size=4096, n_positions=256, n_embd=128, n_layer=4, n_head=4),
    # The four GPT-2 sizes (Radford et al. 2019), 124M / 355M / 774M / 1.5B parameters.
    "gpt2": GPTConfig(),
    "gpt2-medium": GPTConfig(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": GPTConfig(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": GPTConfig(n_embd=1600, n_layer=48, n_head=25),
}


def get_config(name_or_path: str | Path) -> GPTConfig:
    """A preset by name, or a GPT-2 ``config.json`` (file or model directory) by path."""
    if isinstance(name_or_path, str) and name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return GPTConfig.from_json(path)
    raise ValueError(
        f"unknown model {str(name_or_path)!r}: choose one of {', '.join(PRESETS)} "
        f"or a path to a GPT-2 config.json"
    )


class GPTEmbedding(nn.Module):
    """Token + learned position embedding: (B, T) int64 -> (B, T, C).

    ``tokens`` (data, set by whoever composes the model; None: every token): a function of the
    sequence length and the device giving the positions of the tokens this layer embeds, e.g. one
    rank's slice of every sequence under context parallelism; their ids and learned positions are taken."""

    tokens = None

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.n_positions = config.n_positions

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        if T > self.n_positions:
            raise ValueError(f"sequence length {T} exceeds n_positions={self.n_positions}")
        if self.tokens is None:
            pos = torch.arange(T, device=input_ids.device)  # (T,)
        else:
            pos = self.tokens(T, input_ids.device)  # (t,): the positions of the tokens embedded here
            input_ids = input_ids[:, pos]
        return self.drop(self.wte(input_ids) + self.wpe(pos))  # (B, T, C) + (T, C) -> (B, T, C)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection.

    ``core`` (data, set by whoever composes the model; None: `attention_core`): the function that
    attends, called as `attention_core` is, e.g. ring attention over the slices of a sequence
    that context-parallel ranks hold."""

    core = None

    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        # Column-parallel under TP (heads split across ranks) ...
        self.qkv = nn.Linear(C, 3 * C, bias=config.bias)
        # ... and row-parallel, so one all-reduce closes the block (Megatron-LM, Shoeybi et al. 2019).
        self.proj = nn.Linear(C, C, bias=config.bias)
        self.resid_drop = nn.Dropout(config.resid_pdrop)
        self.attn_pdrop = config.attn_pdrop
        # head_dim, not n_head, is fixed: a tensor-parallel split of qkv leaves fewer local heads.
        self.head_dim = C // config.n_head

    def forward(self, x: torch.Tensor, recompute_core: bool = False) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)  # (B, T, 3C') -> 3 x (B, T, C')
        # (B, T, C') -> (B, nh, T, hs); C' = nh * hs is C, or C / tp after a tensor-parallel split
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = (self.core or attention_core)(q, k, v, recompute_core,
                                          dropout_p=self.attn_pdrop if self.training else 0.0,
                                          is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, nh, T, hs) -> (B, T, C')
        return self.resid_drop(self.proj(y))  # (B, T, C)


class MLP(nn.Module):
    """fc -> GELU -> proj, with dropout; (B, T, C) -> (B, T, C)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.inner_size, bias=config.bias)
        self.act = nn.GELU(approximate=_GELU_APPROX[config.activation_function])
        self.proj = nn.Linear(config.inner_size, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)).

    ``recompute`` (data, set after construction; one of `model_zoo.recompute.RECOMPUTE_MODES`):
    "selective" runs the attention core again during the backward instead of keeping its tensors
    (`model_zoo.recompute.attention_core`)."""

    recompute: str = "none"

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), recompute_core=self.recompute == "selective")
        return x + self.mlp(self.ln_2(x))


class GPTFinalNorm(nn.Module):
    """The final LayerNorm: (B, T, C) -> (B, T, C)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


class GPTLMHead(nn.Module):
    """Projection to vocabulary logits without bias: (B, T, C) -> (B, T, V)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.vocab_size, config.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class GPT(nn.Module):
    """GPT-2 as an ordered list of one-tensor-in, one-tensor-out layers.

    Built inside ``with torch.device("meta")`` it holds shapes only: `initial_value` draws any one
    parameter's starting value on demand (model_zoo/init.py), so a pipeline rank can materialise
    its own layers alone and still start from the unsplit model's weights."""

    def __init__(self, config: GPTConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        self.init_seed = draw_seed() if seed is None else seed
        self.embed = GPTEmbedding(config)
        self.h = nn.ModuleList(GPTBlock(config) for _ in range(config.n_layer))
        self.ln_f = GPTFinalNorm(config)
        self.lm_head = GPTLMHead(config)
        if config.tie_word_embeddings:
            # One Parameter object in two places; pipeline stages that hold both ends keep the
            # tie, stages that hold one end sync its gradient through tie_groups().
            self.lm_head.weight = self.embed.wte.weight
        self.init_rules = self._init_rules()
        self.reset_parameters()

    def _init_rules(self) -> dict[str, InitRule]:
        """GPT-2 init as data: N(0, initializer_range) for Linear / Embedding weights and the LM
        head, zero biases, unit LayerNorms; the residual projections N(0, std / sqrt(2 * n_layer)),
        since each block adds two of them to the residual stream (GPT-2 paper, section 2.3)."""
        std = self.config.initializer_range
        residual_std = std / math.sqrt(2 * self.config.n_layer)
        scaled = ("attn.proj", "mlp.proj")
        rules = transformer_rules(self.named_layers(), lambda path, module, name, shape: InitRule(
            shape, "normal", name, residual_std if path.endswith(scaled) else std))
        if self.config.tie_word_embeddings:  # the head is the embedding: the same draw wherever held
            rules["lm_head.weight"] = rules["embed.wte.weight"]
        return rules

    def initial_value(self, name: str) -> torch.Tensor:
        """The starting value of parameter ``name`` ("{layer}.{path}"), full size, float32 on CPU."""
        return initial_value(self.init_rules[name], self.init_seed)

    def reset_parameters(self) -> None:
        """Every parameter from its own generator, seeded by (init_seed, its name); on the meta
        device nothing is drawn (each rank draws its own layers when it materialises them)."""
        reset_from_rules(self, self.init_rules, self.init_seed)

    def named_layers(self) -> list[tuple[str, nn.Module]]:
        """Layers in execution order: embed, h.0 ... h.{n_layer-1}, ln_f, lm_head."""
        return (
            [("embed", self.embed)]
            + [(f"h.{i}", block) for i, block in enumerate(self.h)]
            + [("ln_f", self.ln_f), ("lm_head", self.lm_head)]
        )

    def tie_groups(self) -> list[list[tuple[str, str]]]:
        """Groups of (layer name, parameter name) that are one Parameter; empty when untied."""
        if self.config.tie_word_embeddings:
            return [[("embed", "wte.weight"), ("lm_head", "weight")]]
        return []

    def num_parameters(self) -> int:
        """Number of parameters, counting tied ones once."""
        return sum(p.numel() for p in self.parameters())  # parameters() de-duplicates shared ones

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = input_ids
        for _, layer in self.named_layers():
            x = layer(x)
        return x  # (B, T, V) logits


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; labels equal to -100 are ignored."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )


# Megatron-LM tensor-parallel plan (Shoeybi et al. 2019), as data: {module path suffix: style},
# matched against "{layer name}.{module path}" (e.g. "attn.qkv" -> "h.0.attn.qkv"; "lm_head" is the
# whole layer). qkv is split with stride 3 so each rank keeps q, k, v of its own heads; each
# column/row pair costs one all-reduce; embedding and LM head split the (tied) vocab rows, so the
# last layer returns local logits (B, T, V / tp) for a vocab-parallel cross-entropy. LayerNorms and
# the position embedding stay replicated. Applied by mp_toolkit's apply_tensor_parallel.
TP_PLAN: dict[str, str] = {
    "embed.wte": "vocab",
    "attn.qkv": "qkv",
    "attn.proj": "row",
    "mlp.fc": "column",
    "mlp.proj": "row",
    "lm_head": "vocab",
}


# Sequence-parallel plan (Korthikanti et al. 2022), as data, applied after TP_PLAN by mp_toolkit's
# apply_sequence_parallel: the embedding keeps its slice of the sequence ("scatter"); attention, the
# MLP and the LM head gather the whole sequence before their column-parallel projections ("gather");
# the residual dropouts run on the slices ("dropout"). LayerNorms and residuals hold T / tp tokens.
SP_PLAN: dict[str, str] = {
    "embed": "scatter",
    "attn": "gather",
    "mlp": "gather",
    "attn.resid_drop": "dropout",
    "mlp.drop": "dropout",
    "lm_head": "gather",
}
