"""What a model *is*, as records the layers above look up once instead of comparing names.

* `architectures`: one `Architecture` per kind of Transformer the toolkit knows ("gpt2", "bert",
  "llama", the last also Mistral and Qwen2): its layer names and classes, its HF config read into a
  `shape.ModelShape`, its per-layer arithmetic for the cost model (`costs`), its tensor-parallel plan
  over HF's modules, the sizes a tp degree must divide, and which recomputation its blocks allow.
* `zoo`: one `ZooFamily` per `model_zoo` family ("gpt", "bert"): its model and config classes and
  presets, its shape for the cost model read from its config directly, its measurement batch, its
  TP plan, its loss on full logits and the export half (the HF class and config it is written as).

Pure data and arithmetic over `model_zoo` (torch only): `mp_toolkit.partition`, `mp_toolkit.hf`,
`mp_toolkit.export` and `mp_toolkit.run` all import it; it imports none of them.
"""
