"""HF directories from checkpoints of our own models (`mpt train --model gpt-tiny | gpt2 | config.json | bert-*`).

A checkpoint of a `model_zoo` run holds full tensors under our names and its manifest records the
model (``{"family": "gpt" | "bert", "config": {...}}``, `ModelSpec.to_json`). The HF class and
config it is written as, and each tensor's HF name, are the export half of the family's record
(`mp_toolkit.arch.zoo`: GPT -> GPT2LMHeadModel with its Conv1D weights transposed, BERT ->
BertForPreTraining). What HF cannot express (today: a GPT without biases; or a config field the
record does not know) is refused in one line rather than written as a model that computes something else.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
import transformers

from mp_toolkit.arch.zoo import ZOO, ZooFamily
from mp_toolkit.export.hf_dir import HFTarget
from mp_toolkit.hf.configs import load_config


class ExportError(ValueError):
    """A checkpoint HF cannot hold as it is (one line naming what differs)."""


def zoo_model(manifest: Mapping) -> tuple[ZooFamily, object] | None:
    """(the family record, the config) of the `model_zoo` model a run recorded in its manifest, or None
    (not such a run)."""
    model = manifest.get("model")
    if not isinstance(model, Mapping) or model.get("family") not in ZOO:
        return None
    zoo, cfg = ZOO[model["family"]], model.get("config")
    try:
        config = zoo.config_from_dict(cfg)
    except (ValueError, TypeError) as e:
        raise ExportError(f"the manifest's {zoo.name} model config is not valid: {str(e).splitlines()[0]}") from None
    unknown = sorted(set(cfg) - zoo.export.known_fields)
    if unknown:  # a field added to our config later: it might change what the model computes
        raise ExportError(f"the {zoo.name} config field(s) {', '.join(unknown)} have no {zoo.export.hf_class} "
                          "counterpart known to the exporter: it cannot say the HF model computes the same")
    return zoo, config


def hf_config(zoo: ZooFamily, config) -> transformers.PretrainedConfig:
    """The GPT2Config / BertConfig that makes HF compute what the model of ``config`` computes."""
    try:
        d = zoo.export.hf_config(config)
    except ValueError as e:  # the record's one line: what HF cannot hold
        raise ExportError(str(e)) from None
    return load_config(d)


def zoo_target(zoo: ZooFamily, config, dtype: torch.dtype) -> HFTarget:
    """The HF class and config the model of ``config`` is written as, on meta."""
    return HFTarget.of(getattr(transformers, zoo.export.hf_class), hf_config(zoo, config), dtype)


def zoo_tensors_as_hf(named: Iterable[tuple[str, torch.Tensor]], zoo: ZooFamily) -> Iterator[tuple[str, torch.Tensor]]:
    """A `model_zoo` checkpoint's ``(state key, tensor)`` pairs as ``(HF key, tensor)`` pairs (GPT's
    Linear weights transposed to Conv1D's (in, out)); `write_hf_dir` checks names and shapes."""
    for name, t in named:
        try:
            key, transpose = zoo.export.hf_key(name)
        except ValueError as e:
            raise ExportError(str(e)) from None
        yield key, (t.t().contiguous() if transpose else t)
        del t  # not held while the next one is read
