"""The planner's recomputation (`mp_toolkit.partition.recompute`): its joint choice of cut and
per-stage recomputation against brute force over every cut and every choice on small random
instances, and `mpt plan` / `mpt train --recompute auto` applying it; ``--schedule auto``."""

import dataclasses
import itertools
import json
import random
import re

import pytest

from mp_toolkit.names import stages_per_rank
from mp_toolkit.partition import PartitionError
from mp_toolkit.partition.auto_schedule import CANDIDATES, DEFAULT_CANDIDATES, fastest_schedule
from mp_toolkit.partition.memory import MemoryCapError, StageMemory
from mp_toolkit.partition.planner import PlanRequest, make_plan
from mp_toolkit.partition.recompute import RecomputeCosts, min_max_recompute, stage_options
from mp_toolkit.recompute import StageRecompute
from mp_toolkit.run.checks import validate
from mp_toolkit.run.config import TrainConfig
from mp_toolkit.run.recompute_plan import auto_request, default_candidates, default_schedule, resolve_auto_schedule
from mp_toolkit.schedule import split_share
from tests.mpt_command import run_mpt


def _stage(memory: StageMemory, rc: RecomputeCosts, times, j, a, b, choice: StageRecompute, split):
    """(bytes, time) of one stage, computed from scratch: the layers' kept bytes less what the
    chosen blocks drop, their workspace what they rebuild, their backward longer."""
    blocks = [i for i in range(a, b) if rc.block[i]]
    chosen = blocks[:choice.layers] if choice.mode != "none" else []
    act, ws = list(memory.activation), list(memory.workspace)
    extra = 0
    for i in chosen:
        full = choice.mode == "full"
        act[i] -= rc.full_saved[i] if full else rc.selective_saved[i]
        ws[i] = max(ws[i], rc.full_workspace[i]) if full else ws[i]
        extra += rc.full_s[i] if full else rc.selective_s[i]
    adjusted = dataclasses.replace(memory, activation=act, workspace=ws)
    runs = 1 + (split[j] if split else 0)
    return adjusted(j, a, b), sum(times[a:b]) + round(runs * extra)


def _brute(times, memory, rc, p, cap, options, split):
    """The least bottleneck over every cut and every choice per stage; None when nothing fits."""
    n, best = len(times), None
    for inner in itertools.combinations(range(1, n), p - 1):
        bounds = [0, *inner, n]
        per_stage = []
        for j, (a, b) in enumerate(zip(bounds, bounds[1:])):
            fits = [_stage(memory, rc, times, j, a, b, c, split) for c in options(j, sum(rc.block[a:b]))]
            fits = [t for nbytes, t in fits if nbytes <= cap]
            if not fits:
                break
            per_stage.append(min(fits))  # a stage's fastest fitting choice is its best for the max
        else:
            bottleneck = max(per_stage)
            best = bottleneck if best is None else min(best, bottleneck)
    return best


def _instance(rng: random.Random):
    n = rng.randint(2, 6)
    p = rng.randint(1, min(3, n))
    block = [rng.random() < 0.7 for _ in range(n)]
    act = [rng.randint(10, 100) for _ in range(n)]
    memory = StageMemory(static=[rng.randint(0, 50) for _ in range(n)], activation=act,
                         inflight=[rng.randint(1, 3) for _ in range(p)],
                         workspace=[rng.randint(0, 30) for _ in range(n)], fixed=rng.randint(0, 10),
                         step_transient=[rng.randint(0, 40) for _ in range(n)])
    if rng.random() < 0.5:  # a split schedule: recorded gradients held between I and W (`StageMemory.held`)
        held = [tuple({(a, rng.randint(0, a - 1)) for a in (rng.randint(1, 3) for _ in range(rng.randint(1, 3)))})
                for _ in range(p)]
        memory = dataclasses.replace(memory, recorded=[rng.randint(0, 30) for _ in range(n)], held=held)
    if rng.random() < 0.5:  # several micro-batches: each layer's accumulation temporary (`StageMemory.accumulated`)
        memory = dataclasses.replace(memory, accumulated=[rng.randint(0, 30) for _ in range(n)])
    full_saved = [rng.randint(0, a) if b else 0 for a, b in zip(act, block)]
    sel_saved = [rng.randint(0, s) if b else 0 for s, b in zip(full_saved, block)]
    rc = RecomputeCosts(block, full_saved, [a if b else 0 for a, b in zip(act, block)],
                        [rng.randint(1, 20) if b else 0 for b in block], sel_saved,
                        [rng.randint(0, 5) if b else 0 for b in block])
    times = [rng.randint(1, 60) for _ in range(n)]
    total = sum(memory.static) + 3 * sum(act) + 100
    return times, memory, rc, p, rng.randint(total // 6, total)


@pytest.mark.parametrize("modes", [("full",), ("full", "selective")])
def test_joint_choice_matches_brute_force(modes):
    rng = random.Random(19)
    options = stage_options(modes)
    solved = infeasible = 0
    for _ in range(250):
        times, memory, rc, p, cap = _instance(rng)
        # the rebuilds of a split backward: none, ZB-H1's (every backward past stage 0) or ZB-drain's
        split = rng.choice([(), (), (0, *[1.0] * (p - 1)), tuple(split_share("zbdrain", j, 4) for j in range(p))])
        expected = _brute(times, memory, rc, p, cap, options, split)
        if expected is None:
            with pytest.raises(MemoryCapError):
                min_max_recompute(times, memory, rc, p, cap, options, split)
            infeasible += 1
            continue
        bounds, choices = min_max_recompute(times, memory, rc, p, cap, options, split)
        got = [_stage(memory, rc, times, j, a, b, c, split) for j, (a, b, c) in
               enumerate(zip(bounds, bounds[1:], choices))]
        assert all(nbytes <= cap for nbytes, _ in got), (bounds, choices, cap)
        assert max(t for _, t in got) == expected, (times, bounds, choices)
        solved += 1
    assert solved > 100 and infeasible > 5  # both outcomes exercised


def test_auto_fits_a_cap_none_cannot_and_is_faster_than_full():
    base = dict(model="gpt-small-cpu", pp=2, micro_batch=8, seq_len=128, tflops=0.1, method="memory")
    for cap in (0.08, 0.085):
        with pytest.raises(Exception, match="too small"):
            make_plan(PlanRequest(**base, memory_gb=cap))
        full = make_plan(PlanRequest(**base, memory_gb=cap, recompute="full"))
        auto = make_plan(PlanRequest(**base, memory_gb=cap, recompute="auto"))
        assert all(s.memory_bytes <= cap * 1e9 for s in auto.stages + full.stages)
        assert any(c.mode != "none" for c in auto.recompute)
        assert auto.max_stage_time_ms < full.max_stage_time_ms and auto.step_time_ms < full.step_time_ms
    with pytest.raises(Exception, match="use --memory-gb 0.091 or more"):  # the least cap selective fits
        make_plan(PlanRequest(**base, memory_gb=0.085, recompute="selective"))


def test_mpt_plan_prints_the_choice_per_stage_and_train_applies_the_same():
    out = run_mpt(["plan", "--model", "gpt-small-cpu", "--pp", "2", "--micro-batch", "8", "--seq-len", "128",
                   "--method", "memory", "--memory-gb", "0.08", "--tflops", "1", "--recompute", "auto"], timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if "recomputes:" in line]
    assert len(lines) == 2 and any("full x" in line or "selective x" in line for line in lines)
    train = TrainConfig.of(model="gpt-small-cpu", pp=2, micro_batch=8, seq_len=128, recompute="auto", memory_gb=0.08)
    plan = make_plan(auto_request(train))
    printed = [line.split(": ", 1)[1] for line in lines]
    names = [c.name for c in plan.layers]
    blocks = [sum(n.rsplit(".", 1)[-1].isdigit() for n in names[a:b]) for a, b in zip(plan.boundaries,
                                                                                     plan.boundaries[1:])]
    assert printed == [c.describe(k) for c, k in zip(plan.recompute, blocks)]


def test_auto_needs_a_cap_and_selective_needs_a_family_that_has_it():
    with pytest.raises(Exception, match="--method memory --memory-gb"):
        make_plan(PlanRequest(model="gpt-tiny", pp=2, seq_len=32, method="flops", tflops=1.0, recompute="auto"))
    assert make_plan(PlanRequest(model="bert-tiny", pp=2, seq_len=64, method="flops", tflops=1.0,
                                 recompute="selective")).recompute[0].mode == "selective"


def test_schedule_auto_takes_the_fastest_candidate_that_fits():
    base = PlanRequest(model="gpt-small-cpu", pp=2, micro_batch=8, seq_len=128, tflops=0.1, method="memory",
                       memory_gb=0.09, recompute="auto")
    choice = fastest_schedule(base)
    plans = {}
    for schedule in CANDIDATES:
        try:
            plans[schedule] = make_plan(dataclasses.replace(base, schedule=schedule,
                                                            chunks=2 if schedule == "interleaved" else 1))
        except PartitionError:
            continue
    fitting = {k: p.step_time_ms for k, p in plans.items()
               if all(s.memory_bytes <= 0.09e9 for s in p.stages)}
    assert fitting and choice.plan.request.schedule == min(fitting, key=fitting.get)
    assert choice.plan.step_time_ms == min(fitting.values())
    unbounded = fastest_schedule(dataclasses.replace(base, method="flops", memory_gb=None, recompute="none"))
    assert set(unbounded.considered) == set(CANDIDATES) and all("ms" in v for v in unbounded.considered.values())


def test_train_schedule_auto_resolves_alike_and_says_so():
    cfg = TrainConfig.of(model="gpt-small-cpu", pp=2, micro_batch=8, seq_len=128, schedule="auto")
    first, line = resolve_auto_schedule(cfg)
    again, _ = resolve_auto_schedule(cfg)
    assert first == again and first.parallel.schedule in CANDIDATES and line.startswith("--schedule auto: ")
    assert first.parallel.chunks == stages_per_rank(first.parallel.schedule)


def cpu_profile(tmp_path, tflops: float) -> str:
    """A two-rank CPU profile at ``tflops`` per core, links as gloo on one host."""
    link = {"p2p_gbps": 3, "p2p_latency_us": 150, "collective_gbps": 3, "collective_latency_us": 150}
    doc = {"name": f"cpu at {tflops}", "source": "measured", "nodes": 1, "devices_per_node": 2,
           "device": {"kind": "cpu", "name": "test", "memory_gb": 16, "tflops": {"fp32": tflops}, "mem_gbps": 8,
                      "cores": 2}, "intra_node": link, "inter_node": link}
    path = tmp_path / f"cpu-{tflops}.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("tflops,microbatches,expected,one_per_rank", [
    (0.05, 4, "zbv", "zbdrain"), (0.05, 8, "dualpipev", "zbdrain"), (1.0, 4, "zbv", "zbh1"),
    (1.0, 8, "dualpipev", "zbdrain"), (10.0, 8, "zbv", "zbh1")])
def test_a_run_naming_no_schedule_takes_the_planners_pick_at_its_device_rate(tmp_path, tflops, microbatches,
                                                                             expected, one_per_rank):
    """Issues 23, 36 and 38: without --schedule our engine at pp > 1 runs what the planner predicts fastest of
    1F1B, ZB-drain, ZB-H1, interleaved, ZB-V and DualPipeV on the run's own cut, at its device profile's rate:
    the split's cost and the messages weigh differently against compute at 0.05, 1 and 10 TFLOP/s (at 8
    micro-batches DualPipeV, which splits only its last backwards, at 1; ZB-V at 10). Where the run fixes the
    cut (--partition boundaries) only one stage per rank is weighed: ZB-drain at 1, ZB-H1 at 10. DeepSpeed's
    engine, one stage, or a named schedule keep theirs."""
    cfg = TrainConfig.of(model="gpt-small-cpu", pp=2, micro_batch=8, seq_len=128, microbatches=microbatches,
                         cluster=cpu_profile(tmp_path, tflops))
    picked, line = default_schedule(cfg)
    _, auto_line = resolve_auto_schedule(cfg, candidates=DEFAULT_CANDIDATES)
    times = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) ms", auto_line)}
    assert set(times) == set(DEFAULT_CANDIDATES) and picked.parallel.schedule == min(times, key=times.get)
    assert picked.parallel.schedule == expected and picked.parallel.chunks == stages_per_rank(expected)
    assert "--schedule 1f1b to keep 1F1B" in line
    assert picked.replace(schedule="1f1b", chunks=1) == cfg  # nothing else changes: the cut is --partition's
    bounds = ",".join(map(str, validate(cfg).boundaries))  # 1F1B's cut named: the V schedules cannot take it
    fixed = cfg.replace(partition=bounds)
    assert default_schedule(fixed)[0].parallel.schedule == one_per_rank
    for kept in (cfg.replace(engine="deepspeed"), cfg.replace(pp=1), cfg.replace(schedule="gpipe")):
        assert default_schedule(kept) == (kept, None)


def test_without_memory_gb_the_device_capacity_rules_schedules_out(tmp_path):
    """Issue 36: memory always counts: with no --memory-gb a candidate over the device's capacity is left out."""
    profile = json.loads(open(cpu_profile(tmp_path, 0.05)).read())
    profile["device"]["memory_gb"] = 0.2  # 0.1 GB per rank: gpt-small-cpu's GPipe at 8 micro-batches holds more
    small = tmp_path / "small.json"
    small.write_text(json.dumps(profile))
    cfg = TrainConfig.of(model="gpt-small-cpu", pp=2, micro_batch=8, seq_len=128, microbatches=8, cluster=str(small),
                         schedule="auto")
    _, line = resolve_auto_schedule(cfg)
    assert "left out: over the device's 0.1 GB" in line


def test_a_run_naming_no_schedule_weighs_interleaved_where_the_cut_is_the_planners():
    """bert-base at pp 2 (its heads a light last chunk) gets interleaved x2 by default, re-cut into 4 stages
    by --partition; a run that fixes the cut, counts recomputed layers per stage or names --chunks keeps
    the one-stage-per-rank candidates (the V schedules re-cut too)."""
    cfg = TrainConfig.of(model="bert-base", pp=2, micro_batch=8, seq_len=128, microbatches=8)
    picked, line = default_schedule(cfg)
    times = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) ms", line)}
    assert default_candidates(cfg) == DEFAULT_CANDIDATES and set(times) == set(DEFAULT_CANDIDATES)
    assert (picked.parallel.schedule, picked.parallel.chunks) == ("interleaved", 2)
    assert min(times, key=times.get) == "interleaved"
    # pp x chunks stages over bert-base's 14 layers
    assert validate(picked).boundaries[-1] == 14 and len(validate(picked).boundaries) == 5
    one_per_rank = tuple(c for c in DEFAULT_CANDIDATES if stages_per_rank(c) == 1)
    for fixed in (cfg.replace(partition="0,7,14"), cfg.replace(recompute="full", recompute_layers=(1, 2)),
                  cfg.replace(chunks=3)):
        assert default_candidates(fixed) == one_per_rank
        assert default_schedule(fixed)[0].parallel.schedule in one_per_rank + ("1f1b",)
    assert default_candidates(cfg.replace(recompute="full", recompute_layers=(1,))) == DEFAULT_CANDIDATES


def test_auto_takes_selective_where_it_pays_and_only_the_modes_allowed():
    """With attention dropout (bert-base's 0.1) the attention core keeps three (heads, s, s) tensors,
    and selective is the cheap way under a cap 1% below what fits without recomputation; with full
    alone (an HF model's ``mpt train --recompute auto``), full it is."""
    base = dict(model="bert-base", pp=2, micro_batch=8, seq_len=128, tflops=10.0, method="memory")
    with pytest.raises(PartitionError) as e:
        make_plan(PlanRequest(**base, memory_gb=1e-6))
    cap = 0.99 * e.value.needed_gb
    both = make_plan(PlanRequest(**base, memory_gb=cap, recompute="auto"))
    full = make_plan(PlanRequest(**base, memory_gb=cap, recompute="auto", recompute_modes=("full",)))
    assert {c.mode for c in both.recompute} == {"none", "selective"}
    assert {c.mode for c in full.recompute} == {"none", "full"}
    assert sum(s.time_ms for s in both.stages) < sum(s.time_ms for s in full.stages)
    assert auto_request(TrainConfig.of(hf="some/dir", recompute="auto", memory_gb=1.0)).recompute_modes == ("full",)
