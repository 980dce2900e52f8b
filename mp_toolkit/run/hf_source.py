"""What names an ``--hf DIR`` model (`HFSource`, the family "hf"'s config) and the model it builds
(`HFModel`). Light on purpose: the family table imports this for every run, and transformers (seconds
to import) is imported only when an HF model is built; the rest of the family is `hf_family`.

The model is built without its weights (parameters on meta, `mp_toolkit.hf.skeleton`); each rank
reads its own layers' tensors from DIR when `mp_toolkit.run.compose` materialises them
(`HFModel.shard_value`), so no rank holds the whole model (DESIGN.md invariant 9)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mp_toolkit.run.config import ConfigError

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

    def build(self) -> "HFModel":
        """The model's skeleton: parameters on meta, buffers as ``__init__`` computes them (under a meta
        default device, validate's plan, those too); `HFModel.shard_value` reads DIR's weights. The
        config is ours: a BERT corpus's [PAD] replaces the saved pad_token_id (the embedding's padding_idx)."""
        import transformers

        from mp_toolkit.hf import PretrainedWeights, load_config, skeleton  # imports transformers (seconds)

        with _default_dtype(torch.float32):  # the parameters' dtype, as from_pretrained(dtype=torch.float32)
            model = skeleton(getattr(transformers, self.architecture), load_config(self.config))
        return HFModel(model, PretrainedWeights(model, self.path))

    def check_weights(self) -> None:
        """ConfigError (one line naming the file and the tensor) unless DIR's safetensors hold every
        parameter with the config's shape, in whole files; reads the headers only."""
        with torch.device("meta"):
            model = self.build()
        model.read(model.weights.check)


class HFModel(nn.Module):
    """An HF model as the trainer sees model_zoo's: ``named_layers()`` and ``tie_groups()`` of `from_hf`,
    built on meta, and `initial_value` / `shard_value` (`mp_toolkit.parallel.materialize`) from ``weights``
    (`mp_toolkit.hf.PretrainedWeights`)."""

    def __init__(self, model: nn.Module, weights):
        super().__init__()
        from mp_toolkit.hf import from_hf  # imports transformers (seconds): only --hf runs build one

        self.model, self.weights = model, weights
        layers = from_hf(model)
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
        """``fn(*args)``, a `mp_toolkit.hf.WeightsError` as a ConfigError (exit 2, one line)."""
        from mp_toolkit.hf import WeightsError  # imports transformers (seconds): only --hf runs build one

        try:
            return fn(*args)
        except WeightsError as e:
            raise ConfigError(f"--hf {self.weights.files.directory}: {e}") from None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Floating tensors made inside default to ``dtype``."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
