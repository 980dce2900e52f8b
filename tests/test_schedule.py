"""Schedule IR, generators, validator and printer."""
import io

import pytest

from mp_toolkit.schedule import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    format_actions,
    format_schedule,
    get_schedule,
    gpipe,
    makespan,
    one_f_one_b,
    simulate_order,
    validate,
)

GENERATORS = [gpipe, one_f_one_b]
SIZES = [(p, m) for p in range(1, 6) for m in range(1, 10)]


def make(actions, num_stages, microbatches, stage_to_rank=None):
    """A hand-written schedule from action strings, one list per rank."""
    stage_to_rank = stage_to_rank or tuple(range(num_stages))
    parsed = [[Action.parse(a) for a in row.split()] for row in actions]
    return Schedule("hand", num_stages, microbatches, stage_to_rank, parsed)


# ---- IR -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(Kind))
def test_parse_str_round_trip(kind):
    action = Action(12, kind, 7)
    text = f"12{kind.value}7"
    assert str(action) == text
    assert Action.parse(text) == action


def test_kind_properties():
    assert {k for k in Kind if k.is_compute} == {Kind.F, Kind.B, Kind.I, Kind.W}
    assert {k for k in Kind if k.is_comm} == {Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B}


@pytest.mark.parametrize("bad", ["", "F3", "1X3", "1F", "1SEND3", "a1F3", "1f3"])
def test_parse_rejects_bad_text(bad):
    with pytest.raises(ValueError, match=repr(bad).replace("\\", "\\\\")):
        Action.parse(bad)


def test_matching_pairs():
    assert Action.parse("0SEND_F1").matching() == Action.parse("1RECV_F1")
    assert Action.parse("1SEND_B2").matching() == Action.parse("0RECV_B2")
    assert Action.parse("0RECV_B2").matching() == Action.parse("1SEND_B2")


@pytest.mark.parametrize("gen", GENERATORS)
def test_csv_round_trip(gen, tmp_path):
    sched = gen(3, 4)
    path = tmp_path / "s.csv"
    sched.to_csv(path)
    rows = path.read_text().splitlines()
    assert len(rows) == 3
    assert rows[0].split(",")[:2] == ["0F0", "0SEND_F0"]
    assert Schedule.from_csv(path, name=sched.name) == sched
    # Metadata is inferred, and a file object works too.
    back = Schedule.from_csv(io.StringIO(sched.to_csv_string()))
    assert (back.num_stages, back.microbatches, back.stage_to_rank) == (3, 4, (0, 1, 2))
    assert back.actions == sched.actions


def test_from_csv_skips_empty_cells_like_torch_dump():
    text = "0F0,,0B0\n"
    sched = Schedule.from_csv(io.StringIO(text))
    assert [str(a) for a in sched.rank_actions(0)] == ["0F0", "0B0"]
    validate(sched)


# ---- generators -----------------------------------------------------------------------
@pytest.mark.parametrize("gen", GENERATORS)
@pytest.mark.parametrize("p,m", SIZES)
def test_generators_validate(gen, p, m):
    sched = gen(p, m)
    assert sched.num_ranks == p and sched.stage_to_rank == tuple(range(p))
    validate(sched)


@pytest.mark.parametrize("gen", GENERATORS)
@pytest.mark.parametrize("p,m", SIZES)
def test_microbatch_order_ascending(gen, p, m):
    sched = gen(p, m)
    for rank in range(p):
        acts = sched.rank_actions(rank)
        assert [a.microbatch for a in acts if a.kind is Kind.F] == list(range(m))
        assert [a.microbatch for a in acts if a.kind is Kind.B] == list(range(m))


def max_in_flight(actions):
    live = peak = 0
    for a in actions:
        live += {Kind.F: 1, Kind.B: -1}.get(a.kind, 0)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p,m", SIZES)
def test_in_flight_activations(p, m):
    f1b, gp = one_f_one_b(p, m), gpipe(p, m)
    for s in range(p):
        assert max_in_flight(f1b.rank_actions(s)) == min(p - s, m)
        assert max_in_flight(gp.rank_actions(s)) == m


@pytest.mark.parametrize("gen", GENERATORS)
@pytest.mark.parametrize("p,m", SIZES)
def test_unit_time_makespan(gen, p, m):
    assert makespan(gen(p, m)) == 2 * (m + p - 1)


def test_one_f_one_b_p2_m3_actions():
    sched = one_f_one_b(2, 3)
    assert format_actions(sched) == (
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2\n"
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2"
    )


@pytest.mark.parametrize("p,m", [(4, 8), (3, 2)])
def test_one_f_one_b_pairs_comms_for_batching(p, m):
    """In steady state SEND_F k is directly followed by RECV_B j (send_forward_recv_backward)."""
    for s in range(p - 1):
        acts = one_f_one_b(p, m).rank_actions(s)
        for i, a in enumerate(acts):
            if a.kind is Kind.SEND_F and a.microbatch >= p - s - 1:
                assert acts[i + 1] == Action(s, Kind.RECV_B, a.microbatch - (p - s - 1))


def test_one_stage_has_no_comms():
    for gen in GENERATORS:
        assert [str(a) for a in gen(1, 2).rank_actions(0)] in (
            ["0F0", "0F1", "0B0", "0B1"],
            ["0F0", "0B0", "0F1", "0B1"],
        )


def test_get_schedule_names():
    assert get_schedule("GPipe", 2, 3) == gpipe(2, 3)
    assert get_schedule("gpipe", 2, 3) == gpipe(2, 3)
    assert get_schedule("1f1b", 2, 3) == one_f_one_b(2, 3)
    assert get_schedule("1F1B", 2, 3).name == "1F1B"
    with pytest.raises(ValueError, match="'zb': choose one of GPipe, 1F1B"):
        get_schedule("zb", 2, 3)
    with pytest.raises(ValueError, match="microbatches"):
        gpipe(2, 0)


# ---- validator rejects broken schedules ----------------------------------------------
def test_rejects_missing_recv_f():
    sched = make(["0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1B0 1SEND_B0"], 2, 1)
    with pytest.raises(ScheduleError, match=r"rank 1, position 0: 1F0: needs 1RECV_F0"):
        validate(sched)


def test_rejects_backward_before_forward():
    with pytest.raises(ScheduleError, match=r"rank 0, position 0: 0B0: needs 0F0 earlier"):
        validate(make(["0B0 0F0"], 1, 1))


def test_rejects_cross_rank_deadlock():
    sched = make(["0F0 0RECV_B0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], 2, 1)
    with pytest.raises(ScheduleError) as err:
        validate(sched)
    msg = str(err.value)
    assert msg.startswith("deadlock: ranks [0, 1] are blocked")
    assert "rank 0, position 1: 0RECV_B0 waits for 1SEND_B0 on rank 1" in msg
    assert "rank 1, position 0: 1RECV_F0 waits for 0SEND_F0 on rank 0" in msg


def test_rejects_fifo_mismatch():
    rows = [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F1 1RECV_F0 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
    ]
    sched = make(rows, 2, 2)
    with pytest.raises(ScheduleError, match=r"rank 1, position 0: 1RECV_F1: message 0 from rank 0"):
        validate(sched)
    # The simulator, on its own, names the same mismatch at the channel head.
    with pytest.raises(ScheduleError, match=r"1RECV_F1: the next message from rank 0 is 0SEND_F0"):
        simulate_order(sched)


def test_rejects_duplicated_forward():
    with pytest.raises(ScheduleError, match=r"rank 0, position 1: 0F0: duplicate .* position 0"):
        validate(make(["0F0 0F0 0B0"], 1, 1))


def test_rejects_missing_backward_and_unmatched_send():
    with pytest.raises(ScheduleError, match=r"stage 0 micro-batch 1 has no backward 0B1"):
        validate(make(["0F0 0F1 0B0"], 1, 2))
    sched = make(["0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], 2, 1)
    with pytest.raises(ScheduleError, match=r"rank 1, position 0: 1RECV_F0: no matching 0SEND_F0"):
        validate(sched)


def test_rejects_action_on_wrong_rank():
    sched = make(["0F0 0B0 1F0", "1B0"], 2, 1)
    with pytest.raises(ScheduleError, match=r"rank 0, position 2: 1F0: stage 1 runs on rank 1"):
        validate(sched)


def test_split_backward_rules():
    validate(make(["0F0 0I0 0W0"], 1, 1))
    with pytest.raises(ScheduleError, match=r"0W0: needs 0I0 earlier"):
        validate(make(["0F0 0W0 0I0"], 1, 1))
    with pytest.raises(ScheduleError, match="both a full backward B and a split I/W"):
        validate(make(["0F0 0I0 0W0 0B0"], 1, 1))


def test_stages_sharing_a_rank_pass_locally():
    validate(make(["0F0 1F0 1B0 0B0"], 2, 1, stage_to_rank=(0, 0)))
    with pytest.raises(ScheduleError, match="share rank 0"):
        validate(make(["0F0 0SEND_F0 1RECV_F0 1F0 1B0 0B0"], 2, 1, stage_to_rank=(0, 0)))


# ---- printer ----------------------------------------------------------------------------
def test_format_schedule_1f1b_p2_m3():
    # Hand-checked: rank 1's B0 ends at step 3, so rank 0 idles at step 2; B2 waits for
    # rank 1's B2 at step 6.
    assert format_schedule(one_f_one_b(2, 3)) == (
        "time    0  1  2  3  4  5  6  7\n"
        "rank 0 F0 F1  . B0 F2 B1  . B2\n"
        "rank 1  . F0 B0 F1 B1 F2 B2  ."
    )


def test_format_schedule_gpipe_p2_m3():
    assert format_schedule(gpipe(2, 3)) == (
        "time    0  1  2  3  4  5  6  7\n"
        "rank 0 F0 F1 F2  .  . B0 B1 B2\n"
        "rank 1  . F0 F1 F2 B0 B1 B2  ."
    )


def test_format_schedule_with_comms():
    lines = format_schedule(one_f_one_b(2, 3), comms=True).splitlines()
    assert lines[1].split() == [
        "rank", "0", "F0+SEND_F0", "F1+SEND_F1", ".", "RECV_B0+B0",
        "F2+SEND_F2", "RECV_B1+B1", ".", "RECV_B2+B2",
    ]
    assert lines[2].split()[3] == "RECV_F0+F0"
