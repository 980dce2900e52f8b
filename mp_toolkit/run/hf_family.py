"""`mpt train --hf DIR`: a local HuggingFace ``save_pretrained`` directory as the model family "hf".

DIR holds config.json and model.safetensors, or the shards a model.safetensors.index.json names, of
one of `mp_toolkit.hf.adapters.SUPPORTED` (nothing is fetched). The model is built with its parameters
on meta (`mp_toolkit.hf.pretrained.build_model`); `from_hf` turns it into a LayerList of HF's own
modules (its layer names are the checkpoint's), tensor parallelism is `apply_hf_tensor_parallel` (GPT-2,
BERT and the Llama family), and each rank reads only its own layers' tensors, its tensor-parallel
shards as slices, from DIR (`mp_toolkit.hf.pretrained`; every file's header is checked before any rank
starts). The loss comes from `mp_toolkit.hf.losses`, vocab-parallel under ``--tp > 1``. This module imports
transformers: `mp_toolkit.run.families` imports it only for an ``--hf`` run.

Data: with DIR/tokenizer.json the corpus is encoded by that tokenizer (`tokenizers` only, cached
under --cache-dir); without one a byte-level BPE is trained on the corpus with the model's
vocab_size. Every id must be below vocab_size. BERT directories get MLM + NSP data; an HF BERT
tokenizer's [PAD] [CLS] [SEP] [MASK] are used when it has all four.

    mpt train --hf runs/llama-init --data corpus/ --seq-len 256 --pp 2 --tp 2 --save-dir runs/llama
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path

import torch

from mp_toolkit.data.feed import Wanted, tokenizer_file
from mp_toolkit.data.mlm import SPECIAL_TOKENS
from mp_toolkit.data.tokens import MIN_VOCAB, load_tokenizer_file
from mp_toolkit.errors import CostModelError, DataError
from mp_toolkit.hf.adapters import UnsupportedModelError, architecture_of_list
from mp_toolkit.hf.configs import architecture_for, load_config
from mp_toolkit.hf.losses import causal_lm_loss, masked_lm_loss, pretraining_loss
from mp_toolkit.hf.model import HFModel, HFSource
from mp_toolkit.hf.pretrained import build_model
from mp_toolkit.hf.tp_plans import apply_hf_tensor_parallel, check_hf_tensor_parallel
from mp_toolkit.layers import LayerList
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.run.config import ConfigError, TrainConfig
from mp_toolkit.run.feeding import feed_batches
from mp_toolkit.user_files import link_note, special_kind


def read_source(directory: str) -> HFSource:
    """``--hf DIR`` -> its HFSource; one-line ConfigError for a directory that cannot work."""
    path = Path(directory)
    what = "a HuggingFace save_pretrained directory (config.json + model.safetensors)"
    if not path.is_dir():
        kind = special_kind(path) or ("a file" if path.exists() else "no such directory")
        raise ConfigError(f"--hf {directory}{link_note(path)}: {kind}: give {what}")
    for name in ("config.json", "model.safetensors", "model.safetensors.index.json"):
        kind = special_kind(path / name)
        if kind is not None:
            raise ConfigError(f"--hf {directory}: {name}{link_note(path / name)} is {kind}, not a file: give {what}")
    if not (path / "config.json").is_file():
        raise ConfigError(f"--hf {directory} has no config.json: give {what}")
    if not any((path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        raise ConfigError(f"--hf {directory} has no model.safetensors: save the model there with "
                          "save_pretrained (safetensors weights; pickled .bin files are not loaded)")
    try:
        config = load_config(path)
        architecture = architecture_for(config).__name__
    except (UnsupportedModelError, CostModelError) as e:
        raise ConfigError(f"--hf {directory}: {e}") from None
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ConfigError(f"--hf {directory}: cannot read config.json: {str(e).splitlines()[0]}") from None
    doc = json.loads(config.to_json_string())
    doc.pop("transformers_version", None)  # resuming under another transformers is the same model
    return HFSource(str(path), architecture, doc)


def check_hf(source: HFSource, cfg: TrainConfig) -> None:
    """Checks of ``--hf`` against the run that need no process group (seq-len, tp, tokenizer)."""
    if cfg.batch.seq_len > source.positions:
        raise ConfigError(f"--seq-len {cfg.batch.seq_len} exceeds {source.path}'s {source.positions} positions "
                          f"(max_position_embeddings): use at most {source.positions}")
    try:
        check_hf_tensor_parallel(load_config(source.config), cfg.parallel.tp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_weights(source)
    if source.tokenizer_file is not None and cfg.dataset.data != "synthetic":
        _check_tokenizer(source)
    need = MIN_VOCAB + len(SPECIAL_TOKENS) * source.is_bert  # `data.tokens.train_tokenizer`'s floor
    if source.tokenizer_file is None and cfg.dataset.data != "synthetic" and source.vocab_size < need:
        raise ConfigError(f"--hf {source.path} has no tokenizer.json and its vocab_size {source.vocab_size} is too "
                          f"small to train one (byte-level BPE needs at least {need}): add DIR/tokenizer.json "
                          "or use --data synthetic")


def check_weights(source: HFSource) -> None:
    """ConfigError (one line naming the file and the tensor) unless DIR's safetensors hold every
    parameter with the config's shape, in whole files; reads the headers only."""
    try:
        with torch.device("meta"):
            model = build_model(source)
    except Exception as e:  # noqa: BLE001 -- transformers builds the model from the user's config.json: an
        # unknown activation or rope type is its KeyError, a bad size its ValueError; each is the config's fault
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        raise ConfigError(f"--hf {source.path}: transformers cannot build the model config.json describes "
                          f"({reason[:200]})") from None
    model.read(model.weights.check)


def _check_tokenizer(source: HFSource) -> None:
    """Before any rank starts: the tokenizer reads and has no id the embedding lacks (the data
    pipeline checks the ids it actually produces again)."""
    try:
        tokenizer, _ = load_tokenizer_file(source.tokenizer_file)
    except DataError as e:
        raise ConfigError(f"--hf {source.path}: {e}") from None
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    if n > source.vocab_size:
        raise ConfigError(f"--hf {source.path}: tokenizer.json has {n} tokens but the model's vocab_size is "
                          f"{source.vocab_size} (ids must be below it): use the tokenizer the model was built for")


def hf_tensor_parallel(layers: LayerList, ctx: ParallelContext) -> LayerList:
    """This rank's shard by `apply_hf_tensor_parallel` (GPT-2, BERT and the Llama family)."""
    return apply_hf_tensor_parallel(layers, ctx)


def hf_sp_plan(layers: LayerList) -> Mapping[str, str]:
    """The sequence-parallel plan of the layer list's architecture (GPT-2, BERT, the Llama family)."""
    return architecture_of_list(layers).hf_sp_plan


def hf_loss(model: HFModel, ctx: ParallelContext):
    """The last stage's loss in our label convention (`mp_toolkit.hf.losses`)."""
    if model.architecture == "BertForPreTraining":
        return functools.partial(pretraining_loss, tp_group=ctx.tp_group)
    if model.architecture == "BertForMaskedLM":
        return functools.partial(mlm_only_loss, tp_group=ctx.tp_group)
    return functools.partial(causal_lm_loss, tp_group=ctx.tp_group)  # vocab-parallel when tp > 1


def mlm_only_loss(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor], tp_group=None) -> torch.Tensor:
    """BertForMaskedLM on MLM + NSP batches: the masked-LM part of the labels only."""
    return masked_lm_loss(logits, labels[0], tp_group)


def _eos(config: dict) -> int | None:
    eos = config.get("eos_token_id")
    return eos[0] if isinstance(eos, list) and eos else eos  # Llama 3 lists several


def hf_micro_batches(source: HFSource, cfg: TrainConfig, ctx: ParallelContext, rank: int) -> tuple:
    """(this replica's micro-batches, the HFSource to build from): a BERT corpus's [PAD] becomes the
    model's pad_token_id. Unprepared --data is prepared with DIR/tokenizer.json (a BERT tokenizer only when
    it has [PAD] [CLS] [SEP] [MASK]), else with a byte-level BPE trained with the model's vocab_size."""
    tok = cfg.dataset.tokenizer if cfg.dataset.tokenizer is not None else source.tokenizer_file
    if tok is not None and source.is_bert and not _has_bert_specials(tok):
        if rank == 0:
            print(f"{tok} lacks some of {', '.join(SPECIAL_TOKENS)}: training a byte-level BPE with BERT's special "
                  "tokens instead", flush=True)
        tok = None
    if rank == 0 and cfg.dataset.data != "synthetic":
        print(f"tokenizer: {tok}" if tok is not None else
              f"tokenizer: {source.path} has no tokenizer.json, training a byte-level BPE on --data "
              f"{cfg.dataset.data} with the model's vocab_size {source.vocab_size}", flush=True)
    wanted = Wanted(source.vocab_size, cfg.batch.seq_len, cfg.seed, pairs=source.is_bert, hf_order=source.is_bert,
                    tokenizer=tok)
    data, fed = feed_batches(cfg, ctx, rank, wanted)
    if not source.is_bert:
        return data, source
    return data, dataclasses.replace(source, config={**source.config, "pad_token_id": fed.special.pad})


def _has_bert_specials(tokenizer: Path) -> bool:
    loaded, _ = load_tokenizer_file(tokenizer_file(tokenizer))
    return all(loaded.token_to_id(t) is not None for t in SPECIAL_TOKENS)
