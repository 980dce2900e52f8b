"""The tokenizer an exported model ships with: one the user names, or the one its run trained.

`mpt train` trains a byte-level BPE per (corpus, vocabulary) and caches it as
``<cache_dir>/tokenizer-<key>.json`` (`mp_toolkit.data.tokens.train_tokenizer`); the manifest records the
run's ``data`` and ``cache_dir``, which give the key again. A manifest is untrusted input, so it
never chooses a directory to read by itself: the run's cache is used only when it is the export's
own ``--cache-dir`` (default the training default, ``~/.cache/mp_toolkit``), and the files of an
``--hf DIR`` run only when ``--tokenizer`` names them. BERT runs add [PAD] [CLS] [SEP] [MASK]
after the BPE (`mp_toolkit.data.mlm.bert_tokenizer`). A GPT run on ``--data synthetic`` draws
random ids and has no tokenizer. An ``--hf DIR`` run ships DIR's tokenizer files. The HF files
are written by ``PreTrainedTokenizerFast.save_pretrained`` (tokenizer.json + tokenizer_config.json),
which ``AutoTokenizer.from_pretrained`` loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from mp_toolkit.arch.zoo import ZOO
from mp_toolkit.data.corpus import read_texts, stdlib_files
from mp_toolkit.data.mlm import SPECIAL_TOKENS, bert_tokenizer
from mp_toolkit.data.synthetic import synthetic_documents
from mp_toolkit.data.tokens import EOS_TOKEN, cache_key
from mp_toolkit.errors import DataError
from mp_toolkit.export.hf_dir import copy_tokenizer


def _mlm(family: str) -> bool:
    """Whether the run of ``family`` (a model_zoo family's record) trained on MLM + NSP pairs with BERT's
    special tokens; an ``--hf`` run ships its directory's tokenizer instead."""
    return family in ZOO and ZOO[family].mlm


def _run_texts(family: str, run: Mapping) -> list[str] | None:
    """The documents the run tokenized, or None when it used no tokenizer."""
    data = str(run.get("data"))
    if data == "synthetic":
        return synthetic_documents(run["seed"]) if _mlm(family) else None
    return read_texts(stdlib_files() if data == "stdlib" else [data])[0]


def run_tokenizer(manifest: Mapping, cache_dir) -> tuple[Tokenizer | None, str]:
    """(the tokenizer the checkpoint's run trained, or None; a note on where it came from or why none).
    Read only from ``cache_dir``, and only when the run cached it there."""
    run, model = manifest.get("config", {}), manifest["model"]
    family, vocab = model["family"], model["config"]["vocab_size"]
    if str(run.get("data")) == "synthetic" and not _mlm(family):
        return None, "no tokenizer: the run trained on synthetic token ids"
    if (cache_dir is None or not isinstance(run.get("cache_dir"), str)
            or Path(run["cache_dir"]).resolve() != Path(cache_dir).resolve()):
        return None, (f"no tokenizer: the run cached it in {run.get('cache_dir')!r}, not in --cache-dir {cache_dir}; "
                      "pass --cache-dir with the run's cache or --tokenizer")
    try:
        texts = _run_texts(family, run)
    except (DataError, OSError, KeyError) as e:
        return None, f"no tokenizer: the run's data {run.get('data')!r} cannot be read again ({e}); pass --tokenizer"
    if texts is None:
        return None, "no tokenizer: the run trained on synthetic token ids"
    bpe_vocab = vocab - len(SPECIAL_TOKENS) if _mlm(family) else vocab
    # the cache file's name: the key the run computed
    cached = Path(cache_dir) / f"tokenizer-{cache_key(texts, bpe_vocab)}.json"
    if not cached.is_file():
        return None, f"no tokenizer: the run's {cached} is gone; pass --tokenizer"
    if _mlm(family):  # reads the cache (it exists) and appends the specials as the run did
        return bert_tokenizer(texts, vocab, cached.parent)[1], f"tokenizer from {cached} + BERT specials"
    return Tokenizer.from_file(str(cached)), f"tokenizer from {cached}"


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
