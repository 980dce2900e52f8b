"""Initial values that do not depend on how the model is split (DESIGN.md invariant 9).

Every parameter gets its initial value from a generator of its own, seeded by the model's
``init_seed`` and the parameter's *canonical name* (``"h.3.attn.proj.weight"``; a tied weight uses
its first member's name, so the LM head drawn on the last stage equals the embedding drawn on the
first). The value is therefore a function of (seed, name) alone: the unsplit model, any pipeline
cut and any tensor-parallel split -- which slices the same full value -- start from the same
weights, and a rank can draw the values of its own layers without building the others.

A model describes its init as data: ``{parameter name: InitRule}`` built once from its module
types at construction (before any parallelism changes the modules), and ``initial_value(name)``
draws the full-size tensor. This module imports nothing distributed and nothing from mp_toolkit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class InitRule:
    """How one parameter starts: ``kind`` "normal" (mean 0, ``std``), "zeros" or "ones".

    ``key`` is the canonical name its generator is seeded with; ``zero_row`` is a row set to zero
    after drawing (an embedding's ``padding_idx``)."""

    shape: tuple[int, ...]
    kind: str
    key: str
    std: float = 0.0
    zero_row: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("normal", "zeros", "ones"):
            raise ValueError(f"InitRule.kind={self.kind!r}: choose normal, zeros or ones")


def draw_seed() -> int:
    """A model's ``init_seed`` from torch's global CPU generator, so ``torch.manual_seed(s)`` then
    building the model fixes its weights (also inside ``with torch.device("meta")``)."""
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())


def generator_for(seed: int, key: str) -> torch.Generator:
    """A CPU generator seeded by (seed, key); stable across processes, machines and Python runs."""
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def initial_value(rule: InitRule, seed: int) -> torch.Tensor:
    """The full-size float32 CPU tensor ``rule`` describes, drawn from its own generator."""
    if rule.kind == "zeros":
        return torch.zeros(rule.shape)
    if rule.kind == "ones":
        return torch.ones(rule.shape)
    value = torch.empty(rule.shape).normal_(0.0, rule.std, generator=generator_for(seed, rule.key))
    if rule.zero_row is not None:
        value[rule.zero_row].zero_()
    return value


def transformer_rules(named_layers, weight: Callable[[str, torch.nn.Module, str, tuple[int, ...]], InitRule]
                      ) -> dict[str, InitRule]:
    """The init every transformer here shares, as data: LayerNorm weights one, LayerNorm and other
    biases zero, and ``weight(path in its layer, module, name, shape)`` for every other parameter
    (Linear / Embedding weights, LM heads). Names are "{layer}.{path}" over ``named_layers``."""
    rules: dict[str, InitRule] = {}
    for layer_name, layer in named_layers:
        for path, module in layer.named_modules():
            prefix = f"{layer_name}.{path}" if path else layer_name
            for pname, p in module.named_parameters(recurse=False):
                name, shape = f"{prefix}.{pname}", tuple(p.shape)
                if isinstance(module, torch.nn.LayerNorm):
                    rules[name] = InitRule(shape, "ones" if pname == "weight" else "zeros", name)
                elif pname == "bias":
                    rules[name] = InitRule(shape, "zeros", name)
                else:
                    rules[name] = weight(path, module, name, shape)
    return rules


def reset_from_rules(model: torch.nn.Module, rules: dict[str, InitRule], seed: int) -> None:
    """Copy every rule's value into ``model``'s parameter of that name (skipped on the meta device,
    where a rank draws only its own layers later)."""
    with torch.no_grad():
        for name, rule in rules.items():
            p = model.get_parameter(name)
            if not p.is_meta:
                p.copy_(initial_value(rule, seed))


__all__ = ["InitRule", "draw_seed", "generator_for", "initial_value", "reset_from_rules", "transformer_rules"]
