"""HF configs: read one (object, dict or config.json) and name the HF class an export writes."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path

import transformers
from transformers import AutoConfig, PretrainedConfig

from mp_toolkit.arch.architectures import BY_MODEL_TYPE
from mp_toolkit.arch.hf_config import check_values, shape_from_hf_config
from mp_toolkit.hf.adapters import ADAPTERS, unsupported
from mp_toolkit.user_files import parse_json, read_config_text

DEFAULT_ARCHITECTURE = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                        "qwen2": "Qwen2ForCausalLM", "bert": "BertForPreTraining"}

def load_config(config) -> PretrainedConfig:
    """A copy of an HF config given as a config object, a dict (with ``model_type``) or a path to a
    config.json (or to the directory holding it). A dict or file of an architecture we plan has its
    values checked before and after transformers fills its defaults (`mp_toolkit.arch.hf_config`:
    CostModelError, a ValueError, naming the key); transformers' own refusal of a value is a ValueError."""
    if isinstance(config, PretrainedConfig):
        return copy.deepcopy(config)
    source = "config"
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"{path}: no HF config.json there")
        source = str(path)
        try:
            config = parse_json(read_config_text(path, "HF config"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, Mapping) or "model_type" not in config:
        raise ValueError("config must be an HF PretrainedConfig, a config.json path or a dict with a model_type")
    d = dict(config)
    planned = isinstance(d["model_type"], str) and d["model_type"] in BY_MODEL_TYPE
    if planned:
        check_values(d, source)
    try:
        built = AutoConfig.for_model(d.pop("model_type"), **d)
    except Exception as e:  # noqa: BLE001 -- transformers refuses a field's value with its own types (v5:
        # huggingface_hub's StrictDataclassError; before, ValueError or TypeError): each is the config's fault
        raise ValueError(f"{source}: {' '.join(str(e).split())}") from None
    if planned:
        shape_from_hf_config(built.to_dict(), source)
    return built


def architecture_for(config: PretrainedConfig, architecture: str | None = None, state: Mapping | None = None) -> type:
    """The HF class to write: ``architecture``, else the config's first ``architectures`` entry,
    else the default of its model_type (GPT2LMHeadModel, LlamaForCausalLM, ...); for BERT the
    state decides: BertForPreTraining when it has the pooler (``heads.pooler.*``), else BertForMaskedLM."""
    listed = config.architectures if isinstance(config.architectures, list) else [config.architectures]
    name = architecture or (listed or [None])[0]
    if name is None and config.model_type == "bert" and state is not None:
        name = "BertForPreTraining" if any(k.startswith("heads.pooler.") for k in state) else "BertForMaskedLM"
    name = name or DEFAULT_ARCHITECTURE.get(config.model_type)
    if name not in ADAPTERS:
        raise unsupported(name or f"model_type {config.model_type!r}")
    return getattr(transformers, name)
