"""HF configs: read one (object, dict or config.json) and name the HF class an export writes."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path

import transformers
from transformers import AutoConfig, PretrainedConfig

from mp_toolkit.hf.adapters import ADAPTERS, unsupported

DEFAULT_ARCHITECTURE = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                        "qwen2": "Qwen2ForCausalLM", "bert": "BertForPreTraining"}

def load_config(config) -> PretrainedConfig:
    """A copy of an HF config given as a config object, a dict (with ``model_type``) or a path to a
    config.json (or to the directory holding it)."""
    if isinstance(config, PretrainedConfig):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"{path}: no HF config.json there")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except RecursionError:
            raise ValueError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(config, Mapping) or "model_type" not in config:
        raise ValueError("config must be an HF PretrainedConfig, a config.json path or a dict with a model_type")
    d = dict(config)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def architecture_for(config: PretrainedConfig, architecture: str | None = None, state: Mapping | None = None) -> type:
    """The HF class to write: ``architecture``, else the config's first ``architectures`` entry,
    else the default of its model_type (GPT2LMHeadModel, LlamaForCausalLM, ...); for BERT the
    state decides: BertForPreTraining when it has the pooler (``heads.pooler.*``), else BertForMaskedLM."""
    name = architecture or (config.architectures or [None])[0]
    if name is None and config.model_type == "bert" and state is not None:
        name = "BertForPreTraining" if any(k.startswith("heads.pooler.") for k in state) else "BertForMaskedLM"
    name = name or DEFAULT_ARCHITECTURE.get(config.model_type)
    if name not in ADAPTERS:
        raise unsupported(name or f"model_type {config.model_type!r}")
    return getattr(transformers, name)
