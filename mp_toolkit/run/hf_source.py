"""What names an ``--hf DIR`` model (`HFSource`, the family "hf"'s config) and the model it builds
(`HFModel`). Light on purpose: the family table imports this for every run, and transformers (seconds
to import) is imported only when an HF model is built; the rest of the family is `hf_family`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

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
        """The model with DIR's weights; under a meta device (validate's plan) its shapes only."""
        import transformers

        from mp_toolkit.hf import load_config  # imports transformers (seconds): only --hf runs build one

        transformers.utils.logging.disable_progress_bar()  # one bar per rank says nothing
        cls = getattr(transformers, self.architecture)
        config = load_config(self.config)
        if torch.get_default_device().type == "meta":
            return HFModel(cls(config))
        # config=: a BERT corpus's [PAD] replaces the saved pad_token_id (the embedding's padding_idx)
        return HFModel(cls.from_pretrained(self.path, config=config, local_files_only=True, use_safetensors=True,
                                           dtype=torch.float32))


class HFModel(nn.Module):
    """An HF model as the trainer sees model_zoo's: ``named_layers()`` and ``tie_groups()`` of `from_hf`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        from mp_toolkit.hf import from_hf  # imports transformers (seconds): only --hf runs build one

        self.model = model
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
