"""The oracle on the whole grid (DESIGN.md invariant 1): pipeline x tensor x data parallel training
equals single-process training of the unsplit model on the same global batch.

Setup (tests/oracle_tp_dp_workers.py): gpt-tiny, fp32, LAMB (lr 1e-2, weight decay 0.01) with
global-norm clipping at 0.4, which binds on every step (the reference's pre-clip norms are 0.46-1.7), 3
steps of a global batch of dp x m micro-batches of 2 x 16 tokens. Data-parallel replica d trains on
micro-batches d*m .. d*m + m - 1; the reference accumulates all dp x m in order, each loss divided by dp
x m. Layouts (pp, tp, dp): (1,2,1), (2,2,1), (1,2,2), (2,1,2); every one runs 1F1B with tied and untied
embeddings and GPipe (tied); (2,1,2) also runs ZB-H1 and interleaved 1F1B. The V schedules (issue 38) at
(2,2,1), ZB-V with selective recomputation and DualPipeV with sequence parallelism, and at (2,1,2), ZB-V
under ZeRO-1 and DualPipeV with full recomputation: their tied embedding is one weight on rank 0.
Sequence parallelism (``sp``) joins every tp layout: 1F1B at (1,2,1) and (2,2,1), GPipe untied with
selective recomputation, ZB-H1 without and with full recomputation, and ZeRO-1 at (1,2,2) (its gradients
live in pieces: the parameters after the steps carry its comparison). The dp > 1 GPipe cases use ~1 KiB
gradient buckets (many all-reduces per stage).

Tolerance (DESIGN.md invariant 10, tests/floor.py): every rank also trains the reference in
float64, and every approximate figure of the parallel run -- each parameter tensor after 3 steps and
each clipped gradient of step 1, gathered to full shape; the per-step mean losses and pre-clip
gradient norms; the trust-ratio row; `eval_batch`'s loss on a held-out global batch -- must lie
within ``floor.K`` times the fp32 single process's own relative error against that float64 run,
measured in the same test on the same kernels. TP splits matmul sums and the softmax, DP sums
micro-batches in another order: both are fp32 roundings of the same computation, as the single
process's are. LAMB magnifies rounding where a gradient is near its eps = 1e-6 (biases), which is
why a fixed 1e-5 held on AVX2 and failed on AVX-512 (1.4e-5): the floor moves with the kernels.
The test prints the worst ratio err / floor over all figures.

Exact, not approximate: data-parallel replicas hold bitwise equal parameters after every step,
and tensor-parallel-replicated parameters (LayerNorms, row-parallel biases, position embedding)
are bitwise equal over the tp ranks after every step.
"""

import time

import pytest
import torch

from mp_toolkit.engine.executor import final_weight_grad_actions
from mp_toolkit.names import V_SCHEDULES, stages_per_rank
from mp_toolkit.parallel.data_parallel import make_buckets
from mp_toolkit.schedule import get_schedule
from tests.dist_harness import run_world
from tests.floor import K, assert_all_within, assert_within
from tests.oracle_tp_dp_workers import CLIP, oracle_grid
from tests.oracle_workers import MIXED_LENGTHS

TINY_BUCKET_MB = 0.001  # ~1 KiB buckets: many all-reduces per stage, checks the flatten / unflatten

# Mixed sequence lengths (tests/oracle_workers.py MIXED_LENGTHS): each replica meets its own lengths in
# its own order. (A pp2-tp2 mixed case passed natively but reached 11x its fp32 floor on one bias under
# ATEN_CPU_CAPABILITY=default, past the 8x bound: not in the grid until that is understood.)
MIXED = {"lengths": MIXED_LENGTHS}
SP = {"sp": True}
LAYOUTS = {  # (pp, tp, dp): cases (schedule, micro-batches per replica, tied, bucket MiB[, run_case's keywords])
    (1, 2, 1): [("1f1b", 3, True, 25.0), ("1f1b", 3, False, 25.0), ("gpipe", 2, True, 25.0),
                ("1f1b", 3, True, 25.0, SP), ("gpipe", 2, False, 25.0, {**SP, "recompute": "selective"})],
    (2, 2, 1): [("1f1b", 3, True, 25.0), ("1f1b", 3, False, 25.0), ("gpipe", 2, True, 25.0),
                ("1f1b", 3, True, 25.0, SP), ("zbh1", 3, True, 25.0, SP),
                ("zbh1", 3, True, 25.0, {**SP, "recompute": "full"}),
                ("zbv", 3, True, 25.0, {"recompute": "selective"}), ("dualpipev", 4, True, 25.0, SP)],
    (1, 2, 2): [("1f1b", 3, True, 25.0), ("1f1b", 3, False, 25.0), ("gpipe", 2, True, TINY_BUCKET_MB),
                ("1f1b", 3, True, 25.0, {**SP, "zero": 1})],
    (2, 1, 2): [("1f1b", 3, True, 25.0), ("1f1b", 3, False, 25.0), ("gpipe", 2, True, TINY_BUCKET_MB),
                ("zbh1", 3, False, 25.0), ("interleaved", 2, True, 25.0), ("zbh1", 3, True, 25.0, MIXED),
                ("zbdrain", 3, True, 25.0), ("zbv", 3, True, 25.0, {"zero": 1}),
                ("dualpipev", 4, False, 25.0, {"recompute": "full"})],
}
UNIQUE_TENSORS = 2 + 4 * 12 + 2  # wte, wpe, 4 blocks of 12, ln_f; +1 for an untied LM head


def _check_case(results, layout, case_index, case, k: float = K) -> float:
    """Assert one case on every rank; returns the worst err / floor ratio of its approximate figures."""
    pp, tp, dp = layout[:3]
    schedule, m, tied, bucket_mb = case[:4]
    options = case[4] if len(case) > 4 else {}
    cases = [r["cases"][case_index] for r in results]
    first = cases[0]
    assert all(n > CLIP for n in first["ref_norms"]), f"clipping must bind: {first['ref_norms']}"
    ratios = []
    for c in cases:  # every rank reports the global batch's mean loss and the one global norm
        ratios.append(assert_within(*c["loss_err"], f"{layout} {case}: losses", k=k))
        ratios.append(assert_within(*c["norm_err"], f"{layout} {case}: pre-clip norms", k=k))
        assert c["losses"] == first["losses"] and c["norms"] == first["norms"]
        eval_loss, eval_err, changed = c["eval"]  # eval_batch: the held-out global batch's mean loss
        ratios.append(assert_within(*eval_err, f"{layout} {case}: eval_batch loss", k=k))
        assert eval_loss == first["eval"][0] and not changed
    for c in cases:  # one trust-ratio row per pipeline rank, the same on every rank
        rows, err = c["trust"]
        assert rows == first["trust"][0] and [row["stage"] for row in rows] == list(range(pp))
        ratios.append(assert_within(*err, f"{layout} {case}: trust ratios (min, median, max)", k=k))
    for c in cases:
        ratios.append(assert_all_within(c["errors"], f"{layout} {case}", k=k))
        if not options.get("zero"):  # under ZeRO-1 the parameters after the steps carry the comparison
            assert c["grad_errors"].keys() == c["errors"].keys()
            ratios.append(assert_all_within(c["grad_errors"], f"{layout} {case}: step-1 gradient", k=k))
        assert all(c["dp_same"]), f"{layout} {case}: data-parallel replicas diverged: {c['dp_same']}"
        assert all(c["tp_same"]), f"{layout} {case}: tp-replicated parameters diverged: {c['tp_same']}"
    # one replica's pipeline ranks cover every tensor of the model; a tie split over ranks is a
    # copy at each end, a tie within one rank (one stage, or a V's first and last) is one tensor (named
    # after the embedding)
    replica0 = [c for r, c in zip(results, cases) if not any(r["coords"][1:])]  # tp, dp (and cp) rank 0
    names = set().union(*(c["errors"] for c in replica0))
    both_ends = not tied or (pp > 1 and schedule not in V_SCHEDULES)
    assert len(names) == UNIQUE_TENSORS + both_ends and ("lm_head.weight" in names) == both_ends, sorted(names)
    if tp > 1:
        sharded = set().union(*(c["sharded"] for c in replica0))
        assert {"embed.wte.weight", "h.0.attn.qkv.weight", "h.3.mlp.fc.bias"} <= sharded
        assert not {"h.0.ln_1.weight", "h.0.attn.proj.bias", "embed.wpe.weight"} & sharded
        assert all(c["ln_checked"] for c in cases)  # LayerNorm weights are among the bitwise-checked
    if dp > 1:
        chunks = stages_per_rank(schedule)
        for r, c in zip(results, cases):
            # every stage's buckets were posted during the schedule, right after its last backward
            # (the later chunk's first under interleaving), before the step waited for them
            final = final_weight_grad_actions(get_schedule(schedule, pp, m, chunks=chunks).rank_actions(r["coords"][0]))
            assert c["dp_calls"] == [final[i] for i in sorted(final)] + ["finish"], c["dp_calls"]
            # gpt-tiny's stages are far below 25 MiB: one bucket each; ~1 KiB buckets: several each. A tied V's
            # last stage is the LM head alone, whose weight is stage 0's (it goes with the stage finishing later)
            own = [s for s in c["stages"] if not (tied and schedule in V_SCHEDULES and s == 2 * pp - 1)]
            if bucket_mb == TINY_BUCKET_MB:
                assert c["dp_buckets"] >= 3 * len(own), c["dp_buckets"]
            else:
                assert c["dp_buckets"] == len(own)
    return max(ratios)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda layout: "pp{}-tp{}-dp{}".format(*layout))
def test_grid_matches_single_process(layout):
    pp, tp, dp = layout
    cases = LAYOUTS[layout]
    t0 = time.perf_counter()
    results = run_world(oracle_grid, pp * tp * dp, pp, tp, dp, cases, timeout_s=600)
    wall = time.perf_counter() - t0
    assert sorted(r["coords"] for r in results) == sorted(
        (p, t, d) for p in range(pp) for t in range(tp) for d in range(dp))
    worst = [_check_case(results, layout, i, case) for i, case in enumerate(cases)]
    print(f"\n{layout}: {len(cases)} cases in {wall:.1f}s wall; train seconds per case (rank 0):",
          [round(c["seconds"], 2) for c in results[0]["cases"]],
          "; worst err / floor per case:", [round(w, 2) for w in worst])


# Context parallelism (``cp``, the 4th degree: world pp x tp x cp x dp; model_zoo's GPT, ring attention over
# the zig-zag split, and all-to-all (Ulysses) attention at cp 2 and tp 2 + sp x cp 2,
# tests/test_context_parallel.py): the same figures within the same floor, and the cp
# ranks of a replica bitwise equal parameters after every step (their gradients averaged with the dp
# replicas' over grad_group).
CP_LAYOUTS = {  # (pp, tp, dp, cp): cases
    (1, 1, 1, 2): [("1f1b", 3, True, 25.0), ("gpipe", 2, False, 25.0, {"recompute": "selective"}),
                   ("1f1b", 3, True, 25.0, {"cp_attention": "ulysses"})],
    (2, 1, 1, 2): [("1f1b", 3, True, 25.0), ("zbh1", 3, True, 25.0, {"recompute": "full"}),
                   ("interleaved", 2, True, 25.0)],
    (1, 1, 2, 2): [("1f1b", 3, True, 25.0), ("1f1b", 3, False, 25.0, {"zero": 1})],
    (1, 2, 1, 2): [("1f1b", 3, True, 25.0), ("1f1b", 3, True, 25.0, {"sp": True}),
                   ("1f1b", 3, True, 25.0, {"sp": True, "cp_attention": "ulysses"})],
    (1, 1, 1, 4): [("1f1b", 3, True, 25.0)],
}
# Bound 2 K: the ring's blockwise online-softmax merge reorders the attention's sums, and after 3 LAMB
# steps a bias near LAMB's eps magnifies that (measured on AMD EPYC AVX2, worst per cell: 2.7, 6.8
# (interleaved), 1.5, 5.1 (tp 2 x cp 2), 3.9 (cp 4) x the floor; an earlier scores-based ring reached
# 9.0 on one bias while every step-1 gradient stayed within 1.3 x). A defect -- a lost slice, a wrong
# loss share, a missing cp reduction -- is 100 x past either bound.
CP_K = 2 * K


@pytest.mark.parametrize("layout", list(CP_LAYOUTS), ids=lambda layout: "pp{}-tp{}-dp{}-cp{}".format(*layout))
def test_context_parallel_grid_matches_single_process(layout):
    pp, tp, dp, cp = layout
    cases = CP_LAYOUTS[layout]
    t0 = time.perf_counter()
    results = run_world(oracle_grid, pp * tp * dp * cp, pp, tp, dp, cases, cp, timeout_s=600)
    wall = time.perf_counter() - t0
    assert sorted(r["coords"] for r in results) == sorted(
        (p, t, d, c) for p in range(pp) for t in range(tp) for d in range(dp) for c in range(cp))
    worst = [_check_case(results, layout, i, case, CP_K) for i, case in enumerate(cases)]
    print(f"\n{layout}: {len(cases)} cases in {wall:.1f}s wall; worst err / floor per case:",
          [round(w, 2) for w in worst])


# ---------------------------------------------------------------- single process

def test_buckets_pack_consecutive_parameters_up_to_the_cap():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 100, 300, 10, 10)]
    sizes = [[p.numel() for p in b] for b in make_buckets(params, bucket_bytes=800)]  # 200 fp32 per bucket
    assert sizes == [[100, 100], [300], [10, 10]]  # a tensor over the cap is a bucket of its own
    assert [[p.numel() for p in b] for b in make_buckets(params)] == [[100, 100, 300, 10, 10]]
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        make_buckets(params, 0)


def test_final_weight_grad_action_of_each_stage():
    one_f_one_b = get_schedule("1f1b", 2, 3).rank_actions(0)
    final = final_weight_grad_actions(one_f_one_b)
    assert list(final.values()) == [0] and str(one_f_one_b[max(final)]) == "0B2"
    zb = get_schedule("zbh1", 2, 3).rank_actions(1)
    (index, stage), = final_weight_grad_actions(zb).items()
    assert stage == 1 and str(zb[index]) == "1W2"  # I actions leave weight gradients alone
    inter = get_schedule("interleaved", 2, 2, chunks=2).rank_actions(0)
    order = [inter[i] for i in sorted(final_weight_grad_actions(inter))]
    assert [a.stage for a in order] == [2, 0]  # the later chunk's backward ends first
