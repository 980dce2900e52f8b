"""Write HF model directories (config.json + model.safetensors, via ``save_pretrained``) from a
LayerList or a state dict under LayerList names (one of our checkpoints: `mp_toolkit.export.checkpoint`).

Names: `from_hf` reuses HF's modules, so a LayerList tensor *is* an HF tensor, and the name map is
read off identity rather than written as rules: ``hf_name_map(model)`` (`mp_toolkit.hf.adapters`)
pairs each ``"{layer}.{key}"`` of ``from_hf(model)`` with the HF state-dict key(s) of the same tensor (a tied
weight has several). E.g. for GPT-2 ``h.0.block.attn.c_attn.weight -> transformer.h.0.attn.c_attn.weight``,
``embed.wte.weight -> transformer.wte.weight, lm_head.weight``; for Llama
``layers.0.block.self_attn.q_proj.weight -> model.layers.0.self_attn.q_proj.weight``. Shapes are
HF's too (GPT-2's Conv1D weights stay (in, out), also under tensor parallelism).

    export_hf(layers, model.config, "out/")              # then AutoModelForCausalLM.from_pretrained("out/")
    export_checkpoint("runs/ckpt", "out/", config=model.config)   # `mp_toolkit.export.checkpoint`
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from mp_toolkit.export.safetensors_out import ShardedSafetensors, parse_size
from mp_toolkit.hf.adapters import hf_name_map
from mp_toolkit.hf.common import layer_state_dict
from mp_toolkit.hf.configs import architecture_for, load_config
from mp_toolkit.layers import LayerList

DEFAULT_MAX_SHARD = "5GB"
"""Above this size the weights are written in shards with an index (``mpt export --max-shard-size``);
the size the Hub's large models are published in (``save_pretrained``'s own default is 50GB)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json")


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
              tokenizer_dir=None, architecture: str | None = None,
              max_shard_size: str | int = DEFAULT_MAX_SHARD) -> Path:
    """Write an HF model directory that ``from_pretrained`` loads with these weights.

    ``layer_list_or_state``: an unsharded LayerList from `from_hf`, or its full tensors under
    LayerList names (a checkpoint's layers). ``config``: the HF config (object, dict or
    config.json path) the model was built from. The model class is ``architecture`` or the
    config's (see `architecture_for`); the directory is written by `write_hf_dir` (config.json,
    model.safetensors or shards above ``max_shard_size`` with their index). Tokenizer files in
    ``tokenizer_dir`` are copied next to them. Returns ``out_dir``.
    """
    if isinstance(layer_list_or_state, LayerList):
        state = {k: t.detach() for k, t in layer_state_dict(layer_list_or_state).items()}
    else:
        state = dict(layer_list_or_state)
    cfg = load_config(config)
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    target = HFTarget.of(architecture_for(cfg, architecture, state), cfg, dtype)
    write_hf_dir(target, layer_tensors_as_hf(state.items(), target), out_dir, parse_size(max_shard_size), tokenizer_dir)
    return Path(out_dir)


def layer_tensors_as_hf(named: Iterable[tuple[str, torch.Tensor]],
                        target: "HFTarget") -> Iterator[tuple[str, torch.Tensor]]:
    """``(LayerList name, tensor)`` pairs of a `from_hf` model as ``(HF key, tensor)`` pairs of
    ``target`` (a tied tensor under each of its HF keys; `write_hf_dir` keeps one)."""
    names = hf_name_map(target.model)
    for key, t in named:
        if key not in names:
            raise ValueError(f"the state has a tensor {target.cls.__name__} has no place for: {key} "
                             "(was it saved from another architecture or config?)")
        for hf_key in names[key]:
            yield hf_key, t
        del t  # not held while the next one is read


@dataclass(frozen=True)
class HFTarget:
    """The tensors an HF class's directory holds, from the class built on the meta device (no memory):
    every state-dict key, and the one ``save_pretrained`` writes for each group of tied keys."""

    cls: type
    config: PretrainedConfig
    model: torch.nn.Module
    """``cls(config)`` on meta, in the dtype written."""
    kept: dict
    """``{HF key written: shape}``."""
    alias: dict
    """``{every HF state key: the key written for it}`` (a tied key -> the one kept)."""
    tied: frozenset
    """Written keys that stand for several state keys (their copies are compared)."""

    @classmethod
    def of(cls, hf_class: type, config: PretrainedConfig, dtype: torch.dtype) -> "HFTarget":
        with torch.device("meta"):
            model = hf_class(config).to(dtype)
        state = model.state_dict()
        kept = remove_tied_weights_from_state_dict(dict(state), model)  # what save_pretrained keeps
        groups: dict[int, list[str]] = {}
        for key, t in model.state_dict(keep_vars=True).items():
            groups.setdefault(id(t), []).append(key)
        alias, tied = {}, set()
        for keys in groups.values():
            (main,) = [k for k in keys if k in kept]
            alias.update({k: main for k in keys})
            if len(keys) > 1:
                tied.add(main)
        return cls(hf_class, config, model, {k: tuple(t.shape) for k, t in kept.items()}, alias, frozenset(tied))


def write_hf_dir(target: HFTarget, tensors: Iterable[tuple[str, torch.Tensor]], out_dir, max_shard_bytes: int,
                 tokenizer_dir=None) -> int:
    """Write ``target``'s directory from ``(HF key, tensor)`` pairs consumed one at a time: config.json
    (and generation_config.json for a generating class) as ``save_pretrained`` writes them, then the
    tensors by `ShardedSafetensors` (``model.safetensors``, or shards of at most ``max_shard_bytes``
    and their index). A tied tensor is written once, under the key ``save_pretrained`` keeps; its
    other copies must be equal. Every key must come, with the class's shape. Returns the elements
    of the parameters written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = target.cls.__name__
    cfg, model = target.config, target.model
    cfg.architectures = [name]
    cfg.dtype = str(next(model.parameters()).dtype).split(".")[1]
    cfg.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)
    params = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    writer = ShardedSafetensors(out, max_shard_bytes)
    tied: dict[str, bytes] = {}  # digests of tensors that have several keys
    count = 0
    def put(hf_key: str, t: torch.Tensor) -> None:
        nonlocal count
        key = target.alias.get(hf_key)
        if key is None:
            raise ValueError(f"{name} has no tensor {hf_key}: was the state saved from another architecture or config?")
        want = target.kept[key]
        if tuple(t.shape) != want:
            raise ValueError(f"{hf_key} has shape {tuple(t.shape)} but {name}'s is {want}: gather tensor-parallel "
                             "shards into full tensors (gather_full) before exporting, or check the config")
        t = t.detach().to(model.dtype)
        if key in writer.weight_map:
            if tied.get(key) != _digest(t):
                raise ValueError(f"{hf_key} differs from another copy of the tied {key}: the tied copies diverged")
            return
        if key in target.tied:
            tied[key] = _digest(t)
        writer.add(key, t)
        count += t.numel() if key in params else 0

    try:
        for item in tensors:
            put(*item)
            del item  # nothing of a layer outlives its write
        missing = [k for k in target.kept if k not in writer.weight_map]
        if missing:
            raise ValueError(f"the state lacks {len(missing)} of {name}'s tensors, e.g. {missing[0]}: "
                             "export every layer of the model")
        writer.close(total_parameters=count)
    except BaseException:
        writer.abort()
        raise
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out)
    return count


def _digest(t: torch.Tensor) -> bytes:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).digest()
