"""HuggingFace transformers <-> LayerList (DESIGN.md: "HF model -> LayerList").

* `from_hf(model)`: GPT2LMHeadModel, BertForPreTraining, BertForMaskedLM, LlamaForCausalLM,
  MistralForCausalLM, Qwen2ForCausalLM -> LayerList reusing HF's own modules (`adapters.py`).
* `causal_lm_loss`, `shift_labels`, `masked_lm_loss`, `pretraining_loss`: losses in our label
  convention (labels pre-shifted, as our data pipeline yields them) (`losses.py`).
* `apply_hf_tensor_parallel`, `GPT2_TP_PLAN`, `LLAMA_TP_PLAN`, `BERT_TP_PLAN`: Megatron-style TP plans (`tp_plans.py`).
* `export_hf`, `hf_name_map`, `to_hf_state_dict`: HF directories that ``from_pretrained`` loads
  (`export.py`); `load_config`, `architecture_for`: HF configs and the class they name (`configs.py`).
* `skeleton`, `PretrainedWeights`, `WeightsError`: an HF model built with its parameters on meta,
  and each rank's own tensors (tensor-parallel shards as slices) read from the directory's
  model.safetensors or sharded index (`pretrained.py`, `weights.py`).

The `mpt export` path sits above `mp_toolkit.run` (it reads what a run recorded) and so is not
re-exported here: `export_run.export_run` and `export_run.export_checkpoint` (checkpoint + tokenizer ->
one HF directory), `zoo_export` (checkpoints of our model_zoo GPT / BERT), `run_tokenizer`.

Single process, pipeline (pp=2) and tensor parallel (tp=2) use::

    layers = from_hf(AutoModelForCausalLM.from_pretrained(path))
    layers = apply_hf_tensor_parallel(layers, ctx)          # when ctx.tp > 1
    engine = PipelineEngine(layers, ctx, boundaries, m, "1f1b", optimizer,
                            loss_fn=lambda logits, y: causal_lm_loss(logits, y, ctx.tp_group))
"""

from mp_toolkit.hf.adapters import SUPPORTED, UnsupportedModelError, from_hf, model_type_of
from mp_toolkit.hf.common import layer_state_dict
from mp_toolkit.hf.configs import architecture_for, load_config
from mp_toolkit.hf.export import copy_tokenizer, export_hf, hf_name_map, to_hf_state_dict
from mp_toolkit.hf.losses import causal_lm_loss, masked_lm_loss, pretraining_loss, shift_labels
from mp_toolkit.hf.tp_plans import (
    BERT_TP_PLAN, GPT2_TP_PLAN, LLAMA_TP_PLAN, TP_PLANS, apply_hf_tensor_parallel, check_hf_tensor_parallel,
)
from mp_toolkit.hf.pretrained import PretrainedWeights, skeleton
from mp_toolkit.hf.weights import WeightsError

__all__ = [
    "SUPPORTED", "UnsupportedModelError", "from_hf", "model_type_of", "layer_state_dict",
    "causal_lm_loss", "shift_labels", "masked_lm_loss", "pretraining_loss",
    "GPT2_TP_PLAN", "LLAMA_TP_PLAN", "BERT_TP_PLAN", "TP_PLANS", "apply_hf_tensor_parallel", "check_hf_tensor_parallel",
    "export_hf", "hf_name_map", "to_hf_state_dict", "load_config", "architecture_for",
    "copy_tokenizer", "PretrainedWeights", "skeleton", "WeightsError",
]
