"""`mpt export`: one checkpoint -> one HF model directory, written whole or not at all.

    mpt export --checkpoint runs/gpt --out hf/gpt                    # then AutoModelForCausalLM.from_pretrained("hf/gpt")
    mpt export --checkpoint runs/bert/step-00000040 --out hf/bert    # BertForPreTraining.from_pretrained("hf/bert")
    mpt export --checkpoint runs/hf-run --out hf/x --config gpt2/config.json --tokenizer gpt2/

The model is written by `export_state` (a `model_zoo` run from the model its manifest records, an
HF-loaded run from its ``hf_config`` or ``--config``), the tokenizer by `write_tokenizer`. Both go
into a scratch directory beside ``--out`` that is renamed into place once complete, so a failed
export leaves ``--out`` as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from mp_toolkit.checkpoint import open_checkpoint
from mp_toolkit.hf.export import export_hf, read_checkpoint_state
from mp_toolkit.hf.run_tokenizer import write_tokenizer
from mp_toolkit.hf.zoo_export import export_zoo_state, zoo_spec


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
    or (even with ``force``) a directory that holds the checkpoint being read."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: name a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ValueError(f"--out {out} is not empty: name a new or empty directory, or pass --force to replace it")
        ck, o = checkpoint.resolve(), out.resolve()
        if ck == o or o in ck.parents:
            raise ValueError(f"--out {out} holds the checkpoint {checkpoint}: --force would delete it; "
                             "name another directory")


def export_run(checkpoint, out_dir, config=None, tokenizer=None, force: bool = False) -> Exported:
    """Write the HF directory of ``checkpoint`` (a root, following ``latest``, or a step directory)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # a bar for writing one small file says nothing
    checkpoint, out = Path(checkpoint), Path(out_dir)
    check_out_dir(out, checkpoint, force)
    state, manifest = read_checkpoint_state(checkpoint)  # hash-checks every layer file
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.export-"))
    try:
        export_state(state, manifest, scratch, config, where=checkpoint)
        note = write_tokenizer(tokenizer, manifest, scratch)
        os.chmod(scratch, 0o755)  # mkdtemp makes it 0700; the export is shared like any model directory
        if out.exists():
            shutil.rmtree(out)  # empty, or --force (check_out_dir)
        scratch.rename(out)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch)
    architecture = json.loads((out / "config.json").read_text(encoding="utf-8"))["architectures"][0]
    step = open_checkpoint(checkpoint).step  # the manifest only: the tensors were read above
    return Exported(out, architecture, sum(t.numel() for t in state.values()), step, note)


def export_checkpoint(checkpoint, out_dir, config=None, tokenizer_dir=None, architecture: str | None = None) -> Path:
    """`export_hf` of a checkpoint written by `mp_toolkit.checkpoint` (layer-named full tensors).

    ``config`` defaults to the manifest's ``hf_config`` entry (a config dict), if the run stored one.
    A checkpoint of ``mpt train --model`` (its manifest records a `model_zoo` GPT or BERT and no
    hf_config) is written by `mp_toolkit.hf.zoo_export` from the model it records.
    """
    state, manifest = read_checkpoint_state(checkpoint)
    return export_state(state, manifest, out_dir, config, tokenizer_dir, architecture, where=checkpoint)


def export_state(state: Mapping[str, torch.Tensor], manifest: Mapping, out_dir, config=None, tokenizer_dir=None,
                 architecture: str | None = None, where="checkpoint") -> Path:
    """`export_checkpoint` of tensors and a manifest already read (``where`` names them in errors)."""
    if manifest.get("hf_config") is None and zoo_spec(manifest) is not None:
        if config is not None or architecture is not None:
            raise ValueError(f"{where}: the run trained {manifest['model']['family']} from mpt's model zoo and its "
                             "manifest records that model: export it without a config (--config is for HF-loaded runs)")
        return export_zoo_state(state, manifest, out_dir, tokenizer_dir)
    config = config if config is not None else manifest.get("hf_config")
    if config is None:
        raise ValueError(f"{where}: the manifest has no hf_config nor a model_zoo model; pass the HF config the "
                         "run started from (config=, or mpt export --config config.json)")
    return export_hf(state, config, out_dir, tokenizer_dir, architecture)
