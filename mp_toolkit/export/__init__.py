"""Writing HuggingFace ``from_pretrained`` directories (`mpt export`).

* `hf_dir`: `export_hf` (a LayerList or its state -> an HF directory), `HFTarget` and `write_hf_dir`
  (the tensors an HF class holds, streamed into `safetensors_out.ShardedSafetensors`).
* `checkpoint`: `export_run` / `export_checkpoint`: one of our checkpoints -> one HF directory, a
  layer at a time; `zoo`: a `model_zoo` run written by its family record's export half;
  `tokenizer`: the tokenizer the run trained, or the one the user names.

It reads what runs recorded (manifests, the model_zoo family records of `mp_toolkit.arch.zoo`) and
never imports the trainer (`mp_toolkit.run`).
"""
