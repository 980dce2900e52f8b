"""Write HF model directories (config.json + model.safetensors, via ``save_pretrained``) from a
LayerList or a state dict under LayerList names (one of our checkpoints: `mp_toolkit.hf.export_run`).

Names: `from_hf` reuses HF's modules, so a LayerList tensor *is* an HF tensor, and the name map is
read off identity rather than written as rules: ``hf_name_map(model)`` pairs each
``"{layer}.{key}"`` of ``from_hf(model)`` with the HF state-dict key(s) of the same tensor (a tied
weight has several). E.g. for GPT-2 ``h.0.block.attn.c_attn.weight -> transformer.h.0.attn.c_attn.weight``,
``embed.wte.weight -> transformer.wte.weight, lm_head.weight``; for Llama
``layers.0.block.self_attn.q_proj.weight -> model.layers.0.self_attn.q_proj.weight``. Shapes are
HF's too (GPT-2's Conv1D weights stay (in, out), also under tensor parallelism).

    export_hf(layers, model.config, "out/")              # then AutoModelForCausalLM.from_pretrained("out/")
    export_checkpoint("runs/ckpt", "out/", config=model.config)   # `mp_toolkit.hf.export_run`
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import PretrainedConfig

from mp_toolkit.checkpoint import open_checkpoint
from mp_toolkit.hf.adapters import from_hf
from mp_toolkit.hf.common import layer_state_dict
from mp_toolkit.hf.configs import architecture_for, load_config
from mp_toolkit.layers import LayerList

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json")


def hf_name_map(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """``{LayerList state key: (HF state key, ...)}`` for ``from_hf(model)``, matched by identity."""
    hf_keys: dict[int, list[str]] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        hf_keys.setdefault(id(t), []).append(key)
    ours = layer_state_dict(from_hf(model), keep_vars=True)
    missing = [k for k, t in ours.items() if id(t) not in hf_keys]
    if missing:  # cannot happen for a layer list from_hf built from this model
        raise ValueError(f"LayerList tensors {missing[:3]} are not tensors of {type(model).__name__}")
    return {k: tuple(hf_keys[id(t)]) for k, t in ours.items()}


def to_hf_state_dict(state: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state`` (LayerList names, full tensors; a tied weight under one or all of its names) under
    ``model``'s HF keys, every key of ``model.state_dict()`` filled, shapes checked."""
    names, target = hf_name_map(model), model.state_dict()
    unknown = [k for k in state if k not in names]
    if unknown:
        raise ValueError(f"state has {len(unknown)} tensor(s) {type(model).__name__} has no place for, e.g. "
                         f"{unknown[:3]}: was it saved from another architecture or config?")
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        for hf_key in names[key]:
            want = tuple(target[hf_key].shape)
            if tuple(t.shape) != want:
                raise ValueError(f"{key} has shape {tuple(t.shape)} but {type(model).__name__}'s {hf_key} is {want}: "
                                 "gather tensor-parallel shards into full tensors (gather_full) before exporting")
            if hf_key in out and not torch.equal(out[hf_key], t):
                raise ValueError(f"{key} differs from another copy of the tied {hf_key}: the tied copies diverged")
            out[hf_key] = t
    missing = [k for k in target if k not in out]
    if missing:
        ours = {hf: k for k, hfs in names.items() for hf in hfs}
        raise ValueError(f"state lacks {len(missing)} tensor(s), e.g. {ours[missing[0]]} (HF {missing[0]}): "
                         "export every layer of the model")
    return out


def copy_tokenizer(tokenizer_dir, out_dir) -> list[str]:
    """Copy the tokenizer files present in ``tokenizer_dir`` (`TOKENIZER_FILES`); their names."""
    src = Path(tokenizer_dir)
    found = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not found:
        raise ValueError(f"{src}: no tokenizer files there (looked for {', '.join(TOKENIZER_FILES[:5])}, ...)")
    for name in found:
        shutil.copy2(src / name, Path(out_dir) / name)
    return found


def export_hf(layer_list_or_state: LayerList | Mapping[str, torch.Tensor], config, out_dir,
              tokenizer_dir=None, architecture: str | None = None) -> Path:
    """Write an HF model directory that ``from_pretrained`` loads with these weights.

    ``layer_list_or_state``: an unsharded LayerList from `from_hf`, or its full tensors under
    LayerList names (a checkpoint's layers). ``config``: the HF config (object, dict or
    config.json path) the model was built from. The model class is ``architecture`` or the
    config's (see `architecture_for`); it is built on CPU in the state's dtype, filled, and saved
    with ``save_pretrained`` (config.json + model.safetensors). Tokenizer files in
    ``tokenizer_dir`` are copied next to them. Returns ``out_dir``.
    """
    if isinstance(layer_list_or_state, LayerList):
        state = {k: t.detach() for k, t in layer_state_dict(layer_list_or_state).items()}
    else:
        state = dict(layer_list_or_state)
    cfg = load_config(config)
    cls = architecture_for(cfg, architecture, state)
    cfg.architectures = [cls.__name__]
    return write_hf_model(cls, cfg, state, out_dir, tokenizer_dir,
                          to_hf=lambda model: to_hf_state_dict(state, model))


def write_hf_model(cls: type, cfg: PretrainedConfig, state: Mapping[str, torch.Tensor], out_dir,
                   tokenizer_dir=None, to_hf=None) -> Path:
    """Build ``cls(cfg)`` on CPU in ``state``'s dtype, load ``to_hf(model)`` (default: ``state``,
    already under HF keys) with strict=True, ``save_pretrained`` it into ``out_dir`` and copy the
    tokenizer files of ``tokenizer_dir``. Returns ``out_dir``."""
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    model = cls(cfg).to(dtype)
    model.load_state_dict(to_hf(model) if to_hf is not None else dict(state), strict=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out)
    return out


def read_checkpoint_state(checkpoint) -> tuple[dict[str, torch.Tensor], dict]:
    """(every layer's full tensors under LayerList names, the manifest's meta dict) of one of our
    checkpoints (a root, following ``latest``, or one step directory); every file is hash-checked."""
    ck = open_checkpoint(checkpoint)
    state: dict[str, torch.Tensor] = {}
    for name in ck.layer_names:
        state.update(ck.read_layer(name))
    return state, ck.manifest
