"""The planner's kept bytes per layer family against what autograd keeps, at a small shape on this CPU.

    .venv/bin/python -m tools.bench_planner_memory [--seq 128] [--batch 2] [--hidden 256]

For each family (model_zoo GPT and BERT; transformers' GPT-2, BERT, Llama, Mistral, Qwen2 built from
their own modules), each dtype and dropout 0 / 0.1 where the family has dropout, one block is run on
its real input in training mode and its saved tensors counted with `saved_tensors_hooks` (one count
per storage, parameters excluded: `mp_toolkit.partition.measure.measure_layers`); the table gives
that against `mp_toolkit.partition.cost.layer_costs`. Prints the machine header (`tools.report`), a
table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers

from model_zoo.bert import BertConfig, BertForPreTraining
from model_zoo.gpt import GPT, GPTConfig
from mp_toolkit.hf.adapters import from_hf
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.master import PRECISIONS
from mp_toolkit.partition.cost import layer_costs, shape_from_hf_config
from mp_toolkit.partition.measure import measure_layers
from tools.report import header, json_line

VOCAB = 1000


def cases(h: int, seq: int):
    """(label, dropout, build() -> (layer list, config dict, hf_modules))."""
    heads, f = 4, 4 * h
    gpt = dict(vocab_size=VOCAB, n_positions=seq, n_embd=h, n_layer=2, n_head=heads)
    bert = dict(vocab_size=VOCAB, hidden_size=h, num_hidden_layers=2, num_attention_heads=heads, intermediate_size=f,
                max_position_embeddings=seq)
    llama = dict(vocab_size=VOCAB, hidden_size=h, num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=2,
                 intermediate_size=f * 2 // 3)
    for p in (0.0, 0.1):
        gd = {**gpt, "attn_pdrop": p, "resid_pdrop": p, "embd_pdrop": p}
        bd = {**bert, "hidden_dropout_prob": p, "attention_probs_dropout_prob": p}
        yield "GPT (model_zoo)", p, lambda d=gd: (LayerList.from_model(GPT(GPTConfig(**d))),
                                                  {"model_type": "gpt2", **d}, False)
        yield "BERT (model_zoo)", p, lambda d=bd: (LayerList.from_model(BertForPreTraining(BertConfig(**d))),
                                                   {"model_type": "bert", **d}, False)
        yield "GPT-2 (HF)", p, lambda d=gd: _hf("GPT2Config", "GPT2LMHeadModel", d)
        yield "BERT (HF)", p, lambda d=bd: _hf("BertConfig", "BertForPreTraining", d)
    yield "Llama (HF)", 0.0, lambda: _hf("LlamaConfig", "LlamaForCausalLM", llama)
    yield "Mistral (HF)", 0.0, lambda: _hf("MistralConfig", "MistralForCausalLM", llama)
    yield "Qwen2 (HF)", 0.0, lambda: _hf("Qwen2Config", "Qwen2ForCausalLM", llama)


def _hf(config_cls: str, model_cls: str, d: dict):
    config = getattr(transformers, config_cls)(**d)
    return from_hf(getattr(transformers, model_cls)(config)), json.loads(config.to_json_string()), True


def block_bytes(build, dtype: str, batch: int, seq: int) -> tuple[int, int]:
    """(measured, planned) kept bytes of the first block."""
    torch.manual_seed(0)
    layers, config, hf = build()
    layers = layers.to(PRECISIONS[dtype])
    layers.train()
    measured = measure_layers(layers, torch.randint(0, VOCAB, (batch, seq)), warmup=0, repeats=1, microbatches=1)
    planned = layer_costs(shape_from_hf_config(config, hf_modules=hf), batch, seq, dtype)
    return measured[1].activation_bytes, planned[1].activation_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--dtypes", default="fp32,bf16")
    args = ap.parse_args()
    head = header("bench_planner_memory")
    torch.set_num_threads(1)
    rows = []
    print(f"{'family':18s} {'dropout':>7s} {'dtype':5s} "
          f"{'measured MiB':>12s} {'planned MiB':>11s} {'planned/measured':>16s}")
    for label, p, build in cases(args.hidden, args.seq):
        for dtype in args.dtypes.split(","):
            m, planned = block_bytes(build, dtype, args.batch, args.seq)
            rows.append(dict(family=label, dropout=p, dtype=dtype, measured=m, planned=planned))
            print(f"{label:18s} {p:7.1f} {dtype:5s} {m / 2**20:12.3f} {planned / 2**20:11.3f} {planned / m:16.3f}")
    json_line("bench_planner_memory", head, batch=args.batch, seq=args.seq, hidden=args.hidden, rows=rows)


if __name__ == "__main__":
    main()
