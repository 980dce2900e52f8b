"""What names an ``--hf DIR`` model (`HFSource`, the family "hf"'s config) and the model it builds
(`HFModel`). Light on purpose: the family table imports this for every run, so it imports neither
transformers nor the adapters (seconds to import); `mp_toolkit.hf.pretrained.build_model` builds one.

The model is built without its weights (parameters on meta, `mp_toolkit.hf.pretrained.skeleton`);
each rank reads its own layers' tensors from DIR when `mp_toolkit.run.compose` materialises them
(`HFModel.shard_value`), so no rank holds the whole model (DESIGN.md invariant 9)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mp_toolkit.errors import ConfigError
from mp_toolkit.hf.weights import WeightsError

BERT = ("BertForPreTraining", "BertForMaskedLM")


@dataclass(frozen=True)
class HFSource:
    """A save_pretrained directory: where it is, its architecture and its HF config as JSON values
    (what checkpoints store as ``hf_config`` and resume compares; the path is not compared)."""

    path: str
    architecture: str
    config: dict

    @property
    def positions(self) -> int:
        return self.config.get("n_positions") or self.config["max_position_embeddings"]

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def is_bert(self) -> bool:
        return self.architecture in BERT

    @property
    def tokenizer_file(self) -> Path | None:
        f = Path(self.path) / "tokenizer.json"
        return f if f.is_file() else None

    def to_dict(self) -> dict:
        return self.config


class HFModel(nn.Module):
    """An HF model as the trainer sees model_zoo's: ``named_layers()`` and ``tie_groups()`` of its
    `from_hf` layer list (``layers``), built on meta, and `initial_value` / `shard_value`
    (`mp_toolkit.parallel.materialize`) from ``weights`` (`mp_toolkit.hf.pretrained.PretrainedWeights`)."""

    def __init__(self, model: nn.Module, weights, layers):
        super().__init__()
        self.model, self.weights = model, weights
        self._named = list(zip(layers.names, layers.layers))
        self._ties = layers.tie_groups

    @property
    def architecture(self) -> str:
        return type(self.model).__name__

    def named_layers(self) -> list[tuple[str, nn.Module]]:
        return self._named

    def tie_groups(self):
        return self._ties

    def initial_value(self, name: str) -> torch.Tensor:
        """Parameter ``name`` (a layer-list name) as DIR stores it."""
        return self.read(self.weights.initial_value, name)

    def shard_value(self, name: str, layout: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
        """This rank's tensor-parallel share of parameter ``name``, read from DIR as slices."""
        return self.read(self.weights.shard_value, name, layout, tp_rank, tp)

    def read(self, fn, *args):
        """``fn(*args)``, a `mp_toolkit.hf.weights.WeightsError` as a ConfigError (exit 2, one line)."""
        try:
            return fn(*args)
        except WeightsError as e:
            raise ConfigError(f"--hf {self.weights.files.directory}: {e}") from None
