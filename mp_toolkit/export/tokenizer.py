"""The tokenizer an exported model ships with: one the user names, or the one its run trained on.

A run's data is a prepared corpus with its tokenizer.json (`mp_toolkit.data.prepared`); the checkpoint
records that file's sha256 (``meta["data"]["tokenizer_sha256"]``). A manifest is untrusted input, so it
never chooses a directory to read by itself: the run's tokenizer is looked up by that digest among the
corpora prepared in the export's own ``--cache-dir`` (``<cache_dir>/prepared/*/tokenizer.json``, where
``mpt train --data FILE`` prepares; default the training default, ``~/.cache/mp_toolkit``); a corpus
the user prepared elsewhere ships its tokenizer when ``--tokenizer DIR/tokenizer.json`` names it. A
GPT run on ``--data synthetic`` draws random ids and has no tokenizer. An ``--hf DIR`` run ships DIR's
tokenizer files. The HF files are written by ``PreTrainedTokenizerFast.save_pretrained``
(tokenizer.json + tokenizer_config.json), which ``AutoTokenizer.from_pretrained`` loads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from mp_toolkit.arch.zoo import ZOO
from mp_toolkit.data.prepared import TOKENIZER
from mp_toolkit.data.tokens import EOS_TOKEN
from mp_toolkit.export.hf_dir import copy_tokenizer
from mp_toolkit.user_files import link_note, special_kind


def _mlm(family: str) -> bool:
    """Whether the run of ``family`` (a model_zoo family's record) trained on MLM + NSP pairs with BERT's
    special tokens; an ``--hf`` run ships its directory's tokenizer instead."""
    return family in ZOO and ZOO[family].mlm


def run_tokenizer(manifest: Mapping, cache_dir) -> tuple[Tokenizer | None, str]:
    """(the tokenizer the checkpoint's run trained on, or None; a note on where it came from or why none).
    Read only from ``cache_dir``'s prepared corpora, and only the file whose digest the checkpoint records."""
    run, data = manifest.get("config", {}), manifest.get("data", {})
    digest = data.get("tokenizer_sha256") if isinstance(data, Mapping) else None
    if digest is None:
        if str(run.get("data")) == "synthetic" and not _mlm(manifest["model"]["family"]):
            return None, "no tokenizer: the run trained on synthetic token ids"
        return None, "no tokenizer: the checkpoint records none; pass --tokenizer"
    if cache_dir is not None:
        for candidate in sorted(Path(cache_dir).glob(f"prepared/*/{TOKENIZER}")):
            raw = candidate.read_bytes()
            if hashlib.sha256(raw).hexdigest() == digest:
                return Tokenizer.from_str(raw.decode("utf-8")), f"tokenizer from {candidate}"
    return None, (f"no tokenizer: none with the run's digest {str(digest)[:12]}... among the corpora prepared in "
                  f"--cache-dir {cache_dir}; pass --tokenizer with the run's data's tokenizer.json "
                  f"(--data {run.get('data')})")


def save_tokenizer(tokenizer: Tokenizer, family: str, max_length: int, out_dir) -> None:
    """Write ``tokenizer`` as HF files, naming the special tokens the model was trained with."""
    vocab = tokenizer.get_vocab()
    if _mlm(family):
        names = dict(pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    else:
        names = dict(eos_token=EOS_TOKEN, bos_token=EOS_TOKEN)
    specials = {k: v for k, v in names.items() if v in vocab}
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=max_length, **specials)
    fast.save_pretrained(out_dir)


def write_tokenizer(source, manifest: Mapping, out_dir, cache_dir) -> str:
    """Put the tokenizer into ``out_dir``: ``source`` (a directory of HF tokenizer files, or a
    `tokenizers` JSON such as the run's cache file), else the run's own from ``cache_dir``; returns a
    one-line note."""
    model = manifest.get("model") or {}
    family = model.get("family", "gpt")
    config = model.get("config", {})
    max_length = config.get("n_positions", config.get("max_position_embeddings", 1024))
    if source is not None and Path(source).is_dir():
        return f"tokenizer files {', '.join(copy_tokenizer(source, out_dir))} from {source}"
    if source is not None:
        kind = special_kind(source)
        if kind is not None:  # a FIFO would be waited on
            raise ValueError(f"--tokenizer {source}{link_note(source)} is {kind}: give a tokenizer directory or a "
                             "tokenizers JSON file")
        try:
            tokenizer = Tokenizer.from_file(str(source))
        except Exception as e:  # tokenizers raises its own Exception type for a file it cannot parse
            raise ValueError(f"--tokenizer {source}: not a tokenizer directory nor a tokenizers JSON "
                             f"({str(e).splitlines()[0][:120]})") from None
        note = f"tokenizer from {source}"
    elif family in ZOO and "config" in model:  # model_zoo
        tokenizer, note = run_tokenizer(manifest, cache_dir)
        if tokenizer is None:
            return note
    else:  # an `mpt train --hf DIR` run: DIR's tokenizer files, when --tokenizer names DIR
        hf_dir = manifest.get("config", {}).get("hf")
        return (f"no tokenizer: pass --tokenizer {hf_dir} to ship the run's --hf tokenizer files (the checkpoint "
                "does not choose the directories export reads)")
    save_tokenizer(tokenizer, family, max_length, out_dir)
    return note
