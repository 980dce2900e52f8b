"""Models that do not fit on one rank (DESIGN.md invariant 9): each rank builds the model on the
meta device and materialises only its own stages' layers, with tensor parallelism only its shards,
from initial values that depend on (seed, parameter name) alone -- so every layout starts from the
unsplit model's weights (the oracle tests then train from there)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model_zoo.bert import BertForPreTraining
from model_zoo.bert_config import PRESETS as BERT_PRESETS
from model_zoo.gpt import GPT, PRESETS
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.groups import is_tensor_parallel
from mp_toolkit.parallel.context import build_context
from mp_toolkit.parallel.materialize import is_meta, materialize, rank_layers
from mp_toolkit.parallel.tensor_parallel import gather_full
from mp_toolkit.partition.memstats import rss_bytes
from mp_toolkit.run.config import TrainConfig
from tests.dist_harness import run_world


def _meta(build, seed=0):
    torch.manual_seed(seed)
    with torch.device("meta"):
        return build()


def _real(build, seed=0):
    torch.manual_seed(seed)
    return build()


@pytest.mark.parametrize("build", [lambda: GPT(PRESETS["gpt-tiny"]),
                                   lambda: BertForPreTraining(BERT_PRESETS["bert-tiny"])],
                         ids=["gpt", "bert"])
def test_a_layer_drawn_alone_equals_the_same_layer_of_the_whole_model(build):
    whole, meta = _real(build), _meta(build)
    layers, ref = LayerList.from_model(meta), LayerList.from_model(whole)
    keep = [1, 2]
    nbytes = materialize(layers, keep, meta.initial_value, build_context(1))
    for i, (name, layer) in enumerate(zip(layers.names, layers.layers)):
        for path, p in layer.named_parameters():
            if i in keep:
                assert not p.is_meta and torch.equal(p, ref[name].get_parameter(path)), f"{name}.{path}"
            else:
                assert p.is_meta, f"{name}.{path} was allocated on a rank that does not hold it"
    assert nbytes == sum(p.numel() * 4 for i in keep for p in layers.layers[i].parameters())


def test_initial_values_depend_on_the_seed_and_name_only():
    a, b = _meta(lambda: GPT(PRESETS["gpt-tiny"])), _meta(lambda: GPT(PRESETS["gpt-tiny"]))
    assert a.init_seed == b.init_seed
    assert torch.equal(a.initial_value("h.2.mlp.fc.weight"), b.initial_value("h.2.mlp.fc.weight"))
    assert not torch.equal(a.initial_value("h.2.mlp.fc.weight"), a.initial_value("h.1.mlp.fc.weight"))
    other = _meta(lambda: GPT(PRESETS["gpt-tiny"]), seed=1)
    assert not torch.equal(other.initial_value("h.2.mlp.fc.weight"), a.initial_value("h.2.mlp.fc.weight"))
    # the tied LM head is the embedding's draw; the untied one is its own
    assert torch.equal(a.initial_value("lm_head.weight"), a.initial_value("embed.wte.weight"))
    untied = _meta(lambda: GPT(dataclasses.replace(PRESETS["gpt-tiny"], tie_word_embeddings=False)))
    assert not torch.equal(untied.initial_value("lm_head.weight"), untied.initial_value("embed.wte.weight"))
    # GPT-2's scaled residual projections: std / sqrt(2 n_layer)
    big = _meta(lambda: GPT(dataclasses.replace(PRESETS["gpt-tiny"], n_embd=256, n_head=4)))
    proj, fc = big.initial_value("h.0.attn.proj.weight"), big.initial_value("h.0.mlp.fc.weight")
    assert proj.std().item() == pytest.approx(0.02 / 8 ** 0.5, rel=0.05)
    assert fc.std().item() == pytest.approx(0.02, rel=0.05)


def test_a_wrong_shape_or_a_meta_buffer_is_refused_by_name():
    meta = _meta(lambda: GPT(PRESETS["gpt-tiny"]))
    layers = LayerList.from_model(meta)
    with pytest.raises(ValueError, match=r"^h\.0\.ln_1\.weight: initial value of shape \(3,\)"):
        materialize(layers, [1], lambda name: torch.zeros(3), build_context(1))
    with torch.device("meta"):
        layers.layers[2].register_buffer("mask", torch.ones(4))
    with pytest.raises(ValueError, match=r"^h\.1\.mask: a meta buffer has no initial value"):
        materialize(layers, [2], meta.initial_value, build_context(1))


def test_one_stage_of_gpt2_large_costs_its_own_share_of_memory():
    """gpt2-large (774M parameters, 3.1 GB fp32) built on meta: materialising one middle stage of
    an 8-way cut allocates that stage's bytes (5 of 36 blocks, 13%), not the model."""
    meta = _meta(lambda: GPT(PRESETS["gpt2-large"]))
    layers = LayerList.from_model(meta)
    full = 4 * meta.num_parameters()
    boundaries = [0, 5, 10, 15, 20, 24, 28, 32, len(layers)]
    before = rss_bytes()
    nbytes = materialize(layers, rank_layers(boundaries, [3]), meta.initial_value, build_context(1))
    grown = rss_bytes() - before
    stage = 4 * sum(p.numel() for i in range(15, 20) for p in layers.layers[i].parameters())
    assert nbytes == stage and stage < full / 6  # 5 of 36 blocks
    assert grown < 1.5 * stage, f"materialising {stage / 2**20:.0f} MiB grew the process by {grown / 2**20:.0f} MiB"
    assert all(p.is_meta for i in (0, 14, 20, len(layers) - 1) for p in layers.layers[i].parameters())


def test_rank_layers_of_interleaved_stages():
    assert rank_layers([0, 2, 4, 6, 8], [0, 2]) == [0, 1, 4, 5]
    assert rank_layers([0, 3, 7], [1]) == [3, 4, 5, 6]


# ---------------------------------------------------------------- every rank of a pp x tp grid

def grid_rank(rank, world, pp, tp, schedule, tied):
    """build_engine over a meta-built gpt-tiny: what this rank allocated, and its full tensors."""
    from mp_toolkit.run.compose import build_engine
    from mp_toolkit.run.plan import resolve_run

    ctx = build_context(pp, tp, 1)
    cfg = dataclasses.replace(PRESETS["gpt-tiny"], tie_word_embeddings=tied)
    model = _meta(lambda: GPT(cfg))
    train_cfg = TrainConfig.of(model="gpt-tiny", seq_len=64, pp=pp, tp=tp, schedule=schedule, microbatches=2 * pp,
                               partition="uniform", chunks=2 if schedule == "interleaved" else 1)
    engine = build_engine(resolve_run(train_cfg), ctx, model)
    held = {n: p for n, p in engine.named_parameters()}
    return {
        "coords": (ctx.pp_rank, ctx.tp_rank),
        "real": all(not p.is_meta for p in held.values()),
        "sharded": {n: (tuple(p.shape), is_tensor_parallel(p)) for n, p in held.items()},
        "full": {n: gather_full(p, ctx.tp_group).clone() for n, p in held.items()},
        "blocks_on_meta": sorted(f"h.{i}" for i, block in enumerate(model.h) if is_meta(block)),
        "stage_layers": sorted({n.split(".")[0] if not n.startswith("h.") else ".".join(n.split(".")[:2])
                                for n in held}),
    }


@pytest.mark.parametrize("pp,tp,schedule,tied", [(2, 2, "1f1b", True), (2, 1, "interleaved", False)],
                         ids=["pp2-tp2-tied", "pp2-interleaved"])
def test_every_rank_holds_its_own_layers_and_shards_only(pp, tp, schedule, tied):
    reports = run_world(grid_rank, pp * tp, pp, tp, schedule, tied, timeout_s=240)
    cfg = dataclasses.replace(PRESETS["gpt-tiny"], tie_word_embeddings=tied)
    whole = _real(lambda: GPT(cfg))
    ref = {f"{n}.{path}": p for n, layer in whole.named_layers()
           for path, p in layer.named_parameters(remove_duplicate=False)}
    blocks = {f"h.{i}" for i in range(cfg.n_layer)}
    covered = set()
    for r in reports:
        assert r["real"]
        # the blocks this rank does not hold were never allocated: still on meta in its model
        assert set(r["blocks_on_meta"]) == blocks - set(r["stage_layers"]), r
        for n, full in r["full"].items():
            assert torch.equal(full, ref[n]), f"rank {r['coords']}: {n} does not start from the unsplit model's value"
            shape, sharded = r["sharded"][n]
            if sharded:  # a 1/tp share of the full tensor, not the full tensor
                assert shape != tuple(ref[n].shape) and torch.Size(shape).numel() * tp == ref[n].numel(), (n, shape)
        covered |= set(r["full"])
    assert covered == set(ref)  # every tensor of the model is held somewhere, tied ends on both stages


def test_a_resuming_rank_allocates_its_layers_without_drawing_them():
    """``values=False`` (the run resumes: its checkpoint fills every parameter): the rank's layers get
    storage of the right shape and the others stay on meta, and no initial value is drawn."""
    from mp_toolkit.run.compose import own_layers

    model = _meta(lambda: GPT(PRESETS["gpt-tiny"]))
    drawn, draw = [], model.initial_value
    model.initial_value = lambda name: (drawn.append(name), draw(name))[1]
    layers = LayerList.from_model(model)
    own_layers(model, layers, [1, 2], build_context(1), values=False)
    assert not drawn
    for i, layer in enumerate(layers.layers):
        assert all(p.is_meta == (i not in (1, 2)) for p in layer.parameters()), layers.names[i]
    own_layers(model, layers, [3], build_context(1))  # with values (a fresh run): drawn
    assert drawn and all(name.startswith(f"{layers.names[3]}.") for name in drawn), drawn
