"""Interleaved 1F1B, ZB-H1, ZB-drain, the timeline simulator and the Gantt chart."""
import io

import pytest

from mp_toolkit.schedule import (
    Action,
    Kind,
    Schedule,
    draw_gantt,
    format_actions,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    simulate_report,
    split_share,
    validate,
    zb_drain,
    zbh1,
)

INTERLEAVED_SIZES = [
    (p, v, m) for p in range(1, 5) for v in range(1, 4) for m in range(1, 9)
    if v == 1 or m % p == 0
]
ZB_SIZES = [(p, m) for p in range(1, 6) for m in range(1, 10)]


def orders(sched, kinds):
    """Per stage, the micro-batch order of the actions of ``kinds``."""
    out = {s: [] for s in range(sched.num_stages)}
    for acts in sched.actions:
        for a in acts:
            if a.kind in kinds:
                out[a.stage].append(a.microbatch)
    return out


# ---- interleaved 1F1B ---------------------------------------------------------------
@pytest.mark.parametrize("p,v,m", INTERLEAVED_SIZES)
def test_interleaved_validates_in_order(p, v, m):
    sched = interleaved_1f1b(p, m, v)
    assert sched.num_ranks == p and sched.num_stages == p * v
    assert sched.stage_to_rank == tuple(s % p for s in range(p * v))
    validate(sched)
    # Gradient accumulation order must be the single-process order on every stage.
    for kinds in ({Kind.F}, {Kind.B}):
        assert orders(sched, kinds) == {s: list(range(m)) for s in range(p * v)}


@pytest.mark.parametrize("p,v,m", INTERLEAVED_SIZES)
def test_interleaved_peak_memory_per_rank(p, v, m):
    # Rank r keeps 2(p-r-1) + (v-1)*p + 1 chunk micro-batches alive (Megatron's warm-up; p-r with
    # one chunk, 1F1B). A chunk is 1/v of the rank's layers, so rank 0 holds p + (p-1)/v
    # rank-shares, against 1F1B's p.
    t = simulate(interleaved_1f1b(p, m, v))
    assert t.peak_inflight_rank == tuple(min((p - r - 1) * (2 if v > 1 else 1) + (v - 1) * p + 1, m * v)
                                         for r in range(p))


@pytest.mark.parametrize("p,v,m", INTERLEAVED_SIZES)
def test_a_ranks_chunks_peak_at_different_times(p, v, m):
    """`Timeline.rank_held`: what each chunk of a rank holds at once. Every chunk's own peak shows in
    some vector, the largest total is the rank's peak, and the total of the chunks' peaks (what the
    planner added up before) is never below it."""
    t = simulate(interleaved_1f1b(p, m, v))
    if v == 1:
        assert t.rank_held == ()
        return
    assert [stages for stages, _ in t.rank_held] == [tuple(range(r, p * v, p)) for r in range(p)]
    for r, (stages, counts) in enumerate(t.rank_held):
        assert max(sum(c) for c in counts) == t.peak_inflight_rank[r]
        assert [max(c[i] for c in counts) for i in range(v)] == [t.peak_inflight[s] for s in stages]
        assert sum(t.peak_inflight[s] for s in stages) >= t.peak_inflight_rank[r]
    assert simulate(interleaved_1f1b(2, 8, 2)).rank_held == (((0, 2), ((3, 2), (4, 1))), ((1, 3), ((2, 1), (3, 0))))


def test_interleaved_p2_v2_m4_actions():
    # Rank 0 holds stages 0 and 2, rank 1 stages 1 and 3. Rank 0 warms up with Megatron's and torch's
    # 2(p-r-1) + (v-1)p = 4 forwards (0F0 0F1 2F0 2F1), rank 1 with 2; each rank's receives follow
    # the order its peer sends in on their one link (FIFO): 1RECV_F2 before 1RECV_B0.
    assert format_actions(interleaved_1f1b(2, 4, 2)) == (
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 0F2 0SEND_F2 "
        "2RECV_B0 2B0 2SEND_B0 0F3 0SEND_F3 2RECV_B1 2B1 2SEND_B1 2RECV_F2 2F2 2SEND_F2 0RECV_B0 0B0 "
        "2RECV_F3 2F3 2SEND_F3 0RECV_B1 0B1 2RECV_B2 2B2 2SEND_B2 2RECV_B3 2B3 2SEND_B3 0RECV_B2 0B2 "
        "0RECV_B3 0B3\n"
        "rank 1: 1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3B0 3SEND_B0 3RECV_F1 3F1 3B1 "
        "3SEND_B1 1RECV_F2 1F2 1SEND_F2 1RECV_B0 1B0 1SEND_B0 1RECV_F3 1F3 1SEND_F3 1RECV_B1 1B1 1SEND_B1 "
        "3RECV_F2 3F2 3B2 3SEND_B2 3RECV_F3 3F3 3B3 3SEND_B3 1RECV_B2 1B2 1SEND_B2 1RECV_B3 1B3 1SEND_B3"
    )


def test_interleaved_one_rank_passes_locally():
    acts = [str(a) for a in interleaved_1f1b(1, 2, 2).rank_actions(0)]
    assert acts == ["0F0", "1F0", "1B0", "0F1", "0B0", "1F1", "1B1", "0B1"]


def test_interleaved_one_chunk_is_one_f_one_b():
    for p, m in [(2, 3), (4, 6), (3, 1)]:
        assert interleaved_1f1b(p, m, 1).actions == one_f_one_b(p, m).actions


def test_interleaved_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"interleaved 1F1B needs --microbatches a multiple of "
                                         r"--pp \(got m=3, p=2\)"):
        interleaved_1f1b(2, 3, 2)
    with pytest.raises(ValueError, match="chunks >= 1, got 0"):
        interleaved_1f1b(2, 4, 0)


# ---- ZB-H1 --------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", ZB_SIZES)
def test_zbh1_validates_in_order(p, m):
    sched = zbh1(p, m)
    validate(sched)
    for kind in (Kind.F, Kind.I, Kind.W):
        assert orders(sched, {kind}) == {s: list(range(m)) for s in range(p)}
    assert not any(a.kind is Kind.B for acts in sched.actions for a in acts)
    for acts in sched.actions:
        # The input gradient is sent right after I, before any W.
        for i, a in enumerate(acts):
            if a.kind is Kind.SEND_B:
                assert acts[i - 1] == Action(a.stage, Kind.I, a.microbatch)
            if a.kind is Kind.RECV_B:
                assert acts[i + 1] == Action(a.stage, Kind.I, a.microbatch)


def test_zbh1_p2_m3_actions():
    # Stage 1 defers one W: W0 runs after I1, and W1, W2 fill the drain.
    assert format_actions(zbh1(2, 3)) == (
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0I0 0W0 0F2 0SEND_F2 0RECV_B1 0I1 0W1 "
        "0RECV_B2 0I2 0W2\n"
        "rank 1: 1RECV_F0 1F0 1I0 1SEND_B0 1RECV_F1 1F1 1I1 1SEND_B1 1W0 1RECV_F2 1F2 1I2 "
        "1SEND_B2 1W1 1W2"
    )


@pytest.mark.parametrize("p,m", ZB_SIZES)
def test_zbh1_memory_is_that_of_1f1b(p, m):
    t = simulate(zbh1(p, m))
    assert t.peak_inflight == tuple(min(p - s, m) for s in range(p))  # F ahead of I
    assert t.peak_inflight_w == tuple(min(p, m) for _ in range(p))  # F ahead of W


# ---- ZB-drain -----------------------------------------------------------------------
@pytest.mark.parametrize("p,m", ZB_SIZES)
def test_zb_drain_is_1f1b_with_the_last_backwards_split(p, m):
    """Stage s runs 1F1B's order with its last min(s, m) backwards as I (sent at once) and their W
    after its last I; weight gradients accumulate in ascending micro-batch order."""
    sched = zb_drain(p, m)
    validate(sched)
    ref = one_f_one_b(p, m)
    for s, (acts, ref_acts) in enumerate(zip(sched.actions, ref.actions)):
        split = min(s, m)
        first_split = m - split
        computes = [a for a in acts if a.kind.is_compute]
        expected = [Action(s, Kind.I, a.microbatch) if a.kind is Kind.B and a.microbatch >= first_split else a
                    for a in ref_acts if a.kind.is_compute]
        assert computes == expected + [Action(s, Kind.W, k) for k in range(first_split, m)]
        weight = [a.microbatch for a in computes if a.kind in (Kind.B, Kind.W)]
        assert weight == list(range(m))
        assert split_share("zbdrain", s, m) == split / m
        for i, a in enumerate(acts):  # the input gradient leaves before any W
            if a.kind is Kind.SEND_B:
                assert acts[i - 1].kind in (Kind.B, Kind.I) and acts[i - 1].microbatch == a.microbatch


@pytest.mark.parametrize("p,m", ZB_SIZES)
def test_zb_drain_memory(p, m):
    t = simulate(zb_drain(p, m))
    assert t.peak_inflight == simulate(one_f_one_b(p, m)).peak_inflight  # F ahead of I: 1F1B's
    assert all(w <= min(max(p - s, s), m) for s, w in enumerate(t.peak_inflight_w))  # F ahead of W
    assert all(a <= b for a, b in zip(t.peak_inflight_w, simulate(zbh1(p, m)).peak_inflight_w))


@pytest.mark.parametrize("p,m", ZB_SIZES)
def test_held_pairs_count_recorded_gradients_only_between_i_and_w(p, m):
    """What a split stage holds at its peaks (`Timeline.peak_held_w`): the most activations is the in-flight
    peak; recorded gradients of a W still to come, never the running action's own. ZB-drain's
    stage s splits its last min(s, m) backwards, so holds at most min(s, m) - 1 beside a running
    one; without splits nothing is recorded."""
    for schedule in (zbh1(p, m), zb_drain(p, m), one_f_one_b(p, m), gpipe(p, m)):
        t = simulate(schedule)
        for s, pairs in enumerate(t.peak_held_w):
            assert max(a for a, _ in pairs) == t.peak_inflight_w[s]
            assert all(r < a for a, r in pairs)  # a recorded gradient's activations are still held
            if schedule.name in ("1F1B", "GPipe"):
                assert pairs == ((t.peak_inflight[s], 0),)
            if schedule.name == "ZBDrain":
                assert max(r for _, r in pairs) == max(min(s, m) - 1, 0)
    assert simulate(zb_drain(2, 8)).peak_held_w == (((2, 0),), ((1, 0),))  # the drain's one split: inside its B
    assert simulate(zbh1(2, 8)).peak_held_w == (((2, 0),), ((2, 1),))  # W deferred by one micro-batch


def test_zb_drain_two_stages_takes_the_drain_with_one_split():
    """p = 2, F = I = W = 1: 1F1B 3m+3, ZB-drain 3m+2 (stage 1 sends its last input gradient before
    its last W), ZB-H1 3m+1 at m splits. When a split costs 10% of B more (the planner's
    SPLIT_OVERHEAD: W = 1.2), ZB-H1 pays it m times on stage 1: faster at m = 4, slower from m = 8."""
    unit = {"F": 1, "I": 1, "W": 1, "B": 2}
    costly = {0: unit, 1: {**unit, "W": 1.2}}
    for m in (4, 8, 16):
        assert simulate(one_f_one_b(2, m), unit).step_time == 3 * m + 3
        assert simulate(zb_drain(2, m), unit).step_time == 3 * m + 2
        assert simulate(zbh1(2, m), unit).step_time == 3 * m + 1
        assert simulate(zb_drain(2, m), costly).step_time == 3 * m + 2
        assert simulate(zbh1(2, m), costly).step_time == pytest.approx(3 * m + 1 + 0.2 * m)
    assert split_share("zbh1", 0, 8) == 0 and split_share("zbh1", 1, 8) == 1 and split_share("1f1b", 1, 8) == 0


# ---- CSV and names ------------------------------------------------------------------
@pytest.mark.parametrize("sched", [interleaved_1f1b(3, 6, 2), zbh1(3, 4)], ids=["il", "zb"])
def test_csv_round_trip(sched, tmp_path):
    path = tmp_path / "s.csv"
    sched.to_csv(path)
    assert Schedule.from_csv(path, name=sched.name) == sched
    back = Schedule.from_csv(io.StringIO(sched.to_csv_string()))
    assert back.stage_to_rank == sched.stage_to_rank and back.actions == sched.actions
    validate(back)


def test_get_schedule_new_names():
    assert get_schedule("Interleaved1F1B", 2, 4) == interleaved_1f1b(2, 4, 2)
    assert get_schedule("interleaved", 2, 6, chunks=3) == interleaved_1f1b(2, 6, 3)
    assert get_schedule("interleaved", 2, 6, chunks=3).num_stages == 6
    assert get_schedule("ZBH1", 3, 4) == zbh1(3, 4) == get_schedule("zbh1", 3, 4)
    assert get_schedule("ZBDrain", 3, 4) == zb_drain(3, 4) == get_schedule("zb-drain", 3, 4)
    assert get_schedule("1F1B", 2, 3, chunks=1) == one_f_one_b(2, 3)


def test_get_schedule_bad_input():
    with pytest.raises(ValueError, match="'zb2': choose one of GPipe, 1F1B, Interleaved1F1B, ZBDrain, "
                                         "ZBH1"):
        get_schedule("zb2", 2, 3)
    with pytest.raises(ValueError, match=r"multiple of --pp \(got m=5, p=2\)"):
        get_schedule("interleaved", 2, 5)
    with pytest.raises(ValueError, match="--chunks 2 applies only to Interleaved1F1B"):
        get_schedule("1F1B", 2, 4, chunks=2)


# ---- simulator: closed forms --------------------------------------------------------
@pytest.mark.parametrize("gen", [gpipe, one_f_one_b])
@pytest.mark.parametrize("costs", [{"F": 1, "B": 1}, {"F": 1, "B": 2}])
@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 5), (3, 4), (4, 8), (5, 2)])
def test_bubble_gpipe_1f1b(gen, costs, p, m):
    t = simulate(gen(p, m), costs)
    per_mb = costs["F"] + costs["B"]
    assert t.step_time == pytest.approx((m + p - 1) * per_mb)
    assert t.busy == pytest.approx([m * per_mb] * p)
    assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 3), (4, 8), (3, 1), (4, 2)])
def test_peak_inflight_gpipe_1f1b(p, m):
    assert simulate(one_f_one_b(p, m)).peak_inflight == tuple(min(p - s, m) for s in range(p))
    assert simulate(gpipe(p, m)).peak_inflight == (m,) * p


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (2, 3, 8), (3, 2, 6), (4, 2, 8), (4, 3, 4)])
def test_bubble_interleaved(p, v, m):
    # Each chunk is 1/v of a rank's share of the model.
    t = simulate(interleaved_1f1b(p, m, v), {"F": 1 / v, "B": 2 / v})
    assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert t.step_time == pytest.approx(3 * (m + (p - 1) / v))


def test_zbh1_idle_is_a_third_of_1f1b():
    # p=4, m=8, F=I=W=1 (B=I+W=2): 1F1B idles 3*(p-1)=9 per rank, ZB-H1 (p-1)=3.
    zb = simulate(zbh1(4, 8), {"F": 1, "I": 1, "W": 1})
    ref = simulate(one_f_one_b(4, 8), {"F": 1, "B": 2})
    assert ref.idle_time == pytest.approx(36) and zb.idle_time == pytest.approx(12)
    assert 0.25 <= zb.idle_time / ref.idle_time <= 0.42
    assert zb.bubble_fraction == pytest.approx(12 / (4 * 27))  # 1/9, vs 1F1B's 3/11


def test_p2p_latency_and_bandwidth():
    # 1F1B p=2 m=1: F0 | send (0.5 latency + 100 B / 100 B/s) | F0 B0 | send | B0.
    t = simulate(one_f_one_b(2, 1), {"F": 1, "B": 2}, p2p_latency=0.5,
                 p2p_bandwidth=100.0, message_bytes=100)
    assert t.step_time == pytest.approx(1 + 1.5 + 3 + 1.5 + 2)
    recv = [e for e in t.events[1] if e.action.kind is Kind.RECV_F][0]
    assert (recv.start, recv.end) == (0.0, 2.5)
    assert t.busy == (3.0, 3.0)


def test_costs_by_stage_and_callable():
    sched = one_f_one_b(2, 2)
    slow_last = simulate(sched, {0: {"F": 1, "B": 2}, 1: {"F": 2, "B": 4}})
    assert slow_last.busy == (6.0, 12.0)
    assert slow_last.step_time == pytest.approx(1 + 12 + 2)  # wait for F0, stage 1, last B
    assert simulate(sched, lambda a: 1.0).busy == (4.0, 4.0)
    with pytest.raises(ValueError, match="no duration for B"):
        simulate(sched, {"F": 1.0})


# ---- report and Gantt ---------------------------------------------------------------
def test_simulate_report():
    report = simulate_report("interleaved", 2, 4, chunks=2)
    assert set(report) == {"schedule", "pp", "microbatches", "chunks", "placement", "step_time",
                           "bubble_fraction", "peak_inflight", "peak_inflight_rank", "grid"}
    assert report["placement"] == [0, 1, 0, 1] and report["peak_inflight_rank"] == [5, 3]
    assert (report["schedule"], report["pp"], report["microbatches"], report["chunks"]) == (
        "Interleaved1F1B", 2, 4, 2)
    assert report["bubble_fraction"] == pytest.approx(1 / 9)
    assert report["step_time"] == pytest.approx(3 * 4.5)  # F+B=3 per rank share, m + 1/2
    assert simulate_report("1f1b", 4, 8)["peak_inflight"] == [4, 3, 2, 1]
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        simulate_report("pipedream", 2, 4)


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_gantt_writes_file(tmp_path, suffix):
    path = tmp_path / f"g{suffix}"
    draw_gantt(simulate(interleaved_1f1b(2, 4, 2)), path)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in data
    simulate_report("zbh1", 3, 4, gantt=str(tmp_path / "z.svg"))
    assert (tmp_path / "z.svg").stat().st_size > 1000


def test_gantt_rejects_other_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"must end in \.png or \.svg"):
        draw_gantt(simulate(zbh1(2, 2)), tmp_path / "g.pdf")
