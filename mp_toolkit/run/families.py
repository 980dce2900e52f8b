"""The model families `mpt train` trains: GPT (causal LM), BERT (MLM + NSP pre-training) and "hf", a
HuggingFace save_pretrained directory (`mp_toolkit.run.hf_family`, ``--hf DIR``).

Each family gives the trainer the same things: a config checked without any process group, a
plain single-device model (`model_zoo`), its tensor-parallel plan (data next to the model), the
last stage's loss and the micro-batches of one data-parallel replica.

BERT under ``--tp > 1``: the MLM decoder is vocab-sharded (``TP_PLAN["predictions.decoder"]``), so
the MLM part of the loss is `vocab_parallel_cross_entropy` over the local (B, T, V / tp) logits
(never gathered) and the NSP part a plain cross-entropy of the replicated (B, 2) logits.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model_zoo import bert, gpt
from mp_toolkit.run.config import ConfigError, TrainConfig
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.parallel.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy


@dataclass(frozen=True)
class ModelSpec:
    """A model family and its config (``gpt.GPTConfig``, ``bert.BertConfig`` or ``train_hf.HFSource``)."""

    family: str
    config: object

    @property
    def positions(self) -> int:
        if self.family == "hf":
            return self.config.positions
        return self.config.n_positions if self.family == "gpt" else self.config.max_position_embeddings

    @property
    def label(self) -> str:
        """What the log calls it: the family, and for "hf" the HF architecture."""
        return f"hf {self.config.architecture}" if self.family == "hf" else self.family

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def tp_sizes(self) -> dict[str, int]:
        """The sizes a tensor-parallel degree must divide (`check_tensor_parallel`'s keywords)."""
        c = self.config
        if self.family == "hf":
            return {}  # `train_hf.check_hf` checks the HF plan's sizes (grouped-query heads too)
        if self.family == "gpt":
            return dict(n_head=c.n_head, hidden=c.n_embd, inner=c.inner_size, vocab=c.vocab_size)
        return dict(n_head=c.num_attention_heads, hidden=c.hidden_size, inner=c.intermediate_size, vocab=c.vocab_size)

    def build(self) -> nn.Module:
        """The plain model, initialised from torch's current RNG state (hf: the directory's weights)."""
        if self.family == "hf":
            return self.config.build()
        return gpt.GPT(self.config) if self.family == "gpt" else bert.BertForPreTraining(self.config)

    def to_json(self) -> dict:
        return {"family": self.family, "config": self.config.to_dict()}


def resolve_model(name: str) -> ModelSpec:
    """``--model``: a GPT or BERT preset, or a config.json whose ``model_type`` says which (GPT-2 when absent)."""
    if name in gpt.PRESETS:
        return ModelSpec("gpt", gpt.PRESETS[name])
    if name in bert.PRESETS:
        return ModelSpec("bert", bert.PRESETS[name])
    path = Path(name)
    if not (path.is_file() or (path.is_dir() and (path / "config.json").is_file())):
        raise ConfigError(f"unknown model {name!r}: choose one of {', '.join([*gpt.PRESETS, *bert.PRESETS])} "
                          "or a path to a GPT-2 or BERT config.json")
    try:
        from model_zoo.config_io import read_config_json
        doc = read_config_json(path, "model")
        kind = doc.get("model_type", "gpt2") if isinstance(doc, dict) else "gpt2"
        if kind == "bert":
            return ModelSpec("bert", bert.BertConfig.from_dict(doc))
        if kind != "gpt2":
            raise ValueError(f"{path}: model_type {kind!r} is not trained by mpt train --model: use gpt2 or bert, "
                             "or --hf DIR for a save_pretrained directory (Llama, Mistral, Qwen2 too)")
        return ModelSpec("gpt", gpt.GPTConfig.from_dict(doc))
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None


TP_PLANS = {"gpt": gpt.TP_PLAN, "bert": bert.TP_PLAN}


def family_of(model: nn.Module) -> str:
    from mp_toolkit.run.hf_family import HFModel

    if isinstance(model, HFModel):
        return "hf"
    if isinstance(model, gpt.GPT):
        return "gpt"
    if isinstance(model, bert.BertForPreTraining):
        return "bert"
    raise TypeError(f"mpt train builds GPT or BertForPreTraining models, not {type(model).__name__}")


def bert_vocab_parallel_loss(outputs, labels, group) -> torch.Tensor:
    """`pretraining_loss` with the MLM logits vocab-sharded over ``group``: (B, T, V / tp) local."""
    (mlm_logits, nsp_logits), (mlm_labels, nsp_labels) = outputs, labels
    return (vocab_parallel_cross_entropy(mlm_logits, mlm_labels, group)
            + F.cross_entropy(nsp_logits.float(), nsp_labels.reshape(-1)))


def tensor_parallel(model: nn.Module, layers, ctx: ParallelContext):
    """This rank's tensor-parallel shard of ``layers`` (the LayerList of ``model``) by its family's plan."""
    family = family_of(model)
    if family == "hf":
        from mp_toolkit.hf import TP_PLANS as HF_PLANS, apply_hf_tensor_parallel, family_of as hf_family

        # BERT has no HF plan; `train_hf.check_hf` allows it --tp 1 only
        return apply_hf_tensor_parallel(layers, ctx) if hf_family(layers) in HF_PLANS else layers
    return apply_tensor_parallel(layers, ctx, TP_PLANS[family])


def loss_function(model: nn.Module, ctx: ParallelContext):
    """The last stage's loss: on full logits, or with tp > 1 its vocab-parallel form."""
    family = family_of(model)
    if family == "hf":
        from mp_toolkit.run.hf_family import loss_function as hf_loss

        return hf_loss(model, ctx)
    if family == "gpt":
        return gpt.lm_loss if ctx.tp_group is None else functools.partial(vocab_parallel_cross_entropy, group=ctx.tp_group)
    return bert.pretraining_loss if ctx.tp_group is None else functools.partial(bert_vocab_parallel_loss, group=ctx.tp_group)


def synthetic_documents(seed: int, docs: int = 96, lines: int = 16, words: int = 12) -> list[str]:
    """Documents of lines of pseudo-words from a 400-word Zipf-like vocabulary (BERT's ``--data synthetic``):
    text with token statistics to learn, made in milliseconds without any file."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    vocab = ["".join(rng.choice(letters[: 6 + i % 20]) for _ in range(2 + i % 7)) for i in range(400)]
    weights = [1.0 / (1 + i) for i in range(len(vocab))]
    return ["\n".join(" ".join(rng.choices(vocab, weights, k=words)) for _ in range(lines)) for _ in range(docs)]


def rank0_first(build, rank: int):
    """Rank 0 builds first (training and caching the tokenizer); the others then load the cache."""
    out = build() if rank == 0 else None
    if dist.is_initialized():
        dist.barrier()
    return out if out is not None else build()


def micro_batches(spec: ModelSpec, cfg: TrainConfig, ctx: ParallelContext, rank: int):
    """(this replica's micro-batches, the spec to build the model from). Every rank of a
    data-parallel replica (its tp and pp ranks) reads the same shard. BERT's padding id is the
    corpus's [PAD], so the spec returned carries it."""
    import datasets  # slow to import: validation needs none of this

    from mp_toolkit.data.lm import DataError, MicroBatches, build_lm_dataset
    from mp_toolkit.data.mlm import MLMMicroBatches, build_mlm_corpus

    if not cfg.progress:
        datasets.disable_progress_bars()  # the corpus's map() would draw one per rank
    if spec.family == "hf":
        from mp_toolkit.run.hf_family import micro_batches as hf_micro_batches

        return hf_micro_batches(spec, cfg, ctx, rank)
    try:
        if spec.family == "gpt":
            ds = rank0_first(lambda: build_lm_dataset(cfg.data, spec.vocab_size, cfg.seq_len, cfg.seed, cfg.cache_dir),
                             rank)
            return MicroBatches(ds, cfg.micro_batch, dp_rank=ctx.dp_rank, dp_size=ctx.dp, seed=cfg.seed), spec
        source = synthetic_documents(cfg.seed) if cfg.data == "synthetic" else cfg.data
        corpus = rank0_first(lambda: build_mlm_corpus(source, spec.vocab_size, cfg.seq_len, cfg.seed, cfg.cache_dir),
                             rank)
        data = MLMMicroBatches(corpus, cfg.micro_batch, dp_rank=ctx.dp_rank, dp_size=ctx.dp, seed=cfg.seed)
    except DataError as e:
        raise ConfigError(str(e)) from None
    config = dataclasses.replace(spec.config, pad_token_id=corpus.special.pad)
    return data, ModelSpec("bert", config)

