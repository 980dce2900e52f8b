"""The oracle (DESIGN.md invariant 1): pipeline training equals single-process training.

Pipeline-only runs with no weight shared across stages are bitwise equal to single-process
gradient accumulation over the same micro-batches in the same order. When the tied embedding / LM
head sit on different stages, the stages sum their partial gradients (e + h) where one process adds
each micro-batch's (h_i + e_i) as it goes: the same sum in another order, so agreement is to fp32
rounding, and the two copies stay bitwise equal to each other. There every parameter tensor and the
losses lie within `tests.floor.K` times the fp32 single process's own error against a float64
single process (DESIGN.md invariant 10): AdamW divides by sqrt(v), which magnifies the rounding of
near-zero gradients on one CPU's kernels more than another's, so no fixed constant is stated.
"""

import pytest
import torch

from mp_toolkit.names import stages_per_rank
from tests.dist_harness import run_world
from tests.floor import assert_all_within
from tests.oracle_workers import MIXED_LENGTHS, eval_matches, messages_sent, mixed_lengths, oracle_cases

CASES = [(schedule, m, False) for schedule in ("gpipe", "1f1b", "zbh1", "zbdrain") for m in (1, 3, 8)]
# Interleaved 1F1B: two model chunks per rank, micro-batches a multiple of pp (7 layers -> 4 stages);
# m = 8 runs the whole steady phase after the 2(p-r-1) + (v-1)p warm-up forwards.
INTERLEAVED = [("interleaved", m, False, "adamw", 2) for m in (2, 4, 8)]
# The V schedules (issue 38): two stages per rank, rank 0 holding the first and the last (4 stages of 7 layers);
# ZB-V below 2p - 1 micro-batches too, DualPipeV from 2p.
V_SHAPED = [("zbv", m, False, "adamw", 2) for m in (1, 3, 8)] + [("dualpipev", m, False, "adamw", 2) for m in (4, 8)]


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_bitwise_equals_single_process(pp):
    cases = CASES + (INTERLEAVED + V_SHAPED if pp == 2 else [])
    reports = run_world(oracle_cases, pp, cases, timeout_s=300)
    for case_index, case in enumerate(cases):
        compared = sum(r[case_index][0] for r in reports)
        unequal = [r[case_index][1] for r in reports]
        assert compared > 0
        assert unequal == [0] * pp, f"{case}: tensors not bitwise equal per rank {unequal}"
        for r in reports:  # every rank reports the same mean losses, equal to the reference's
            assert r[case_index][3] == r[case_index][4], case


def test_tied_embedding_across_stages_matches_and_copies_stay_equal():
    cases = [("1f1b", 3, True, "sgd"), ("gpipe", 2, True, "adamw")]
    reports = run_world(oracle_cases, 2, cases, timeout_s=180)
    ratios = []
    for i, case in enumerate(cases):
        first, last = reports[0][i], reports[1][i]
        assert first[5] is not None and last[5] is not None and first[-1] == last[-1] == 1
        assert torch.equal(first[5], last[5]), f"{case}: tied copies diverged"
        for r in (first, last):
            ratios.append(assert_all_within(r[6], f"{case}"))
    print(f"\nworst err / floor: {max(ratios):.2f}")


def test_tied_embedding_under_a_v_is_one_local_weight():
    """Under ZB-V and DualPipeV rank 0 holds the embedding and the LM head: the tie is one parameter there,
    no tie group, no all-reduce; rank 1 holds no member. The weight takes both stages' gradients in the
    schedule's order, so it agrees with one process to fp32 rounding (within `tests.floor.K` x the floor)."""
    cases = [("zbv", 3, True, "sgd", 2), ("dualpipev", 4, True, "adamw", 2)]
    reports = run_world(oracle_cases, 2, cases, timeout_s=180)
    ratios = []
    for i, case in enumerate(cases):
        first, last = reports[0][i], reports[1][i]
        assert first[5] is not None and last[5] is None, case
        assert first[-1] == last[-1] == 0, f"{case}: a tie group was made"
        ratios += [assert_all_within(r[6], f"{case}") for r in (first, last)]
    print(f"\nworst err / floor: {max(ratios):.2f}")


def test_a_same_rank_hand_over_sends_no_message():
    """Placement as data (issue 38): under a V rank 1 holds stages 1 and 2 and hands stage 1's output to
    stage 2 (and stage 2's input gradient back) locally. Counted at the transport: each rank posts one message
    per SEND action of its list, 2 per micro-batch under ZB-V and DualPipeV (rank 0: stage 0's output and
    stage 3's input gradient, both to rank 1), against 3 under interleaved 1F1B over the same 4 stages
    (whose turn from stage 1 to 2 crosses ranks), and none to itself."""
    m = 4
    cases = [("zbv", m, 2), ("dualpipev", m, 2), ("interleaved", m, 2)]
    reports = run_world(messages_sent, 2, cases, timeout_s=120)
    for rank, rank_reports in enumerate(reports):
        for (schedule, *_), (sent, sends) in zip(cases, rank_reports):
            assert rank not in sent and sum(sent.values()) == sends, (schedule, rank, sent)
            assert sends == (3 * m if schedule == "interleaved" else 2 * m), (schedule, rank, sends)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zbh1", "zbdrain", "zbv", "dualpipev"])
def test_eval_batch_equals_single_process_and_changes_nothing(schedule):
    """Forward only through every schedule (interleaved and the V ones: 2 stages per rank): bitwise the
    unsplit model's loss (`mpt train --eval-every`'s validation; tp x dp: tests/test_oracle_tp_dp.py's
    eval_batch); under a V the loss is computed on rank 0 and reported by every rank."""
    chunks = stages_per_rank(schedule)
    for loss, expected, unchanged, _ in run_world(eval_matches, 2, schedule, chunks, timeout_s=120):
        assert loss == expected and unchanged


def test_mixed_lengths_bitwise_equal_single_process():
    """Micro-batches of 4, 8, 12 and 16 tokens, mixed within each step and new ones appearing in later
    steps (issue 21 item 3): 1F1B, ZB-H1, ZB-drain and interleaved 1F1B at pp=2 stay bitwise single-process
    gradient accumulation over the same micro-batches; each distinct length costs one shape pass.
    Receive buffers are reused across steps and shapes and receives posted a batch ahead (issue 23
    item 3) in every case here and in the fixed-length cases above, all bitwise. Then eval_batch over
    mixed lengths, after training on mixed lengths: the unsplit model's loss, bitwise."""
    cases = [("1f1b", 4, False), ("zbh1", 4, False), ("zbdrain", 4, False), ("interleaved", 4, False, "adamw", 2),
             ("dualpipev", 4, False, "adamw", 2)]
    results = run_world(mixed_lengths, 2, cases, timeout_s=300)
    reports = [r[0] for r in results]
    lengths = {n for step in MIXED_LENGTHS for n in step}
    for i, case in enumerate(cases):
        assert sum(r[i][0] for r in reports) > 0
        assert [r[i][1] for r in reports] == [0, 0], f"{case}: tensors not bitwise equal per rank"
        for r in reports:
            assert r[i][3] == r[i][4], case
            assert r[i][7] == len(lengths), f"{case}: {r[i][7]} shape passes for {len(lengths)} lengths"
            # receive buffers reused across steps and shapes, receives posted a batch ahead: still bitwise
            allocated, reused, ahead = r[i][8:11]
            assert allocated > 0 and reused > 0 and ahead > 0, (case, allocated, reused, ahead)
    for _, (loss, expected, unchanged, passes) in results:
        assert loss == expected and unchanged
        assert passes == 4  # 16, 8, 12 in training; 4 first met in the evaluated batch
