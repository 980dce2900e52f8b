"""One `ZooFamily` record per `model_zoo` family: what the planner, the exporter and the trainer ask
of our own GPT and BERT, below the run (`mp_toolkit.run.families` adds the data and the run's loss).

    family  architecture  model                  HF class written by ``mpt export``
    gpt     gpt2          GPT (causal LM)        GPT2LMHeadModel: the GPTConfig fields (same spelling), eos = bos = 0
    bert    bert          BertForPreTraining     BertForPreTraining: the BertConfig fields (same spelling)

The export half (`ZooExport`) says which of our config's fields HF computes alike: a field added to
our config later is refused by the exporter until it is listed here, and what HF cannot express (a
GPT without biases) is refused in one line rather than written as a model that computes something else.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from model_zoo import bert, bert_hf, gpt, gpt_hf
from mp_toolkit.arch.architectures import BERT as BERT_ARCH
from mp_toolkit.arch.architectures import GPT2, Architecture
from mp_toolkit.arch.shape import ModelShape


@dataclass(frozen=True)
class ZooExport:
    """How a model_zoo family is written as an HF model (`mp_toolkit.export.zoo`)."""

    hf_class: str
    """The HF class written (``architectures[0]``)."""
    known_fields: frozenset
    """Our config's fields the exporter knows HF computes alike."""
    hf_config: Callable[[object], dict]
    """Our config -> the HF config dict (with its ``model_type``) that makes HF compute what our model
    computes; ValueError (one line) where HF cannot."""
    hf_key: Callable[[str], tuple[str, bool]]
    """(the HF class's key, whether the weight is transposed) of one of our model's state keys."""


@dataclass(frozen=True)
class ZooFamily:
    """A model_zoo family: its model, its shape for the cost model, its measurement batch, its TP plan,
    its loss and its export half; its recomputation is its architecture's (`Architecture.selective`)."""

    name: str
    """The family's one spelling ("gpt", "bert"), as checkpoints record it (``manifest["model"]["family"]``)."""
    arch: Architecture
    model_class: type
    """Built from a config (on meta too: each parameter is drawn by name, `model_zoo.init`)."""
    config_class: type
    presets: Mapping[str, object]
    get_config: Callable[[str], object]
    """A preset name or a config.json path -> the config."""
    config_from_dict: Callable[[dict], object]
    """A checkpoint's recorded ``config`` -> the config."""
    shape: Callable[[object], ModelShape]
    """The config -> its shape for the cost model."""
    positions: Callable[[object], int]
    """The config -> the longest sequence the model takes."""
    tp_plan: Mapping[str, str]
    """Its tensor-parallel plan, data next to the model (`apply_tensor_parallel`)."""
    sp_plan: Mapping[str, str]
    """Its sequence-parallel plan, applied after the TP plan (`apply_sequence_parallel`)."""
    loss: Callable
    """The last stage's loss on full logits (outputs, labels) -> scalar."""
    measure_batch: Callable[[object], tuple[Callable, Callable]]
    """The config -> (``make_batch(b, s) -> (inputs, labels)`` of random tokens, the loss the last
    layer is timed with): what ``--partition time`` and ``mpt plan --method time`` measure on."""
    export: ZooExport
    mlm: bool = False
    """Trained on MLM + NSP sentence pairs with BERT's [PAD] [CLS] [SEP] [MASK] after the BPE."""


def _gpt_shape(c: gpt.GPTConfig) -> ModelShape:
    return ModelShape("gpt2", c.vocab_size, c.n_embd, c.n_layer, c.n_head, c.inner_size, c.n_positions,
                      tied=c.tie_word_embeddings, attn_dropout=c.attn_pdrop, hidden_dropout=c.resid_pdrop,
                      embd_dropout=c.embd_pdrop)


def _gpt_batch(config: gpt.GPTConfig) -> tuple[Callable, Callable]:
    def batch(b: int, s: int):
        ids = torch.randint(0, config.vocab_size, (b, s + 1))
        return ids[:, :-1], ids[:, 1:]

    return batch, lambda logits, labels: gpt.lm_loss(logits.float(), labels)


def _bert_batch(config: bert.BertConfig) -> tuple[Callable, Callable]:
    def batch(b: int, s: int):
        ids = torch.randint(0, config.vocab_size, (b, s))
        inputs = (ids, torch.zeros_like(ids), torch.ones_like(ids))
        mlm = torch.where(torch.rand(b, s) < 0.15, ids, torch.full_like(ids, -100))
        return inputs, (mlm, torch.randint(0, 2, (b,)))

    return batch, bert.pretraining_loss


# GPTConfig fields GPT2Config spells and computes the same way; `bias` is checked on its own.
_GPT2_FIELDS = frozenset({"vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
                          "activation_function", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                          "layer_norm_epsilon", "initializer_range", "tie_word_embeddings"})
_BERT_FIELDS = frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "intermediate_size", "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob",
                          "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "initializer_range",
                          "pad_token_id", "tie_word_embeddings"})


def gpt2_config(config: gpt.GPTConfig) -> dict:
    """The GPT2Config of our GPT's config; a GPT without biases has none."""
    if not config.bias:
        raise ValueError("this GPT has bias=False: HF GPT2LMHeadModel always has Linear and LayerNorm biases, "
                         "so it cannot hold this model (train with bias=true to export to GPT-2)")
    d = config.to_dict()
    # our tokenizers put <|endoftext|> at id 0 (mp_toolkit.data.tokens.train_tokenizer); GPT-2's 50256 may not exist
    return {"model_type": "gpt2", **{k: d[k] for k in _GPT2_FIELDS}, "bos_token_id": 0, "eos_token_id": 0,
            "architectures": ["GPT2LMHeadModel"]}


def bert_hf_config(config: bert.BertConfig) -> dict:
    """The BertConfig of our BERT's config: the same fields, the same spelling."""
    d = config.to_dict()
    return {"model_type": "bert", **{k: d[k] for k in _BERT_FIELDS}, "architectures": ["BertForPreTraining"]}


GPT = ZooFamily(
    name="gpt", arch=GPT2, model_class=gpt.GPT, config_class=gpt.GPTConfig, presets=gpt.PRESETS,
    get_config=gpt.get_config, config_from_dict=gpt.GPTConfig.from_dict, shape=_gpt_shape,
    positions=lambda c: c.n_positions, tp_plan=gpt.TP_PLAN, sp_plan=gpt.SP_PLAN, loss=gpt.lm_loss,
    measure_batch=_gpt_batch,
    export=ZooExport("GPT2LMHeadModel", _GPT2_FIELDS | {"bias"}, gpt2_config, gpt_hf.hf_name),
)
BERT = ZooFamily(
    name="bert", arch=BERT_ARCH, model_class=bert.BertForPreTraining, config_class=bert.BertConfig,
    presets=bert.PRESETS, get_config=bert.get_config, config_from_dict=bert.BertConfig.from_dict,
    shape=lambda c: BERT_ARCH.read(c.to_dict(), "bert", False),  # BertConfig is spelled as HF's
    positions=lambda c: c.max_position_embeddings, tp_plan=bert.TP_PLAN, sp_plan=bert.SP_PLAN,
    loss=bert.pretraining_loss,
    measure_batch=_bert_batch,
    export=ZooExport("BertForPreTraining", _BERT_FIELDS, bert_hf_config, lambda name: (bert_hf.hf_name(name), False)),
    mlm=True,
)
ZOO: Mapping[str, ZooFamily] = MappingProxyType({f.name: f for f in (GPT, BERT)})


def zoo_family_of(config) -> ZooFamily | None:
    """The record whose config class ``config`` is, or None (not a model_zoo config)."""
    return next((f for f in ZOO.values() if isinstance(config, f.config_class)), None)


def zoo_family_on(arch: Architecture) -> ZooFamily | None:
    """The model_zoo family built on ``arch``, or None (model_zoo has no such model)."""
    return next((f for f in ZOO.values() if f.arch is arch), None)


def preset_family(name: str) -> ZooFamily | None:
    """The family that has a preset called ``name``, or None."""
    return next((f for f in ZOO.values() if name in f.presets), None)


def preset_names() -> list[str]:
    return [name for f in ZOO.values() for name in f.presets]
