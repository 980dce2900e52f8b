"""`python -m tools.certify_plan`: Kendall's tau-b and the other figures on known values, the layout
sample (deterministic, every value of every dimension covered, the schedule sweep in it), and a
four-layout smoke run whose JSON line has every figure, finite and in range, and one row per layout.
No timing is asserted: benchmarks are programs, not timed tests."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mp_toolkit.partition.cluster import profile_from_dict, read_profile, shipped_profile
from tools.certify_plan import MODELS, PIPELINE_SCHEDULES, Checker, Layout, select, space
from tools.certify_rescore import rescored
from tools.certify_stats import DIMENSIONS, kendall_tau_b, mape, pair_counts, regret, summarize

ROOT = Path(__file__).resolve().parent.parent


def test_kendall_tau_b_counts_ties_as_tau_b_does():
    assert kendall_tau_b([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)  # 5 concordant, 1 discordant
    assert kendall_tau_b([1, 2, 3], [3, 2, 1]) == -1.0
    # pairs: one tied in x only, one in y only, four concordant: 4 / sqrt((4 + 1) (4 + 1))
    assert pair_counts([1, 1, 2, 3], [1, 2, 2, 3]) == (4, 0, 1, 1, 0)
    assert kendall_tau_b([1, 1, 2, 3], [1, 2, 2, 3]) == pytest.approx(0.8)
    assert kendall_tau_b([5, 5, 5], [1, 2, 3]) is None  # no untied pair on one side
    assert kendall_tau_b([1], [1]) is None


def test_mape_and_regret_on_known_values():
    assert mape([90, 220], [100, 200]) == pytest.approx(0.1)
    # the planner picks index 1 (predicted 5, the first of the tie), measured 12 against the best 10
    assert regret([7, 5, 5], [10, 12, 11]) == pytest.approx(0.2)
    assert regret([1, 2], [10, 12]) == 0.0


def test_space_holds_the_issues_dimensions():
    layouts = space(list(MODELS), 4)
    assert {(x.pp, x.tp, x.dp) for x in layouts} == {(1, 1, 1), (1, 1, 2), (1, 2, 1), (1, 2, 2), (2, 1, 1),
                                                     (2, 1, 2), (2, 2, 1), (4, 1, 1)}
    assert {x.schedule for x in layouts if x.pp == 1} == {"1f1b"}
    assert {(x.schedule, x.chunks) for x in layouts if x.pp > 1} == set(PIPELINE_SCHEDULES)
    assert {x.zero for x in layouts if x.dp == 1} == {0} and {x.zero for x in layouts if x.dp == 2} == {0, 1}
    assert len(layouts) == len(set(layouts)) and max(x.world for x in space(list(MODELS), 2)) == 2


def test_the_sample_is_deterministic_covers_every_value_and_holds_the_sweep():
    checker = Checker(dict.fromkeys(MODELS, shipped_profile("h100-sxm")))  # feasibility does not depend on the device
    candidates = space(list(MODELS), 4)
    usable = lambda x: checker.plan(x) is not None  # noqa: E731
    chosen = select(candidates, 40, 0, usable)
    assert len(chosen) == 40 == len(set(chosen)) and chosen == select(candidates, 40, 0, usable)
    assert all(checker.plan(x) is not None for x in chosen)
    for dim in DIMENSIONS:
        assert {getattr(x, dim) for x in chosen} == {getattr(x, dim) for x in candidates}, dim
    sweep = {Layout(m, 2, 1, 1, 4, s, c, "none", 0) for s, c in PIPELINE_SCHEDULES for m in MODELS}
    assert sweep <= set(chosen)
    assert checker.plan(Layout("gpt-tiny", 4, 1, 1, 4, "interleaved", 2, "none", 0)) is None  # 8 stages, 7 layers
    assert [why for why in checker.refused if why.startswith("planner: --pp 4 x --chunks 2 = 8 stages")]
    assert select(candidates, 40, 1, usable) != chosen


@pytest.mark.timeout(240)  # ~8 mpt train runs of 1-2 ranks: a minute on 2 quiet cores, more under load
def test_a_four_layout_run_reports_every_figure(tmp_path):
    profile = {"name": "here", "source": "measured", "nodes": 1, "devices_per_node": 2,
               "device": {"kind": "cpu", "name": "cpu", "memory_gb": 16, "tflops": {"fp32": 0.05}, "mem_gbps": 10,
                          "runtime_gb": 0.25, "cores": os.cpu_count() or 1},
               "intra_node": {"p2p_gbps": 2, "p2p_latency_us": 150, "collective_gbps": 1, "collective_latency_us": 200},
               "inter_node": {"p2p_gbps": 2, "p2p_latency_us": 150, "collective_gbps": 1, "collective_latency_us": 200}}
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    out = tmp_path / "cert.json"
    done = subprocess.run([sys.executable, "-m", "tools.certify_plan", "--quick", "--steps", "3",
                           "--profile", str(tmp_path / "profile.json"), "--save-profile", str(tmp_path / "again.json"),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    assert read_profile(tmp_path / "again.json") == read_profile(tmp_path / "profile.json")
    assert "profile: here (measured)" in done.stdout and {"cpu", "nproc", "load_avg"} <= set(line["machine"])

    rows, s = line["rows"], line["summary"]
    assert line["failed"] == {} and len(rows) == 4 == s["layouts"] == len({r["label"] for r in rows})
    assert {r["model"] for r in rows} == {"gpt-tiny", "bert-tiny"} and all(r["world"] <= 2 for r in rows)
    for r in rows:
        assert len(r["round_step_ms"]) == 1 and r["meas_step_ms"] > 0 and r["pred_step_ms"] > 0
        assert len(r["meas_rank_bytes"]) == len(r["pred_rank_bytes"]) == r["world"]
        assert r["pred_device_bytes"] == r["pred_peak_bytes"] + 250_000_000  # tensor bytes + the runtime
        assert r["train_planned_bytes"] == r["pred_rank_bytes"]  # the run planned what is compared
    finite = ("step_mape", "step_bias", "mem_mape", "mem_mape_ranks", "mem_bias", "tau_pooled", "tau_groups",
              "regret_max", "regret_median", "baseline_bound_bytes")
    for key in finite:
        assert isinstance(s[key], (int, float)) and math.isfinite(s[key]), key
    # one round: nothing to compare across rounds; one timed step (--steps 3, two warm-up steps): no spread
    assert s["noise_rounds"] is None and s["noise_steps"] is None
    assert -1 <= s["tau_groups"] <= 1 and -1 <= s["tau_pooled"] <= 1 and s["regret_max"] >= 0
    assert s["groups_ranked"] == 2 and sum(g["n"] for g in s["groups"]) == 4
    assert 0 <= s["false_fits"] <= s["predicted_fits"] <= 4 and s["cap_bytes"] > 0
    assert set(s["by"]) == set(DIMENSIONS) and s["by"]["schedule"]["1f1b"]["n"] == 2
    # re-scored under the run's own profile (tools.certify_rescore): the same predictions, the same figures
    same = summarize(rescored(line, read_profile(tmp_path / "again.json")), 250_000_000, s["cap_bytes"])
    assert {k: same[k] for k in finite} == {k: s[k] for k in finite}
    faster = dict(profile, device={**profile["device"], "tflops": {"fp32": 0.5}})
    again = rescored(line, profile_from_dict(faster))
    assert all(a["pred_step_ms"] < r["pred_step_ms"] for a, r in zip(again, rows))  # a faster device: less time
