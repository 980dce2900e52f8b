"""`StageMemory`'s accumulation temporaries: after a step's first micro-batch, a layer's backward
hands each gradient to ``.grad`` as a temporary (``grad += new``), the largest of them on top of
the layer's workspace while it runs; what the planner passes for them (`LayerCost.accumulated_bytes`)
against real layers' backwards."""

import contextlib
import math
from dataclasses import replace

import pytest
import torch

from model_zoo.bert import BertConfig, BertForPreTraining
from model_zoo.gpt import GPT, GPTConfig, lm_loss
from mp_toolkit.arch.architectures import ARCHITECTURES
from mp_toolkit.arch.zoo import BERT as BERT_FAMILY
from mp_toolkit.arch.zoo import GPT as GPT_FAMILY
from mp_toolkit.engine.embedding_rows import accumulate_by_rows
from mp_toolkit.hf.adapters import from_hf
from mp_toolkit.layers import LayerList, run_layers
from mp_toolkit.parallel.vocab_parallel import padded_vocab_size
from mp_toolkit.partition.cost import layer_costs, model_shape, shape_from_hf_config
from mp_toolkit.partition.memory import StageMemory, min_memory_cut
from mp_toolkit.partition.planner import PlanRequest, make_plan
from tests.new_tensors import NewTensors

ARGS = dict(static=[100, 10, 10, 60], activation=[1, 2, 2, 3], inflight=[2, 1], workspace=[0, 4, 4, 30],
            fixed=7, step_transient=[0, 0, 0, 0])


def test_the_running_layer_adds_its_workspace_and_its_accumulation_temporary():
    one_mb, several = StageMemory(**ARGS), StageMemory(**ARGS, accumulated=[0, 8, 8, 50])
    # stage 1 over layers 2..3: kept 1 x (2 + 3); the LM head-like layer 3 runs with 30 + 50 beside it
    assert one_mb(1, 2, 4) == 70 + 1 * 5 + 30 + 7
    assert several(1, 2, 4) == 70 + 1 * 5 + (30 + 50) + 7
    # the largest sum counts, not the largest of each: layer 1's 4 + 8 beats layer 0's 0 + 0
    assert several(0, 0, 2) == 110 + 2 * 3 + 12 + 7 and several.transient(0, 2) == 12
    # a rank of several chunks runs one backward at a time: one temporary, as one workspace
    assert several.of_rank([(0, 0, 1), (1, 3, 4)]) == 160 + (2 * 1 + 1 * 3) + 80 + 7


def test_the_step_still_counts_when_its_temporaries_are_larger():
    mem = StageMemory(**{**ARGS, "step_transient": [0, 0, 0, 200]}, accumulated=[0, 8, 8, 50])
    assert mem(1, 3, 4) == 60 + 200 + 7


def test_the_leanest_cut_moves_away_from_a_large_temporary():
    """Layer 3's temporary (the LM head's (V, C) gradient) makes its stage the largest: the leanest
    cut of 4 layers into 2 stages then gives it the fewest other layers."""
    assert min_memory_cut(StageMemory(**ARGS), 4, 2) == (124, [0, 1, 4])  # max(109, 80 + 7 + 30 + 7)
    assert min_memory_cut(StageMemory(**ARGS, accumulated=[0, 0, 0, 90]), 4, 2) == (190, [0, 3, 4])  # 60 + 3 + 120 + 7


# What the planner passes as `StageMemory.accumulated`: per layer, the largest parameter's gradient.

def test_each_layer_accumulates_its_largest_gradient_and_an_embedding_its_rows():
    """gpt2-medium, one sequence of 64 tokens: the LM head's (V, C) gradient (206 MB in fp32), a block's
    MLP matrix (16.8 MB), LayerNorm vectors, and the embedding's touched rows (at most the tokens and a
    padding row); at tp 2 the vocabulary is padded (to 50432, as the run pads it) and its embedding,
    vocabulary-parallel, is dense; matrices shard."""
    h, f = 1024, 4096
    for dtype, d, tp in (("fp32", 4, 1), ("bf16", 2, 1), ("fp32", 4, 2)):
        v = padded_vocab_size(50257, tp)
        shape = replace(model_shape("gpt2-medium"), vocab_size=v)
        acc = {c.name: c.accumulated_bytes for c in layer_costs(shape, 1, 64, dtype, tp)}
        assert acc["lm_head"] == v // tp * h * d and acc["h.0"] == acc["h.23"] == f * h // tp * d
        assert acc["ln_f"] == h * d
        assert acc["embed"] == ((64 + 1) * h * d if tp == 1 else v // tp * h * d)
    assert layer_costs(model_shape("gpt2-medium"), 1, 64)[-1].accumulated_bytes == 205_852_672


def largest_parameters(layers) -> list[int]:
    return [max(p.numel() for p in layer.parameters()) for layer in layers.layers]


def test_the_largest_parameters_are_the_models():
    """Each architecture's record (`arch.costs.LargestParameters`) against its real layers: model_zoo's
    GPT (fused qkv) and BERT, and transformers' Llama with grouped key/value heads."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        gpt = GPT(GPTConfig(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=96))
        bert = BertForPreTraining(BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=256))
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48))
    cases = [(LayerList.from_model(gpt), GPT_FAMILY.shape(gpt.config)),
             (LayerList.from_model(bert), BERT_FAMILY.shape(bert.config)),
             (from_hf(llama), shape_from_hf_config(llama.config.to_dict()))]
    for layers, shape in cases:
        arch = ARCHITECTURES[shape.family]
        rec = arch.costs.largest(shape, 1)
        norm = [rec.final_norm] if arch.layers.final_norm else []  # BERT has none
        assert largest_parameters(layers) == [rec.embedding, *[rec.block] * shape.num_layers, *norm, rec.head]
    assert cases[0][1].ffn == 96 and largest_parameters(cases[0][0])[1] == 3 * 64 * 64  # qkv beats a narrow MLP
    assert largest_parameters(cases[2][0])[1] == 64 * 64  # q and o beat the 48-wide gated MLP


def test_a_later_backward_hands_each_layer_its_largest_gradient_and_the_embedding_rows():
    """The second micro-batch's backward of each layer of an untied GPT, as a pipeline stage runs it
    (its embeddings accumulated by rows, `engine.embedding_rows`): the largest tensor of a parameter's
    shape it makes is `LayerCost.accumulated_bytes`; the embedding makes none, only its rows."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=False)
    layers = LayerList.from_model(GPT(config))
    b, s = 2, 16
    costs = layer_costs(GPT_FAMILY.shape(config), b, s)
    ids = torch.randint(0, config.vocab_size, (b, s + 1))
    x = ids[:, :-1]
    for layer, cost in zip(layers.layers, costs):
        accumulate_by_rows(layer)
        leaf = x if not x.is_floating_point() else x.detach().requires_grad_()
        made = NewTensors()
        for microbatch in range(2):
            y = run_layers([layer], leaf)
            root = lm_loss(y, ids[:, 1:]) if cost is costs[-1] else y
            grad = None if cost is costs[-1] else torch.ones_like(y)
            with made if microbatch == 1 else contextlib.nullcontext():
                torch.autograd.backward(root, grad)
        shapes = {tuple(p.shape) for p in layer.parameters()}
        nbytes = [math.prod(shape) * dtype.itemsize for shape, dtype in made.made if shape in shapes]
        if cost is costs[0]:
            rows = [math.prod(shape) * dtype.itemsize for shape, dtype in made.made
                    if len(shape) == 2 and shape[1] == config.n_embd]
            assert not nbytes and 0 < max(rows) <= cost.accumulated_bytes
        else:
            assert max(nbytes) == cost.accumulated_bytes, cost.name
        x = y.detach()


def test_the_plan_counts_the_heads_gradient_only_when_a_step_accumulates():
    """One micro-batch per step: the LM head's gradient becomes .grad; four: three times it is a
    (V, C) temporary beside it, on top of the logits' workspace, and the last stage's peak grows by it
    (AdamW's fused step makes no temporary to hide it; 1F1B's last stage holds one micro-batch either way)."""
    base = dict(model="gpt-small-cpu", pp=2, micro_batch=2, seq_len=32, tflops=1.0, optimizer="adamw",
                method="uniform", schedule="1f1b")
    one, four = (make_plan(PlanRequest(**base, microbatches=m)) for m in (1, 4))
    head = four.layers[-1]
    assert head.accumulated_bytes == 4096 * 128 * 4
    assert four.stages[-1].memory_bytes - one.stages[-1].memory_bytes == head.accumulated_bytes
