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
from dataclasses import dataclass
from pathlib import Path

from mp_toolkit.checkpoint import open_checkpoint
from mp_toolkit.hf.export import export_state, read_checkpoint_state
from mp_toolkit.hf.run_tokenizer import write_tokenizer


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
