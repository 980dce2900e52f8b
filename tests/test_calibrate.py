"""A profile calibrated in its runs' pattern (`mp_toolkit.partition.calibrate`, ``mpt plan
--profile-here OUT --calibrate``): four short ``mpt train`` runs of gpt-tiny fit the step's closing
collectives and the tensor-parallel all-reduce latency, a fifth (a memory run) the heap a rank holds
beyond its tensors. Checked for what the fit guarantees, not for a timing: the fitted latency never
under the isolated one, the step term non-negative and planned on worlds of several ranks only, the
heap term non-negative and on every rank's memory, nothing else changed, and the note saying what was
fitted."""
import math
from dataclasses import replace

import pytest

from mp_toolkit.partition.calibrate import calibrate
from mp_toolkit.partition.cluster import profile_from_dict
from mp_toolkit.partition.planner import PlanRequest, make_plan
from tests.cli_helpers import assert_one_line_exit_2

PROFILE = {"name": "here", "source": "measured", "nodes": 1, "devices_per_node": 2,
           "device": {"kind": "cpu", "name": "cpu", "memory_gb": 16, "tflops": {"fp32": 0.02}, "mem_gbps": 10,
                      "runtime_gb": 0.25, "cores": 2, "layer_overhead_us": 500},
           "intra_node": {"p2p_gbps": 2, "p2p_latency_us": 150, "collective_gbps": 1, "collective_latency_us": 200},
           "inter_node": {"p2p_gbps": 2, "p2p_latency_us": 150, "collective_gbps": 1, "collective_latency_us": 200}}


@pytest.mark.timeout(300)  # four mpt train runs of 2 ranks and a memory run of one, a few seconds each
def test_four_short_runs_fit_the_step_and_the_all_reduce_terms():
    base = profile_from_dict(PROFILE)
    fitted, said = calibrate(base, "gpt-tiny", 2, 16)
    d, link = fitted.device, fitted.intra_node
    assert "step_overhead_us: pp 2 runs of gpt-tiny" in said and "collective_latency_us: a tp 2 run" in said
    assert "heap_gb: a one-rank memory run of gpt-tiny" in said
    assert math.isfinite(d.step_overhead_us) and d.step_overhead_us >= 0
    assert math.isfinite(d.heap_gb) and 0 <= d.heap_gb < 0.1  # a few MB at most for gpt-tiny
    assert link.collective_latency_us >= 200 and fitted.inter_node == link
    assert replace(fitted, device=replace(d, step_overhead_us=0.0, heap_gb=0.0), intra_node=base.intra_node,
                   inter_node=base.inter_node) == base  # nothing else changed
    req = PlanRequest(model="gpt-tiny", pp=1, micro_batch=2, microbatches=2, seq_len=16, method="flops",
                      load=False, cluster=fitted)
    assert make_plan(req).step_time_ms == make_plan(replace(req, cluster=base)).step_time_ms  # one rank: no term
    two = replace(req, pp=2)
    gap = make_plan(two).step_time_ms - make_plan(replace(two, cluster=replace(
        fitted, device=replace(d, step_overhead_us=0.0)))).step_time_ms
    assert gap == pytest.approx(d.step_overhead_us / 1e3)
    for r in (req, two):  # the heap term: on every rank, one rank or several
        without = make_plan(replace(r, cluster=replace(fitted, device=replace(d, heap_gb=0.0))))
        held = [a - b for a, b in zip(make_plan(r).rank_bytes, without.rank_bytes)]
        assert held == [int(d.heap_gb * 1e9)] * r.pp


def test_a_model_the_runs_cannot_train_leaves_the_profile_as_measured():
    base = profile_from_dict(PROFILE)
    # a sequence past gpt-tiny's 64 positions: the planner refuses the first run's layout in one line
    fitted, said = calibrate(base, "gpt-tiny", 2, 100000)
    assert fitted == base and said.startswith("not calibrated (pp 2 runs of gpt-tiny:")


def test_calibrate_without_profile_here_is_one_line(capsys):
    assert_one_line_exit_2(capsys, ["plan", "--model", "gpt-tiny", "--calibrate"], "--profile-here")
