"""HuggingFace transformers <-> LayerList (DESIGN.md: "HF model -> LayerList").

Nothing is imported here: each module imports transformers where it uses it, so the light ones
(`model`: `HFSource` and `HFModel`, what the family table names for every run; `weights`) cost no
transformers import.

* `adapters.from_hf(model)`: GPT2LMHeadModel, BertForPreTraining, BertForMaskedLM, LlamaForCausalLM,
  MistralForCausalLM, Qwen2ForCausalLM -> LayerList reusing HF's own modules; `adapters.hf_name_map`
  pairs its names with HF's state-dict keys.
* `losses`: `causal_lm_loss`, `shift_labels`, `masked_lm_loss`, `pretraining_loss`, in our label
  convention (labels pre-shifted, as our data pipeline yields them).
* `tp_plans.apply_hf_tensor_parallel`: Megatron-style tensor parallelism by the architecture's plan
  (data in `mp_toolkit.arch.architectures`).
* `configs`: `load_config`, `architecture_for`: HF configs and the class they name.
* `pretrained`: `skeleton`, `PretrainedWeights`, `build_model`: an HF model built with its parameters
  on meta, and each rank's own tensors (tensor-parallel shards as slices) read from the directory's
  model.safetensors or sharded index (`weights`, `WeightsError`).

Writing HF directories is `mp_toolkit.export`.

Single process, pipeline (pp=2) and tensor parallel (tp=2) use::

    layers = from_hf(AutoModelForCausalLM.from_pretrained(path))
    layers = apply_hf_tensor_parallel(layers, ctx)          # when ctx.tp > 1
    engine = PipelineEngine(layers, ctx, boundaries, m, "1f1b", optimizer,
                            loss_fn=lambda logits, y: causal_lm_loss(logits, y, ctx.tp_group))
"""
