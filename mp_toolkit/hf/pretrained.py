"""An HF model built without its weights, and each rank's own tensors of it read from its directory.

``from_pretrained`` gives every process the whole model. A rank of `mpt train --hf DIR` holds only
its own part (DESIGN.md invariant 9):

1. `skeleton(cls, config)` is ``cls(config)`` with every Parameter on the meta device (shape and
   dtype, no storage) while buffers are made for real, as ``__init__`` computes them (rotary
   ``inv_freq``, BERT's ``position_ids``): `empty_parameters` moves each Parameter to meta as its
   module registers it, as accelerate's ``init_empty_weights(include_buffers=False)`` does. The ties
   HF makes in ``__init__`` (GPT-2's ``lm_head.weight is transformer.wte.weight``) hold on meta.
2. `from_hf` and the tensor-parallel plan split it, still on meta (`mp_toolkit.run.compose`).
3. `PretrainedWeights` gives a parameter, named as in the unsplit layer list, from the directory's
   files: `hf_name_map` (read off identity on the unsplit skeleton) gives its HF names; a tied weight
   has several and is read from the first the directory holds (GPT-2's ``lm_head.weight`` from
   ``transformer.wte.weight``, BERT's MLM decoder from the word embedding); a tensor-parallel shard
   is read as the slices `shard_ranges` names. `mp_toolkit.parallel.materialize` asks it for this
   rank's layers only, so a rank opens only the files holding them.

The values are ``from_pretrained(DIR, dtype=torch.float32)``'s bit for bit: the same bytes, cast to
the parameter's dtype. A parameter the directory lacks, which ``from_pretrained`` would initialise
at random (something a rank holding one part cannot repeat), is a `WeightsError` naming it, as is a
tensor of another shape than the config gives; `PretrainedWeights.check` makes every such check on
the files' headers alone, before any rank starts.

    model = skeleton(transformers.LlamaForCausalLM, config)
    weights = PretrainedWeights(model, "runs/llama-init")
    layers = apply_hf_tensor_parallel(from_hf(model), ctx)                     # shapes only
    materialize(layers, keep, weights.initial_value, ctx, shard_value=weights.shard_value)
"""

from __future__ import annotations

import contextlib

import torch
import transformers
from torch import nn

from mp_toolkit.hf.adapters import from_hf, hf_name_map
from mp_toolkit.hf.common import layer_state_dict
from mp_toolkit.hf.configs import load_config
from mp_toolkit.hf.model import HFModel, HFSource
from mp_toolkit.hf.weights import SafetensorsFiles, TensorEntry, WeightsError
from mp_toolkit.optim.groups import is_tensor_parallel
from mp_toolkit.parallel.tensor_parallel import shard_ranges


@contextlib.contextmanager
def empty_parameters():
    """Inside, every Parameter a module registers is moved to the meta device as it is registered;
    buffers stay where they are made. A Parameter already on meta is kept as it is, so assigning
    one module's Parameter to another (a tie) keeps them one object."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        p = module._parameters[name]
        if p is not None and not p.is_meta:
            module._parameters[name] = _on_meta(p)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def skeleton(cls: type, config) -> nn.Module:
    """``cls(config)`` with its parameters on meta and its buffers real, in eval mode as
    ``from_pretrained`` returns a model."""
    with empty_parameters():
        model = cls(config)
    moved: dict[int, nn.Parameter] = {}  # one placed in _parameters directly (not registered): the same, once
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and not p.is_meta:
                module._parameters[name] = moved.setdefault(id(p), _on_meta(p))
    return model.eval()


def _on_meta(p: nn.Parameter) -> nn.Parameter:
    meta = type(p)(p.to("meta"), requires_grad=p.requires_grad)
    meta.__dict__.update(p.__dict__)  # attributes set on it before registration
    return meta


class PretrainedWeights:
    """The parameters of ``from_hf(model)``, by layer-list name, as ``directory``'s files hold them.

    ``model`` is the unsplit model (a `skeleton`); its layer list may be split later, since a name
    says which tensor and the meta parameter passed to `shard_value` says which part of it.
    """

    def __init__(self, model: nn.Module, directory):
        self.files = SafetensorsFiles(directory)
        self.hf_names = hf_name_map(model)  # a tied weight: every HF name, in the model's state order
        params = {id(p) for p in model.parameters()}
        self.shapes = {name: tuple(t.shape) for name, t in layer_state_dict(from_hf(model), keep_vars=True).items()
                       if id(t) in params}

    def source(self, name: str) -> tuple[str, TensorEntry]:
        """(the HF name ``name`` is read under, its entry), the shape checked against the config's."""
        keys = self.hf_names[name]
        key = next((k for k in keys if k in self.files), None)
        if key is None:
            what = " or ".join(keys) + (" (one tied weight)" if len(keys) > 1 else "")
            raise WeightsError(f"{self.files.origin} has no tensor {what}: from_pretrained would initialise it at "
                               "random, which a rank loading only its own layers cannot repeat; save the model with "
                               "save_pretrained so that its files hold every weight")
        entry = self.files.entry(key)
        if entry.shape != self.shapes[name]:
            raise WeightsError(f"{entry.file}: tensor {key} has shape {entry.shape} but config.json makes it "
                               f"{self.shapes[name]}: the weights and the config are not one model's")
        return key, entry

    def check(self) -> None:
        """Every parameter is in the files with its shape, and every file it is in is whole (headers only)."""
        for name in self.shapes:
            self.source(name)

    def initial_value(self, name: str) -> torch.Tensor:
        """The whole of parameter ``name`` as stored (its dtype is the file's)."""
        key, _ = self.source(name)
        return self.files.read(key)

    def shard_value(self, name: str, layout: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
        """``shard_full(initial_value(name), layout, tp_rank, tp)``, read from the file as slices."""
        if not is_tensor_parallel(layout):
            return self.initial_value(name)
        key, entry = self.source(name)
        dim, stride = layout.partition_dim, layout.partition_stride
        return self.files.read(key, dim, shard_ranges(entry.shape[dim], stride, tp_rank, tp, dim))


def build_model(source: HFSource) -> HFModel:
    """``--hf DIR``'s model: its skeleton (parameters on meta, buffers as ``__init__`` computes them; under
    a meta default device, validate's plan, those too), its `from_hf` layer list and its
    `PretrainedWeights`. The config is the source's: a BERT corpus's [PAD] replaces the saved
    pad_token_id (the embedding's padding_idx)."""
    with _default_dtype(torch.float32):  # the parameters' dtype, as from_pretrained(dtype=torch.float32)
        model = skeleton(getattr(transformers, source.architecture), load_config(source.config))
    return HFModel(model, PretrainedWeights(model, source.path), from_hf(model))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Floating tensors made inside default to ``dtype``."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
