"""Device and cluster profiles (issue 36): the reader's one-line errors, the shipped specification
profiles, where a grid's communication runs (`Placement`), a CPU rank's share of the cores, and
this machine's measured profile (`profile_here`, its compute rates from `compute_rates`), checked
for its structure only."""
import copy
import json
import math
import os
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from mp_toolkit.layers import LayerList
from mp_toolkit.partition.cluster import (
    SHIPPED,
    ClusterError,
    ClusterProfile,
    Link,
    profile_from_dict,
    profile_to_dict,
    read_profile,
    shipped_profile,
)
from mp_toolkit.partition.compute_rates import (
    PROBE_ROWS,
    SUSTAINED_PASSES,
    SUSTAINED_SHARE,
    block_products,
    device_rates,
    model_ends,
    sustained_tflops,
    synced_layer_seconds,
    timed_tokens,
)
from mp_toolkit.partition.cost import layer_costs, model_shape
from mp_toolkit.partition.planner import PlanRequest, make_plan
from mp_toolkit.partition.profile_here import fit_link, measure_profile, write_profile
from mp_toolkit.partition.rates import CUDA_ALLOCATOR_OVERHEAD
from mp_toolkit.run.config import ConfigError

INTRA = {"p2p_gbps": 450, "p2p_latency_us": 10, "collective_gbps": 400, "collective_latency_us": 15}
INTER = {"p2p_gbps": 50, "p2p_latency_us": 15, "collective_gbps": 45, "collective_latency_us": 25}


def gpu_doc() -> dict:
    return {"name": "two nodes", "source": "specification", "note": "a test's figures", "nodes": 2,
            "devices_per_node": 4,
            "device": {"kind": "cuda", "name": "GPU", "memory_gb": 80, "tflops": {"fp32": 60, "bf16": 900},
                       "mem_gbps": 3000, "runtime_gb": 0.5, "peak_tflops": {"fp32": 67, "bf16": 989}},
            "intra_node": dict(INTRA), "inter_node": dict(INTER)}


def cpu_doc() -> dict:
    return {"name": "this cpu", "source": "measured", "nodes": 1, "devices_per_node": 4,
            "device": {"kind": "cpu", "name": "CPU", "memory_gb": 32, "tflops": {"fp32": 0.08}, "mem_gbps": 14,
                       "runtime_gb": 0.25, "cores": 2},
            "intra_node": dict(INTRA), "inter_node": dict(INTRA)}


def refused(doc, match: str) -> str:
    with pytest.raises(ClusterError, match=match) as e:
        profile_from_dict(doc, "test.json")
    assert "\n" not in str(e.value)
    return str(e.value)


def edit(path: tuple[str, ...], value=None, delete: bool = False) -> dict:
    doc = gpu_doc()
    holder = doc
    for key in path[:-1]:
        holder = holder[key]
    if delete:
        del holder[path[-1]]
    else:
        holder[path[-1]] = value
    return doc


# --- shipped profiles -----------------------------------------------------------------------------

def test_every_shipped_profile_loads_as_specification_figures():
    assert {"h100-sxm", "a100-sxm-80gb", "h200-sxm", "l4"} <= set(SHIPPED)
    for name in SHIPPED:
        p = read_profile(name)
        assert p.source == "specification" and "specification figures, not measurements" in p.describe()
        assert p.device.kind == "cuda" and "datasheet" in p.note and "NCCL" in p.note
        assert p.device.rate("fp32") > 0 and p.device.rate("bf16") > p.device.rate("fp32")
        assert p.intra_node.p2p_gbps > p.inter_node.p2p_gbps


def test_shipped_figures_are_the_datasheets():
    h100, h200, l4 = read_profile("h100-sxm"), read_profile("h200-sxm"), read_profile("l4")
    assert (h200.device.memory_gb, h200.device.mem_gbps) == (141, 4800)
    assert h200.device.tflops == h100.device.tflops == (("fp32", 67), ("bf16", 989), ("fp16", 989))
    assert (l4.device.memory_gb, l4.device.mem_gbps, dict(l4.device.tflops)) == (
        24, 300, {"fp32": 30.3, "bf16": 121, "fp16": 121})
    assert (l4.intra_node.p2p_gbps, l4.inter_node.p2p_gbps, l4.devices_per_node) == (32, 25, 8)
    assert shipped_profile("l4", nodes=4).devices == 32 and shipped_profile("l4", nodes=4).note == l4.note


# --- the reader's errors --------------------------------------------------------------------------

REQUIRED = [("nodes",), ("devices_per_node",), ("device",), ("device", "kind"), ("device", "memory_gb"),
            ("device", "tflops"), ("device", "mem_gbps"), ("intra_node",), ("inter_node",)] + [
    (link, f) for link in ("intra_node", "inter_node") for f in INTRA]


@pytest.mark.parametrize("path", REQUIRED, ids=".".join)
def test_a_missing_field_is_one_line_naming_it(path):
    message = refused(edit(path, delete=True), "missing" if path[-1] != "kind" else "device.kind is None")
    assert path[-1] in message


BAD_VALUES = [(("nodes",), 0), (("nodes",), -1), (("nodes",), 1.5), (("nodes",), "2"), (("nodes",), True),
              (("devices_per_node",), 0), (("devices_per_node",), None), (("device", "memory_gb"), 0),
              (("device", "memory_gb"), -80), (("device", "memory_gb"), "80"), (("device", "memory_gb"), False),
              (("device", "memory_gb"), math.nan), (("device", "memory_gb"), math.inf),
              (("device", "tflops", "fp32"), 0), (("device", "tflops", "bf16"), math.nan),
              (("device", "tflops", "fp32"), True), (("device", "tflops", "bf16"), "fast"),
              (("device", "peak_tflops", "fp32"), -1), (("device", "mem_gbps"), -1), (("device", "runtime_gb"), -0.5),
              (("intra_node", "p2p_gbps"), 0), (("inter_node", "collective_gbps"), math.nan),
              (("intra_node", "p2p_latency_us"), -1), (("inter_node", "collective_latency_us"), "fast")]


@pytest.mark.parametrize("path,value", BAD_VALUES, ids=lambda v: ".".join(v) if isinstance(v, tuple) else repr(v))
def test_a_non_positive_or_non_numeric_value_is_one_line_naming_it(path, value):
    message = refused(edit(path, value), "must be a positive|must be a non-negative")
    assert ".".join(path) in message and repr(value) in message


def test_a_zero_latency_and_a_zero_runtime_are_allowed():
    doc = edit(("intra_node", "p2p_latency_us"), 0)
    doc["device"]["runtime_gb"] = 0
    p = profile_from_dict(doc)
    assert p.intra_node.p2p_latency_us == 0 and p.device.runtime_gb == 0


def test_unknown_fields_precisions_and_kinds_are_refused():
    refused(edit(("gpus",), 8), "unknown field 'gpus': the fields are name, source")
    refused(edit(("device", "tflops", "fp8"), 2000), "precision 'fp8': choose among fp32, fp16, bf16")
    refused(edit(("device", "tflops"), {"bf16": 900}), "needs an fp32 rate")
    refused(edit(("device", "tflops"), {}), "device.tflops must map precisions")
    refused(edit(("device", "tflops"), 60), "device.tflops must map precisions")
    refused(edit(("device", "kind"), "tpu"), "device.kind is 'tpu': choose cpu or cuda")
    refused(edit(("source",), "guess"), "source is 'guess': choose one of measured, specification, default")
    refused(edit(("intra_node",), 5), "'intra_node' must be a mapping, not int")


def test_a_cpu_device_needs_its_cores():
    doc = cpu_doc()
    del doc["device"]["cores"]
    refused(doc, "a cpu device needs device.cores")
    doc["device"]["cores"] = 0
    refused(doc, r"device.cores is 0: it must be a positive integer")
    doc["device"]["cores"] = 2.5
    refused(doc, r"device.cores is 2.5: it must be a positive integer")


@pytest.mark.parametrize("doc", [[1, 2], "h100", 8, None], ids=repr)
def test_a_document_that_is_not_a_mapping_is_refused(doc):
    refused(doc, "a cluster profile is a mapping of fields")


def read_refused(path, match: str) -> None:
    with pytest.raises(ClusterError, match=match) as e:
        read_profile(path)
    assert "\n" not in str(e.value)


def test_files_the_reader_refuses(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"nodes": 1,')
    read_refused(bad, "bad.json: not valid JSON")
    bad.write_text(json.dumps(gpu_doc()).replace('"memory_gb": 80', '"memory_gb": NaN'))
    read_refused(bad, r"device.memory_gb is nan")
    bad.write_text("[1, 2]")
    read_refused(bad, "a mapping of fields, not list")
    bad.write_text(" " * (1 << 20) + "{}")
    read_refused(bad, "bytes is more than a config holds")
    read_refused(tmp_path / "absent.json", "no such file .shipped profiles: .*h100-sxm")
    broken = tmp_path / "bad.yaml"
    broken.write_text("nodes: [1\ndevices_per_node: 4\n")
    read_refused(broken, "bad.yaml: not valid YAML")


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_a_yaml_profile_reads_as_its_json(tmp_path, suffix):
    (tmp_path / "c.json").write_text(json.dumps(gpu_doc()))
    (tmp_path / f"c{suffix}").write_text(yaml.safe_dump(gpu_doc(), sort_keys=False))  # tflops keep the file's order
    assert read_profile(tmp_path / f"c{suffix}") == read_profile(tmp_path / "c.json") == profile_from_dict(gpu_doc())


# --- round trip -------------------------------------------------------------------------------------

@pytest.mark.parametrize("doc", [gpu_doc(), cpu_doc()], ids=["cuda", "cpu"])
def test_profile_to_dict_reads_back_to_the_same_profile(doc, tmp_path):
    p = profile_from_dict(copy.deepcopy(doc))
    assert profile_from_dict(profile_to_dict(p)) == p
    assert profile_to_dict(p) == doc  # every field written, none added
    assert read_profile(write_profile(p, tmp_path / "p.json")) == p
    assert os.listdir(tmp_path) == ["p.json"]  # the temporary file renamed, none left behind


def test_shipped_profiles_round_trip():
    for name in SHIPPED:
        p = read_profile(name)
        assert profile_from_dict(profile_to_dict(p)) == p


def test_a_profile_that_cannot_be_written_is_one_line(tmp_path):
    p = profile_from_dict(cpu_doc())
    for where, words in ((tmp_path, "is a directory"), (Path("/proc/self/p.json"), "cannot write it"),
                         (tmp_path / "a-file" / "p.json", "cannot write it")):
        (tmp_path / "a-file").write_text("")
        with pytest.raises(ConfigError, match=words) as e:
            write_profile(p, where)
        assert "\n" not in str(e.value) and str(where) in str(e.value)
    assert os.listdir(tmp_path) == ["a-file"]  # nothing half-written left, here or beside the directory
    assert not list(tmp_path.parent.glob(f".{tmp_path.name}.*"))
    made = write_profile(p, tmp_path / "new-dir" / "p.json")  # a missing folder is made
    assert read_profile(made) == p


# --- placement and a rank's share -----------------------------------------------------------------

def place(tp: int, dp: int, pp: int, per_node: int = 4):
    return ClusterProfile("t", "specification", 8, per_node, profile_from_dict(gpu_doc()).device, Link(**INTRA),
                          Link(**INTER)).placement(tp, dp, pp)


def test_tp_stays_in_a_node_and_dp_leaves_it_past_the_node():
    intra, inter = Link(**INTRA), Link(**INTER)
    assert place(2, 2, 2).tp_link == intra and place(2, 2, 2).dp_link == intra  # tp x dp = 4 = the node
    assert place(4, 2, 1).tp_link == intra and place(4, 2, 1).dp_link == inter  # 8 > 4: dp crosses
    assert place(1, 8, 1).dp_link == inter and place(8, 1, 1).tp_link == inter
    assert place(2, 1, 1).ranks_per_node == 2 and place(2, 2, 4).ranks_per_node == 4


def test_pipeline_hops_cross_nodes_at_the_node_boundaries():
    intra, inter = Link(**INTRA), Link(**INTER)
    # tp=2, dp=1, pp=4 on nodes of 4: pipeline ranks on devices (0,1) (2,3) | (4,5) (6,7)
    hops = [(r, (r + 1) % 4) for r in range(4)]  # interleaved chunks: 3 -> 0 wraps
    assert [place(2, 1, 4).hop_link(*h) for h in hops] == [intra, inter, intra, inter]
    # a V (ranks 0 1 2 3 3 2 1 0): the turn at rank 3 is no message; 3 -> 2 inside node 1, 2 -> 1 crosses back
    assert [place(2, 1, 4).hop_link(3, 2), place(2, 1, 4).hop_link(2, 1)] == [intra, inter]
    # tp=2, dp=2, pp=2: one stage per node
    assert [place(2, 2, 2).hop_link(*h) for h in ((0, 1), (1, 0))] == [inter, inter]
    # tp=1, dp=1, pp=3: all on node 0, the wrap too
    assert [place(1, 1, 3).hop_link(r, (r + 1) % 3) for r in range(3)] == [intra, intra, intra]
    # the rule: hop r -> r + 1 crosses exactly where tp x dp x (r + 1) is a multiple of the node's devices
    for tp, dp, pp, g in [(1, 1, 8, 4), (1, 2, 4, 4), (2, 1, 8, 8), (1, 1, 6, 2), (2, 2, 4, 8)]:
        for r in range(pp):
            crosses = tp * dp * (r + 1) % g == 0
            assert place(tp, dp, pp, g).hop_link(r, (r + 1) % pp) == (inter if crosses else intra), (tp, dp, pp, g, r)


def test_a_cpu_rank_gets_its_share_of_the_cores():
    p = profile_from_dict(cpu_doc())  # 2 cores at 0.08 TFLOP/s each
    assert p.rank_tflops("fp32", 4) == pytest.approx(0.04)  # 4 ranks on 2 cores: half a core each
    assert p.rank_tflops("fp32", 2) == pytest.approx(0.08)  # one core each
    assert p.rank_tflops("fp32", 1) == pytest.approx(0.16)  # both cores
    assert p.rank_tflops("fp32", 1, threads=1) == pytest.approx(0.08)
    assert p.rank_memory_bytes(4) == 8_000_000_000
    assert "per core" in p.describe()
    gpu = profile_from_dict(gpu_doc())
    assert gpu.rank_tflops("bf16", 4) == 900 and gpu.rank_memory_bytes(4) == 80_000_000_000
    assert gpu.device.peak("bf16") == 989 and gpu.device.rate("bf16") == 900


# --- the measured profile -------------------------------------------------------------------------

def test_block_products_are_the_blocks_gemms():
    assert block_products(128, 512, 1024) == [(1024, 128, 384), (1024, 128, 128), (1024, 128, 512), (1024, 512, 128)]


@pytest.mark.parametrize("ranks", [2, 4])
def test_fit_link_passes_through_both_measured_sizes(ranks):
    truth = Link(p2p_gbps=2.0, p2p_latency_us=100.0, collective_gbps=0.5, collective_latency_us=300.0)
    sizes = (4, 4 << 20)
    link = fit_link(tuple(truth.p2p_s(n) for n in sizes), tuple(truth.allreduce_s(n, ranks) for n in sizes),
                    sizes, ranks)
    for f in ("p2p_gbps", "p2p_latency_us", "collective_gbps", "collective_latency_us"):
        assert getattr(link, f) == pytest.approx(getattr(truth, f)), f


def test_fit_link_keeps_its_figures_positive_when_the_small_size_took_longer():
    link = fit_link((2e-3, 1e-3), (3e-3, 2e-3), (4, 4 << 20), 2)
    assert link.p2p_gbps == pytest.approx((4 << 20) / 1e-3 / 1e9) and link.p2p_latency_us == pytest.approx(2000)
    assert link.collective_gbps > 0 and link.collective_latency_us == pytest.approx(1500)


@pytest.mark.parametrize("kwargs,match", [({"ranks": 1}, "ranks is 1: it must be an integer of at least 2"),
                                          ({"precisions": ["fp8"]}, "precision 'fp8': choose among"),
                                          ({"micro_batch": 0}, "micro_batch is 0"),
                                          ({"seq_len": True}, "seq_len is True")])
def test_measure_profile_refuses_bad_arguments_before_measuring(kwargs, match):
    with pytest.raises(ClusterError, match=match):
        measure_profile("gpt-tiny", **kwargs)


@pytest.mark.timeout(120)
def test_measure_profile_gives_a_readable_profile_of_this_machine(tmp_path):
    p = measure_profile("gpt-tiny", ranks=2, precisions=("bf16",))
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    assert (p.source, p.device.kind, p.nodes, p.name) == ("measured", kind, 1, f"{socket.gethostname()}-{kind}")
    assert dict(p.device.tflops).keys() == {"fp32", "bf16"}  # fp32 always: every profile needs it
    assert dict(p.device.peak_tflops).keys() == {"fp32", "bf16"}  # the matrix products' rate beside it
    assert all(t > 0 for _, t in p.device.tflops + p.device.peak_tflops)
    assert p.device.mem_gbps > 0 and p.device.runtime_gb > 0
    assert p.device.layer_overhead_us > 0 and p.device.comm_gb >= 0  # a fixed cost per layer; the group's growth
    assert p.device.step_overhead_us == 0  # fitted to runs only when calibrated (tests/test_calibrate.py)
    if kind == "cpu" and p.device.cores > 1:
        assert p.device.thread_speedup == 0 or 1 <= p.device.thread_speedup <= p.device.cores
    assert "sustained rate in the cost model's FLOPs of gpt-tiny's block and LM head" in p.note
    assert p.device.memory_gb > 0
    if kind == "cpu":
        assert p.devices_per_node == 2 and p.device.cores == len(os.sched_getaffinity(0))
    link = p.intra_node
    assert link.p2p_gbps > 0 and link.collective_gbps > 0 and link.p2p_latency_us >= 0
    assert link.collective_latency_us >= 0 and p.inter_node == link and "one node" in p.note
    assert "measured" in p.describe()
    assert read_profile(write_profile(p, tmp_path / "here.json")) == p


# --- the compute rates ----------------------------------------------------------------------------

def ends_flops(shape, b: int, s: int) -> float:
    """The cost model's forward + backward FLOPs of one block and of the layers after the last."""
    flops = [c.flops_fwd + c.flops_bwd for c in layer_costs(shape, b, s)]
    return flops[1] + sum(flops[1 + shape.num_layers:])


def test_timed_tokens_keeps_the_models_shapes_within_the_budget_and_cuts_the_micro_batch_first():
    shape = model_shape("gpt-small-cpu")
    assert timed_tokens(shape, 8, 128, "fp32", 1e3, 1.0) == (8, 128)  # a fast device: the model's own
    # a budget that just holds 2 x 128 at SUSTAINED_SHARE of the peak: 8 -> 4 -> 2
    budget = SUSTAINED_PASSES * ends_flops(shape, 2, 128) / (SUSTAINED_SHARE * 0.05e12) * 1.01
    assert timed_tokens(shape, 8, 128, "fp32", 0.05, budget) == (2, 128)
    # a budget under one sequence: the micro-batch to 1, then the sequence halved
    budget = SUSTAINED_PASSES * ends_flops(shape, 1, 32) / (SUSTAINED_SHARE * 0.05e12) * 1.01
    assert timed_tokens(shape, 8, 128, "fp32", 0.05, budget) == (1, 32)
    assert timed_tokens(shape, 8, 128, "bf16", 1e-9, 1.0) == (1, PROBE_ROWS)  # never under PROBE_ROWS
    assert timed_tokens(shape, 4, 8, "bf16", 1e-9, 1.0) == (1, 8)  # a sequence already shorter stays


def test_model_ends_draws_only_the_layers_timed():
    shape = model_shape("gpt-tiny")
    ends = model_ends("gpt-tiny", shape, torch.device("cpu"))
    real = {name: not any(p.is_meta for p in ends.layers[name].parameters()) for name in ends.layers.names}
    assert real == {"embed": True, "h.0": True, "h.1": False, "h.2": False, "h.3": False, "ln_f": True,
                    "lm_head": True}
    assert ends.layers["lm_head"].weight is ends.layers["embed"].wte.weight  # the tie kept
    inputs, labels = ends.make_batch(2, 8)
    assert inputs.shape == labels.shape == (2, 8)


def test_model_ends_is_none_for_a_model_model_zoo_does_not_build(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 300, "hidden_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "intermediate_size": 96, "max_position_embeddings": 64}))
    shape = model_shape(str(config))
    assert model_ends(str(config), shape, torch.device("cpu")) is None
    tflops, peak, how, overhead, speedup = device_rates(str(config), shape, 2, 16, ("fp32",), torch.device("cpu"), 2)
    assert tflops == peak and peak["fp32"] > 0  # the matrix products' rate, said so
    assert "the block's matrix products only (model_zoo does not build" in how and overhead == 0.0 and speedup == 1


def test_synced_layer_seconds_times_every_layer_and_leaves_no_gradients():
    shape = model_shape("gpt-tiny")
    ends = model_ends("gpt-tiny", shape, torch.device("cpu"))
    inputs, labels = ends.make_batch(2, 16)
    with torch.no_grad():
        x = ends.layers["embed"](inputs)
    timed = LayerList([(n, ends.layers[n]) for n in ("h.0", "ln_f", "lm_head")])
    times = synced_layer_seconds(timed, x, ends.loss, labels, torch.device("cpu"), repeats=2)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert all(p.grad is None for p in timed.parameters())


def test_sustained_rates_of_a_zoo_model_and_the_sequence_its_positions_allow():
    shape = model_shape("bert-tiny")  # 64 positions: a longer sequence is timed at 64
    tflops, peak, how, overhead, speedup = device_rates("bert-tiny", shape, 2, 128, ("fp32",), torch.device("cpu"), 2)
    assert tflops.keys() == peak.keys() == {"fp32"} and tflops["fp32"] > 0 and peak["fp32"] > 0
    assert "for 2 x 64 tokens" in how and "peak_tflops: the block's four matrix products" in how
    assert math.isfinite(overhead) and overhead > 0 and "layer_overhead_us: the intercept of a block's" in how
    assert 1 <= speedup <= 2 and ("thread_speedup" in how) == (speedup != 1)
    gpt = model_shape("gpt-tiny")
    rate = sustained_tflops(model_ends("gpt-tiny", gpt, torch.device("cpu")), gpt, 1, 16, "bf16", torch.device("cpu"))
    assert math.isfinite(rate) and rate > 0


def test_a_layer_overhead_is_read_written_and_planned(tmp_path):
    """The profile's fixed cost per layer: optional (0), non-negative, round-tripped, and added to every
    layer of a FLOP-timed plan, a third to its forward and two thirds to its backward."""
    doc = gpu_doc()
    assert profile_from_dict(doc).device.layer_overhead_us == 0.0
    doc["device"]["layer_overhead_us"] = -1
    with pytest.raises(ClusterError, match="layer_overhead_us is -1"):
        profile_from_dict(doc)
    doc["device"]["layer_overhead_us"] = 300.0
    p = profile_from_dict(doc)
    assert profile_from_dict(profile_to_dict(p)) == p
    req = PlanRequest(model="gpt-tiny", pp=1, micro_batch=2, microbatches=4, seq_len=16, method="flops", load=False,
                      cluster=p)
    with_cost = make_plan(req)
    free = make_plan(replace(req, cluster=profile_from_dict({**doc, "device": {**doc["device"],
                                                                              "layer_overhead_us": 0}})))
    layers = len(with_cost.layers)
    # one stage, 4 micro-batches one after another: each runs every layer's fixed cost once
    assert with_cost.step_time_ms - free.step_time_ms == pytest.approx(4 * layers * 0.3, rel=1e-9)


def test_a_communicating_rank_holds_the_profiles_comm_bytes():
    """comm_gb: on every stage of a plan whose world is over one rank (through the CUDA allocator's factor,
    as the other bytes a rank holds: the planner counts it in the stage's fixed part), none at one rank."""
    doc = gpu_doc()
    plain = profile_from_dict(doc)
    doc["device"]["comm_gb"] = 0.25
    comm = profile_from_dict(doc)
    assert profile_from_dict(profile_to_dict(comm)) == comm
    grown = 0.25e9 * (1 + CUDA_ALLOCATOR_OVERHEAD)
    for pp, dp, extra in ((1, 1, 0), (2, 1, grown), (1, 2, grown)):
        req = PlanRequest(model="gpt-tiny", pp=pp, dp=dp, micro_batch=2, microbatches=4, seq_len=16, method="flops",
                          load=False, cluster=plain)
        base, more = make_plan(req), make_plan(replace(req, cluster=comm))
        assert [m - b for m, b in zip(more.rank_bytes, base.rank_bytes)] == [pytest.approx(extra)] * pp


def test_every_rank_holds_the_profiles_heap_bytes():
    """heap_gb: on every rank of every plan, one rank or several, beside comm_gb (through the CUDA
    allocator's factor, as the other bytes a rank holds)."""
    doc = gpu_doc()
    doc["device"]["comm_gb"] = 0.25
    plain = profile_from_dict(doc)
    doc["device"]["heap_gb"] = 0.125
    heap = profile_from_dict(doc)
    assert profile_from_dict(profile_to_dict(heap)) == heap and heap.device.heap_gb == 0.125
    for pp, dp in ((1, 1), (2, 1), (1, 2)):
        req = PlanRequest(model="gpt-tiny", pp=pp, dp=dp, micro_batch=2, microbatches=4, seq_len=16, method="flops",
                          load=False, cluster=plain)
        base, more = make_plan(req), make_plan(replace(req, cluster=heap))
        assert [m - b for m, b in zip(more.rank_bytes, base.rank_bytes)] == [
            pytest.approx(0.125e9 * (1 + CUDA_ALLOCATOR_OVERHEAD))] * pp


def test_a_thread_speedup_sets_what_more_threads_give_a_cpu_rank():
    doc = cpu_doc()  # 2 cores at 0.08 TFLOP/s each
    doc["device"]["thread_speedup"] = 1.5
    p = profile_from_dict(doc)
    assert profile_from_dict(profile_to_dict(p)) == p
    assert p.rank_tflops("fp32", 1) == pytest.approx(0.12)  # one rank, two threads: 1.5 cores' worth
    assert p.rank_tflops("fp32", 2) == pytest.approx(0.08)
    assert p.rank_tflops("fp32", 1, threads=1) == pytest.approx(0.08)
    for bad in (0.5, 2.5):
        doc["device"]["thread_speedup"] = bad
        refused(doc, f"thread_speedup is {bad:g}: it is between 1 and device.cores")


def test_a_step_overhead_is_added_to_every_step_of_several_ranks():
    doc = gpu_doc()
    plain = profile_from_dict(doc)
    doc["device"]["step_overhead_us"] = 5000.0
    more = profile_from_dict(doc)
    assert profile_from_dict(profile_to_dict(more)) == more
    for pp, dp, extra in ((1, 1, 0.0), (2, 1, 5.0), (1, 2, 5.0)):
        req = PlanRequest(model="gpt-tiny", pp=pp, dp=dp, micro_batch=2, microbatches=4, seq_len=16, method="flops",
                          load=False, cluster=plain)
        assert make_plan(replace(req, cluster=more)).step_time_ms - make_plan(req).step_time_ms == pytest.approx(extra)


def test_tensor_parallel_all_reduces_of_the_blocks_and_the_ends_are_planned():
    """tp 2, one stage, 2 micro-batches of gpt-tiny (4 blocks): per micro-batch 4 x 4 block all-reduces, the
    vocab-parallel embedding's 1, the cross-entropy's 2 and the LM head's input gradient's 1; a ring
    all-reduce over 2 ranks has 2 latency steps: 2 x 20 x 2 latencies in the step."""
    doc = gpu_doc()
    req = PlanRequest(model="gpt-tiny", pp=1, tp=2, micro_batch=2, microbatches=2, seq_len=16, method="flops",
                      load=False, cluster=profile_from_dict(doc))
    base = make_plan(req)
    doc["intra_node"]["collective_latency_us"] += 1000
    slower = make_plan(replace(req, cluster=profile_from_dict(doc)))
    assert slower.step_time_ms - base.step_time_ms == pytest.approx(2 * 20 * 2 * 1.0)


def test_ranks_beyond_the_cores_stretch_their_compute_by_the_cores_demand():
    """4 ranks on 2 cores: each computes at a whole core and the plan stretches compute by the mean demand
    (the ranks over the cores times the share of the step they compute), between none and the full 2x."""
    def plan(cores: int):
        doc = cpu_doc()
        doc["device"]["cores"] = cores
        return make_plan(PlanRequest(model="gpt-tiny", pp=4, micro_batch=2, microbatches=4, seq_len=16,
                                     method="flops", load=False, cluster=profile_from_dict(doc)))
    alone, shared = plan(4), plan(2)
    assert shared.rates.contention == 2 and alone.rates.contention == 1
    assert alone.step_time_ms < shared.step_time_ms < 2 * alone.step_time_ms
    # the fixed point: the stretch is the demand of the stretched timeline
    tl = shared.timeline
    demand = 2 * sum(tl.busy) / (tl.num_ranks * tl.step_time)
    stretch = sum(tl.busy) / sum(alone.timeline.busy)
    assert stretch == pytest.approx(max(1.0, demand), rel=2e-3)
