"""The memory-capped solver against brute force, the planner's figures, `mpt plan` and `mpt simulate`."""

import itertools
import json
import random

import pytest

from mp_toolkit.partition import PartitionError
from mp_toolkit.partition.memory import MemoryCapError, StageMemory, min_max_memory, min_memory_cut
from mp_toolkit.partition.planner import SPLIT_OVERHEAD, PlanRequest, make_plan, memory_shares
from tests.mpt_command import run_mpt


def all_cuts(n, p):
    for inner in itertools.combinations(range(1, n), p - 1):
        yield [0, *inner, n]


def brute_force(times, memory, p, cap):
    """(best boundaries, smallest feasible cap) by enumeration, with the solver's tie rules."""
    n = len(times)
    best, leanest = None, None
    for b in all_cuts(n, p):
        mems = [memory(j, b[j], b[j + 1]) for j in range(p)]
        leanest = max(mems) if leanest is None else min(leanest, max(mems))
        if max(mems) > cap:
            continue
        key = (sorted((sum(times[b[j]:b[j + 1]]) for j in range(p)), reverse=True), b)
        if best is None or key < best:
            best = key
    return (best[1] if best else None), leanest


def random_instance(rng):
    n = rng.randint(1, 8)
    p = rng.randint(1, n)
    ints = rng.random() < 0.5
    times = [rng.randint(0, 9) if ints else rng.choice([0.0, rng.uniform(0, 5)]) for _ in range(n)]
    memory = StageMemory(static=[rng.randint(0, 20) for _ in range(n)],
                         activation=[rng.randint(0, 10) for _ in range(n)],
                         inflight=[rng.randint(1, 5) for _ in range(p)],
                         workspace=[rng.randint(0, 15) for _ in range(n)] if rng.random() < 0.5 else (),
                         fixed=rng.randint(0, 3))
    return times, memory, p, rng.randint(5, 120)


def test_memory_solver_equals_brute_force_on_random_instances():
    rng = random.Random(0)
    infeasible = feasible = 0
    for _ in range(400):
        times, memory, p, cap = random_instance(rng)
        want, leanest = brute_force(times, memory, p, cap)
        if want is None:
            infeasible += 1
            with pytest.raises(MemoryCapError) as e:
                min_max_memory(times, memory, p, cap)
            assert e.value.needed == leanest
            b = e.value.boundaries
            assert max(memory(j, b[j], b[j + 1]) for j in range(p)) == leanest
        else:
            feasible += 1
            assert min_max_memory(times, memory, p, cap) == want, (times, memory, p, cap)
        assert min_memory_cut(memory, len(times), p)[0] == leanest
    assert infeasible > 40 and feasible > 40  # both branches exercised


def test_stage_memory_depends_on_stage_index():
    """1F1B: stage 0 keeps p micro-batches, the last one; the cap pushes layers to the end."""
    mem = StageMemory(static=[1] * 4, activation=[10] * 4, inflight=[2, 1])
    assert mem(0, 0, 2) == 2 + 2 * 20 and mem(1, 2, 4) == 2 + 20
    assert min_max_memory([1, 1, 1, 1], mem, 2, cap=1000) == [0, 2, 4]
    assert min_max_memory([1, 1, 1, 1], mem, 2, cap=35) == [0, 1, 4]


def test_a_rank_of_interleaved_chunks_shares_one_workspace_and_fixed_part():
    mem = StageMemory(static=[10, 20, 30, 40], activation=[1, 2, 3, 4], inflight=[3, 2, 2, 1],
                      workspace=[100, 0, 50, 7], fixed=1000, step_transient=[0, 0, 0, 0])
    # rank 0 holds stages 0 (layer 0) and 2 (layer 2): static 40, kept 3*1 + 2*3, one workspace 100
    assert mem.of_rank([(0, 0, 1), (2, 2, 3)]) == 40 + (3 + 6 + 100) + 1000
    assert mem.of_rank([(0, 0, 1)]) == mem(0, 0, 1) == 10 + 3 + 100 + 1000
    # stage by stage the workspace and the fixed part would count twice
    assert mem(0, 0, 1) + mem(2, 2, 3) - mem.of_rank([(0, 0, 1), (2, 2, 3)]) == 50 + 1000
    # the shares of a rank's stages add up to the rank; with one stage per rank they are StageMemory
    shares = memory_shares(mem, [0, 1, 2, 3, 4], (0, 1, 0, 1))
    assert shares[0] + shares[2] == mem.of_rank([(0, 0, 1), (2, 2, 3)])
    assert shares[1] + shares[3] == mem.of_rank([(1, 1, 2), (3, 3, 4)]) == 60 + (4 + 4 + 7) + 1000
    assert memory_shares(mem, [0, 2, 4], (0, 1)) == [mem(0, 0, 2), mem(1, 2, 4)]


def test_interleaved_plan_counts_the_fixed_part_once_per_rank():
    """A rank's second chunk adds only its own weights, states and the activations it adds to the
    rank's peak (the two chunks' counts at once, `rank_held`): the receive buffers (the fixed part)
    and the largest workspace are the first chunk's, in one process."""
    from mp_toolkit.schedule import get_schedule, simulate

    inter = plan(method="uniform", schedule="interleaved", chunks=2, microbatches=4)
    t = simulate(get_schedule("interleaved", 2, 4, chunks=2))
    first, second = inter.stages[0], inter.stages[2]  # rank 0's chunks; no workspace (only the LM head has one)
    kept = [sum(c.activation_bytes for c in inter.layers[st.first_layer:st.last_layer + 1]) for st in (first, second)]
    (stages, counts), = [h for h in t.rank_held if h[0] == (0, 2)]
    together = max(c0 * kept[0] + c2 * kept[1] for c0, c2 in counts)
    assert together < t.peak_inflight[0] * kept[0] + t.peak_inflight[2] * kept[1]  # the two peaks come apart
    # fp32 AdamW: 16 bytes per parameter
    assert second.memory_bytes == second.params * 16 + together - t.peak_inflight[0] * kept[0]
    fixed = 2 * max(c.output_bytes for c in inter.layers[:-1])
    assert inter.stages[0].memory_bytes > fixed  # the first chunk carries it


def plan(**kw):
    defaults = dict(model="gpt-small-cpu", pp=2, micro_batch=4, microbatches=4, seq_len=64, tflops=0.1)
    return make_plan(PlanRequest(**{**defaults, **kw}))


def test_plan_json_has_exactly_the_documented_fields():
    p = plan(method="flops").to_json()
    assert set(p) == {"pp", "tp", "dp", "cp", "sequence_parallel", "schedule", "method", "layers", "stages",
                      "max_stage_time_ms", "bubble_fraction", "step_time_ms", "tokens_per_s", "rank_memory_bytes",
                      "mfu", "profile"}
    assert set(p["layers"][0]) == {"name", "params", "flops_fwd", "activation_bytes"}
    assert set(p["stages"][0]) == {"index", "rank", "first_layer", "last_layer", "params", "time_ms",
                                   "memory_bytes"}
    assert [s["rank"] for s in p["stages"]] == [0, 1]
    names = [layer["name"] for layer in p["layers"]]
    assert names == ["embed", "h.0", "h.1", "h.2", "h.3", "ln_f", "lm_head"]
    first, last = p["stages"]
    assert first["first_layer"] == 0 and last["last_layer"] == len(names) - 1
    assert last["first_layer"] == first["last_layer"] + 1
    assert sum(s["params"] for s in p["stages"]) == sum(layer["params"] for layer in p["layers"])
    assert p["max_stage_time_ms"] == max(s["time_ms"] for s in p["stages"])
    tokens = 4 * 4 * 64
    assert p["tokens_per_s"] == pytest.approx(tokens / (p["step_time_ms"] / 1e3))


def test_flops_cut_moves_blocks_away_from_the_lm_head():
    """gpt-small-cpu's LM head (vocab 4096, width 128) costs more FLOPs than all four blocks."""
    by_flops, by_params = plan(method="flops"), plan(method="parameters")
    assert by_flops.max_stage_time_ms < by_params.max_stage_time_ms
    assert by_flops.boundaries[1] > by_params.boundaries[1]


def test_type_regex_balances_matching_layers():
    p = plan(method="type:gptblock", pp=2)
    blocks = [[c.kind for c in p.layers[a:b]].count("GPTBlock") for a, b in zip(p.boundaries, p.boundaries[1:])]
    assert blocks == [2, 2]
    with pytest.raises(PartitionError, match="matches no layer class"):
        plan(method="type:Conv")


def test_memory_method_is_optimal_among_cuts_that_fit(tmp_path):
    """Blocks dominate this model; under 1F1B stage 0 keeps two micro-batches, so a cap moves
    blocks to stage 1 at the price of a slower stage."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 512, "n_embd": 128, "n_layer": 6,
                                  "n_head": 4, "n_positions": 128}))
    kw = dict(model=str(config), seq_len=128)
    loose = plan(method="memory", memory_gb=10.0, **kw)
    assert loose.boundaries == plan(method="flops", **kw).boundaries  # a cap that binds nothing
    with pytest.raises(PartitionError, match="use --memory-gb") as e:
        plan(method="memory", memory_gb=0.001, **kw)
    suggested = float(str(e.value).split("use --memory-gb ")[1].split()[0])
    fits = plan(method="memory", memory_gb=suggested, **kw)  # the suggested cap is feasible
    assert all(s.memory_bytes <= suggested * 1e9 for s in fits.stages) and not fits.warnings
    # the least cap (the suggestion rounds it up to two digits) binds: the fastest cut does not fit it
    capped = plan(method="memory", memory_gb=e.value.needed_gb * 1.001, **kw)
    assert capped.boundaries != loose.boundaries
    assert capped.max_stage_time_ms > loose.max_stage_time_ms
    assert not capped.warnings


def test_gpipe_keeps_every_microbatch_and_1f1b_fewer():
    g, o = plan(method="uniform", schedule="gpipe"), plan(method="uniform", schedule="1f1b")
    assert g.stages[0].memory_bytes > o.stages[0].memory_bytes
    # GPipe's last stage also holds all 4 micro-batches, 1F1B's only one
    act = sum(c.activation_bytes for c in o.layers[o.boundaries[1]:])
    assert g.stages[1].memory_bytes - o.stages[1].memory_bytes == 3 * act
    assert g.bubble_fraction == pytest.approx(o.bubble_fraction, abs=0.05)


def test_over_cap_stage_is_warned():
    p = plan(method="uniform", memory_gb=0.01)
    assert p.warnings and all("over the --memory-gb 0.01 cap" in w for w in p.warnings)


def test_interleaved_and_zbh1_plans():
    inter = plan(method="uniform", schedule="interleaved", chunks=2, microbatches=4)
    assert len(inter.stages) == 4
    zb = plan(method="uniform", schedule="zbh1")
    one = plan(method="uniform", schedule="1f1b")
    assert zb.bubble_fraction < one.bubble_fraction
    # I + W = B (the engine splits the backward, nothing runs twice): W in the bubbles saves time
    assert zb.step_time_ms < one.step_time_ms


def mpt(*args):
    return run_mpt(args, timeout=120)


def test_mpt_plan_prints_table_and_writes_json_and_gantt(tmp_path):
    out, png = tmp_path / "plan.json", tmp_path / "plan.svg"
    r = mpt("plan", "--model", "gpt-tiny", "--pp", "2", "--micro-batch", "2", "--microbatches", "4",
            "--seq-len", "16", "--method", "memory", "--memory-gb", "1", "--tflops", "0.05",
            "--json", str(out), "--gantt", str(png))
    assert r.returncode == 0, r.stderr
    assert "bubble fraction" in r.stdout and "tokens/s" in r.stdout and "embed" in r.stdout
    data = json.loads(out.read_text())
    assert data["method"] == "memory" and len(data["stages"]) == 2
    assert png.read_text().lstrip().startswith("<?xml")


def test_mpt_plan_reads_hf_configs(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=512)
    (tmp_path / "config.json").write_text(config.to_json_string())
    r = mpt("plan", "--model", str(tmp_path / "config.json"), "--pp", "2", "--seq-len", "32", "--method", "flops",
            "--tflops", "1", "--tp", "2")
    assert r.returncode == 0, r.stderr
    assert "embed_tokens.." in r.stdout and "..lm_head" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["--pp", "9"], "exceeds the model's 7 layers"),
    (["--tp", "3"], "--tp 3 does not divide the model's attention heads (4)"),
    (["--schedule", "interleaved", "--chunks", "4", "--pp", "2"], "exceeds the model's 7 layers"),
    (["--schedule", "roundrobin"], "invalid choice"),
    (["--method", "random"], "unknown --method 'random'"),
    (["--model", "/nonexistent/config.json"], "unknown model"),
    (["--method", "memory"], "needs --memory-gb"),
    (["--method", "memory", "--memory-gb", "0.0001"], "is too small: even the leanest cut puts"),
    (["--micro-batch", "0"], "--micro-batch 0 must be a positive integer"),
    (["--gantt", "out.pdf"], "must end in .png or .svg"),
])
def test_mpt_plan_bad_input_is_one_line_exit_2(args, message):
    base = ["plan", "--model", "gpt-tiny", "--pp", "2", "--seq-len", "16", "--tflops", "0.05"]
    r = mpt(*base, *args)
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_mpt_plan_unreadable_config(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_bytes(b"\xff\xfe{")
    r = mpt("plan", "--model", str(bad), "--pp", "2")
    assert r.returncode == 2 and "cannot read" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_mpt_simulate_matches_the_closed_form(tmp_path):
    out = tmp_path / "sim.json"
    r = mpt("simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--json", str(out),
            "--gantt", str(tmp_path / "sim.png"))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["bubble_fraction"] == pytest.approx(3 / (8 + 3))
    assert data["peak_inflight"] == [4, 3, 2, 1]
    assert (tmp_path / "sim.png").read_bytes()[:4] == b"\x89PNG"
    r = mpt("simulate", "--schedule", "interleaved", "--pp", "2", "--microbatches", "4", "--chunks", "2")
    assert r.returncode == 0 and f"bubble fraction {1 / (2 * 4 + 1):.4f}" in r.stdout
    r = mpt("simulate", "--schedule", "gpipe", "--pp", "0", "--microbatches", "4")
    assert r.returncode == 2 and "--pp 0 must be between 1 and 1024" in r.stderr


def test_measured_zbh1_plan_uses_each_stages_measured_input_and_weight_passes():
    p = plan(model="gpt-tiny", schedule="zbh1", method="time", microbatches=4, seq_len=16, threads=1, load=False)
    durations = {}
    for row in p.timeline.events:
        for ev in row:
            durations.setdefault((ev.action.stage, ev.action.kind.value), ev.end - ev.start)
    last = p.stages[1]
    assert durations[(0, "I")] == 0.0 and durations[(0, "W")] == pytest.approx(p.stages[0].backward_ms)
    i_ms, w_ms = durations[(1, "I")], durations[(1, "W")]
    # W also carries the split's own cost, which the layer-by-layer timing does not see
    assert i_ms > 0 and w_ms > 0 and i_ms + w_ms == pytest.approx((1 + SPLIT_OVERHEAD) * last.backward_ms)


def test_zbh1s_recorded_gradients_count_on_every_stage_but_the_first():
    mem = StageMemory(static=[0, 0, 0, 0], activation=[10, 10, 10, 10], inflight=[2, 1],
                      recorded=[5, 5, 5, 5])
    assert mem(0, 0, 2) == 2 * 20  # the first stage does not split: nothing recorded
    assert mem(1, 2, 4) == 1 * (20 + 10)
    assert mem.of_rank([(0, 0, 1), (1, 1, 2)]) == 2 * 10 + 1 * 15


def test_a_split_schedule_holds_recorded_gradients_only_between_i_and_w():
    """With `StageMemory.held` (what `simulate` gives a split schedule) recorded gradients count
    per micro-batch pending W, not per micro-batch in flight; the running I records its own inside
    the workspace. ZB-drain's one split on the last of two stages then costs 1F1B's peak (as
    `tools/bench_plan_accuracy.py` measures); ZB-H1 holds one deferred W's gradients."""
    args = dict(static=[0, 0, 0, 0], activation=[10, 10, 10, 10], recorded=[5, 5, 5, 5], workspace=[7, 7, 7, 7])
    drain = StageMemory(inflight=[2, 1], held=[((2, 0),), ((1, 0),)], **args)
    one_f_one_b = StageMemory(inflight=[2, 1], **{**args, "recorded": ()})
    zbh1 = StageMemory(inflight=[2, 2], held=[((2, 0),), ((2, 1),)], **args)
    assert drain(1, 2, 4) == one_f_one_b(1, 2, 4) == 1 * 20 + 7
    assert zbh1(1, 2, 4) == 2 * 20 + 1 * 10 + 7 < StageMemory(inflight=[2, 2], **args)(1, 2, 4)
    assert zbh1.kept(1, 2, 4, saved=4) == 2 * 16 + 1 * 10  # recomputation drops activations, not gradients
    assert zbh1.of_rank([(0, 0, 2), (1, 2, 4)]) == 2 * 20 + (2 * 20 + 10) + 7


def test_a_rank_of_several_chunks_holds_them_at_its_own_peak():
    """With `StageMemory.rank_held` a rank's chunks count at the rank's peaks, not each at its own:
    interleaved rank 1 of p 2 x v 2, m 8, holds (2, 1) or (3, 0) micro-batches of its chunks, never
    (3, 1). Per-stage shares (`memory_shares`) still add up to the rank."""
    rank_held = [((0, 2), ((3, 2), (4, 1))), ((1, 3), ((2, 1), (3, 0)))]
    args = dict(static=[1] * 4, activation=[10, 20, 30, 40], inflight=[4, 3, 2, 1], workspace=[5, 5, 5, 5])
    alone, together = StageMemory(**args), StageMemory(**args, rank_held=rank_held)
    spans = [(1, 1, 2), (3, 3, 4)]
    assert alone.of_rank(spans) == 2 + 3 * 20 + 1 * 40 + 5
    assert together.of_rank(spans) == 2 + max(2 * 20 + 1 * 40, 3 * 20) + 5
    assert together.of_rank([(1, 1, 2)]) == alone.of_rank([(1, 1, 2)])  # one chunk: its own peak
    shares = memory_shares(together, [0, 1, 2, 3, 4], (0, 1, 0, 1))
    assert shares[1] + shares[3] == together.of_rank(spans)
    assert shares[0] + shares[2] == 2 + max(3 * 10 + 2 * 30, 4 * 10 + 1 * 30) + 5


def test_a_given_cut_is_planned_as_the_method_that_picks_it():
    """``boundaries`` (what `mpt train` asks for its own cut) gives the plan a method choosing that
    cut gives, stage for stage; a cut of the wrong length is refused."""
    by_method = plan(method="flops", pp=4)
    given = plan(method="uniform", pp=4, boundaries=tuple(by_method.boundaries))
    assert given.boundaries == by_method.boundaries != plan(method="uniform", pp=4).boundaries
    assert [s.memory_bytes for s in given.stages] == [s.memory_bytes for s in by_method.stages]
    with pytest.raises(PartitionError):
        plan(pp=4, boundaries=(0, 2, 4))


def test_the_planner_holds_the_padded_vocabulary_under_tp():
    """The run pads the vocabulary to a multiple of 128 x tp (gpt2: 50257 -> 50432 at tp=2), so
    the plan counts those rows on the embedding's stage instead of refusing the tp."""
    tp1, tp2 = plan(model="gpt2", method="flops", pp=2), plan(model="gpt2", method="flops", pp=2, tp=2)
    embed = lambda p: next(c for c in p.layers if c.name == "embed")  # noqa: E731
    assert embed(tp2).params == (50432 * 768) // 2 + 1024 * 768
    assert embed(tp1).params == 50257 * 768 + 1024 * 768
