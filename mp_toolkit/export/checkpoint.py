"""`mpt export`: one checkpoint -> one HF model directory, written whole or not at all.

    mpt export --checkpoint runs/gpt --out hf/gpt                  # then AutoModelForCausalLM.from_pretrained("hf/gpt")
    mpt export --checkpoint runs/bert/step-00000040 --out hf/bert  # BertForPreTraining.from_pretrained("hf/bert")
    mpt export --checkpoint runs/hf-run --out hf/x --config gpt2/config.json --tokenizer gpt2/

The model is streamed by `export_layers` (a `model_zoo` run as the model its manifest records, an
HF-loaded run by its ``hf_config`` or ``--config``): one checkpoint layer at a time is read, renamed
to HF's keys and appended to the safetensors output, so a rank-sized machine exports a model it
could not hold; above ``--max-shard-size`` (default 5GB) the weights are split into
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, as ``save_pretrained``
writes them. The tokenizer is written by `write_tokenizer`. Both go into a scratch directory beside
``--out`` that is renamed into place once complete, so a failed export leaves ``--out`` as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mp_toolkit.checkpoint import Checkpoint, open_checkpoint
from mp_toolkit.export.hf_dir import DEFAULT_MAX_SHARD, HFTarget, layer_tensors_as_hf, write_hf_dir
from mp_toolkit.export.safetensors_out import parse_size
from mp_toolkit.export.tokenizer import write_tokenizer
from mp_toolkit.export.zoo import zoo_model, zoo_target, zoo_tensors_as_hf
from mp_toolkit.hf.configs import architecture_for, load_config
from mp_toolkit.user_files import link_note, writing


@dataclass(frozen=True)
class Exported:
    """What `export_run` wrote."""

    out: Path
    architecture: str
    parameters: int
    """Elements of the checkpoint's model tensors (a tied weight counted once)."""
    step: int
    tokenizer: str
    """One line: where the tokenizer came from, or why there is none."""


def check_out_dir(out: Path, checkpoint: Path, force: bool) -> None:
    """Refuse an ``--out`` that would lose data: a file, a non-empty directory without ``force``,
    a symbolic link (the export replaces the directory itself, never what a link points at), or (even
    with ``force``) a directory that holds the checkpoint being read."""
    if out.is_symlink():
        raise ValueError(f"--out {out}{link_note(out)} is a symbolic link: the export replaces its directory, so "
                         "name the directory itself")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: name a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ValueError(f"--out {out} is not empty: name a new or empty directory, or pass --force to replace it")
        ck, o = checkpoint.resolve(), out.resolve()
        if ck == o or o in ck.parents:
            raise ValueError(f"--out {out} holds the checkpoint {checkpoint}: --force would delete it; "
                             "name another directory")


def export_run(checkpoint, out_dir, config=None, tokenizer=None, force: bool = False,
               max_shard_size: str | int = DEFAULT_MAX_SHARD, cache_dir=None) -> Exported:
    """Write the HF directory of ``checkpoint`` (a root, following ``latest``, or a step directory);
    the run's trained tokenizer is looked up in ``cache_dir`` only (None: not at all)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # a bar for writing one small file says nothing
    checkpoint, out = Path(checkpoint), Path(out_dir)
    check_out_dir(out, checkpoint, force)
    try:
        max_shard_bytes = parse_size(max_shard_size)
    except ValueError as e:
        raise ValueError(f"--max-shard-size: {e}") from None
    ck = open_checkpoint(checkpoint)
    with writing("--out", out):
        out.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.export-"))
    try:
        with writing("--out", out):  # a full device, a folder that went away: one line
            parameters = export_layers(ck, scratch, config, where=checkpoint, max_shard_bytes=max_shard_bytes)
            note = write_tokenizer(tokenizer, ck.manifest, scratch, cache_dir)
            os.chmod(scratch, 0o755)  # mkdtemp makes it 0700; the export is shared like any model directory
            if out.exists():
                shutil.rmtree(out)  # empty, or --force (check_out_dir)
            scratch.rename(out)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch)
    architecture = json.loads((out / "config.json").read_text(encoding="utf-8"))["architectures"][0]
    return Exported(out, architecture, parameters, ck.step, note)


def export_checkpoint(checkpoint, out_dir, config=None, tokenizer_dir=None, architecture: str | None = None,
                      max_shard_size: str | int = DEFAULT_MAX_SHARD) -> Path:
    """`export_layers` of a checkpoint written by `mp_toolkit.checkpoint` into ``out_dir``; returns it."""
    export_layers(open_checkpoint(checkpoint), out_dir, config, tokenizer_dir, architecture, where=checkpoint,
                  max_shard_bytes=parse_size(max_shard_size))
    return Path(out_dir)


def export_layers(ck: Checkpoint, out_dir, config=None, tokenizer_dir=None, architecture: str | None = None,
                  where="checkpoint", max_shard_bytes: int = parse_size(DEFAULT_MAX_SHARD)) -> int:
    """Stream the layers of ``ck`` into an HF directory (`write_hf_dir`): one layer is read (and its
    files hash-checked), renamed and written before the next, so memory holds one layer, never the
    model. Returns the parameters written.

    ``config`` defaults to the manifest's ``hf_config`` entry (a config dict), if the run stored one.
    A checkpoint of ``mpt train --model`` (its manifest records a `model_zoo` GPT or BERT and no
    hf_config) is written as its family's record maps the model it records (`mp_toolkit.export.zoo`).
    """
    manifest = ck.manifest
    named = _layer_tensors(ck)
    first = next(named, None)
    if first is None:
        raise ValueError(f"{where}: the checkpoint holds no layers")
    dtype = first[1].dtype if first[1].is_floating_point() else torch.float32
    named = _prepend(first, named)
    del first  # held by the stream until written, not for the whole export
    recorded = zoo_model(manifest) if manifest.get("hf_config") is None else None
    if recorded is not None:
        zoo, zoo_config = recorded
        if config is not None or architecture is not None:
            raise ValueError(f"{where}: the run trained {manifest['model']['family']} from mpt's model zoo and its "
                             "manifest records that model: export it without a config (--config is for HF-loaded runs)")
        target = zoo_target(zoo, zoo_config, dtype)
        pairs = zoo_tensors_as_hf(named, zoo)
    else:
        config = config if config is not None else manifest.get("hf_config")
        if config is None:
            raise ValueError(f"{where}: the manifest has no hf_config nor a model_zoo model; pass the HF config the "
                             "run started from (config=, or mpt export --config config.json)")
        cfg = load_config(config)
        keys = (key for key, _ in _layer_tensors(ck))  # read only when the config leaves BERT's head open
        target = HFTarget.of(architecture_for(cfg, architecture, keys), cfg, dtype)
        pairs = layer_tensors_as_hf(named, target)
    return write_hf_dir(target, pairs, out_dir, max_shard_bytes, tokenizer_dir)


def _prepend(first, rest: Iterator) -> Iterator:
    yield first
    del first
    yield from rest


def _layer_tensors(ck: Checkpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """Every model tensor of ``ck`` as ``(name, full tensor)``, one layer's file read at a time."""
    for layer in ck.layer_names:
        yield from ck.read_layer(layer).items()
