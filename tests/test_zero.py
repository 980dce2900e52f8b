"""ZeRO-1 (`--zero 1`, `mp_toolkit.engine.zero`): the same training as plain data parallelism, with
the fp32 masters and the optimizer state partitioned over each stage's data-parallel replicas.

Equivalence (tests/zero_workers.py): gpt-tiny, 3 steps of 2 micro-batches per replica, global-norm
clipping at 0.4 that binds on every step, trained with and without ZeRO-1 on dp=2, pp=2 x dp=2 and
tp=2 x dp=2, for AdamW, LAMB (with ~1 KiB buckets: dozens of tensors split between the two
replicas' pieces), LARS, and AdamW in fp16 with an inf injected into one rank's gradient at step 2;
LAMB once more with the reduce-scatter and all-gather collectives that NCCL runs (under gloo
ZeRO-1 all-reduces and broadcasts in place instead: `mp_toolkit.parallel.zero`).

What differs, and the bound: the gradients, their mean and every element-wise update are the same
arithmetic (reduce-scatter and all-reduce of two replicas add the same two numbers), but the
global norm is summed from pieces (fp64 squares over every rank) where plain data parallelism
takes a norm of whole-tensor norms, and LAMB / LARS sum a split tensor's norms from its pieces'
chunks: a rounding apart (~1e-7 relative on the norm). So: the whole model (every master weight,
end to end) is within 1e-6 relative of the run without ZeRO, and so are the losses, the norms and
the trust ratios. Per tensor, AdamW turns that rounding into larger relative moves where a
gradient is rounding noise (the attention key bias, whose exact gradient is zero: Adam divides it
by its own root mean square; measured 3e-6 at pp=2 with a clip of 0.05, 5e-8 with this test's
0.4), so each fp32 tensor is bounded, as in
the oracle, by `floor.K` times the single process's own fp32 error against float64
(tests/floor.py, DESIGN.md invariant 10).

Exact: the skip decisions of every step on every rank; a step skipped for overflow leaves every
parameter, piece and optimizer state tensor bitwise unchanged; the optimizer state elements a rank
holds are 1/dp of the unsharded state (summed over the replicas: exactly the unsharded count),
counted from the state tensors; LAMB and LARS make exactly one all-reduce over the dp group per
step (the split tensors' partial sums), AdamW none.
"""

import json
import time

import pytest

from mp_toolkit.cli import main
from mp_toolkit.ds.config import read_ds_config
from mp_toolkit.partition.cost import bytes_per_param
from mp_toolkit.partition.planner import PlanRequest, make_plan
from mp_toolkit.run.config import ConfigError
from tests.dist_harness import run_world
from tests.floor import assert_all_within, assert_within, pair
from tests.test_resume import BASE, losses, mpt, train
from tests.zero_workers import Case, compare

TIGHT = 1e-6
CASES = [Case("adamw"), Case("lamb", bucket_mb=0.001), Case("lars"),
         Case("adamw", precision="fp16", overflow_step=2), Case("lamb", bucket_mb=0.001, in_place=False)]


def _close(a, b) -> bool:
    return abs(a - b) <= TIGHT * max(abs(a), abs(b))


def _check(results, layout) -> float:
    pp, tp, dp = layout
    worst = 0.0
    for i, case in enumerate(CASES):
        cases = [r["cases"][i] for r in results]
        for c in cases:
            what = f"{layout} {case}"
            plain_skips, zero_skips = c["skipped"]
            assert plain_skips == zero_skips == [s == case.overflow_step for s in (1, 2, 3)], what
            if case.overflow_step:
                assert c["unchanged"] == (True, True), f"{what}: the skipped step changed state"
            assert c["model_err"] <= TIGHT, f"{what}: whole model {c['model_err']:.2e}"
            assert c["loss_err"] <= TIGHT and c["norm_err"] <= TIGHT, what
            assert all(n > 0.4 for n in c["norms"] if n == n), f"{what}: clipping must bind: {c['norms']}"
            plain_rows, zero_rows = c["trust"]
            if plain_rows is not None:
                assert [r["stage"] for r in zero_rows] == list(range(pp))
                assert all(_close(a[k], b[k]) for a, b in zip(plain_rows, zero_rows) for k in ("min", "median", "max"))
            if c["floors"]:
                worst = max(worst, assert_all_within(c["floors"], what))
            plain_calls, zero_calls = c["dp_calls"]
            assert plain_calls == [0] * len(plain_calls)
            expected = 1 if case.optimizer in ("lamb", "lars") else 0
            assert zero_calls == [expected] * len(zero_calls) and len(zero_calls) == 3 - bool(case.overflow_step), what
        # optimizer state: 1/dp per replica, measured from the tensors
        for r, c in zip(results, cases):
            plain_state, zero_state = c["state"]
            kinds = plain_state // c["model_numel"]
            assert kinds * c["model_numel"] == plain_state and kinds >= 1
            assert abs(zero_state - plain_state / dp) <= kinds * c["buckets"] * dp, (zero_state, plain_state)
            replicas = [x["state"][1] for q, x in zip(results, cases) if q["coords"][:2] == r["coords"][:2]]
            assert sum(replicas) == plain_state and len(replicas) == dp
    return worst


@pytest.mark.parametrize("layout", [(1, 1, 2), (2, 1, 2), (1, 2, 2)],
                         ids=lambda layout: "pp{}-tp{}-dp{}".format(*layout))
def test_zero1_equals_plain_data_parallelism(layout):
    pp, tp, dp = layout
    t0 = time.perf_counter()
    results = run_world(compare, pp * tp * dp, pp, tp, dp, CASES, timeout_s=900)
    worst = _check(results, layout)
    errs = {f"{c['case'].optimizer}-{c['case'].precision}{'-rs/ag' if c['case'].in_place is False else ''}":
            max(c["errors"].values()) for c in results[0]["cases"]}
    print(f"\n{layout}: {time.perf_counter() - t0:.1f}s; worst per-tensor relative difference from plain dp: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()) + f"; worst err / floor {worst:.2f}")


# -- checkpoints: a ZeRO-1 checkpoint is an ordinary one ---------------------------------------------

LAMB = ["--optimizer", "lamb", "--clip-grad", "0.3", "--warmup-steps", "2", "--lr-decay", "cosine", "--steps", "6",
        "--pp", "1"]


def test_a_zero1_checkpoint_resumes_without_zero_at_dp2_and_dp1(tmp_path):
    """Save at step 3 of a ZeRO-1 dp=2 run; resume (a) with ZeRO-1 on dp=2: bitwise the uninterrupted
    run; (b) without ZeRO on dp=2 and (c) on one rank (6 micro-batches: the same 12 sequences a
    step): the losses of steps 4-6 continue those of an uninterrupted run on that layout within the
    floor that the ZeRO run itself sets (tests/floor.py: an equally valid fp32 run in another
    reduction order), and every checkpointed tensor likewise."""
    zero_rows, out = train(tmp_path, "zero", *LAMB, "--dp", "2", "--zero", "1", "--save-dir", str(tmp_path / "z"),
                           "--save-every", "3")
    assert "ZeRO-1 (masters and optimizer state 1/2 per replica)" in out, out
    source = tmp_path / "z" / "step-00000003"
    again, _ = train(tmp_path, "again", *LAMB, "--dp", "2", "--zero", "1", "--save-dir", str(tmp_path / "z2"),
                     "--resume", str(source))
    assert losses(again, [4, 5, 6]) == losses(zero_rows, [4, 5, 6])
    for name, layout, m in (("dp2", ["--dp", "2"], 3), ("dp1", ["--dp", "1"], 6)):
        ref_rows, _ = train(tmp_path, f"ref-{name}", *LAMB, *layout, microbatches=m)
        rows, out = train(tmp_path, f"resumed-{name}", *LAMB, *layout, "--resume", str(source),
                          "--save-dir", str(tmp_path / name), microbatches=m)
        assert "resumed from" in out and "ZeRO-1 (masters" not in out, out
        assert_within(*pair(losses(rows, [4, 5, 6]), losses(ref_rows, [4, 5, 6]), losses(zero_rows, [4, 5, 6])),
                      f"{name}: losses after resuming a ZeRO-1 checkpoint")


# -- the DeepSpeed key and the flag --------------------------------------------------------------------

BASE_DS = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2}


@pytest.mark.parametrize("zero,stage", [({"stage": 1, "reduce_bucket_size": 5e8}, 1), (True, 1),
                                        ({"stage": 0}, 0), (False, 0)])
def test_deepspeed_zero_stage_1_is_read(zero, stage):
    s = read_ds_config({**BASE_DS, "zero_optimization": zero}, dp=2)
    assert s.zero == stage and s.train_config_overrides().get("zero", 0) == stage
    if isinstance(zero, dict) and stage == 1:
        assert s.ignored == ("zero_optimization.reduce_bucket_size",)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_stages_2_and_3_are_refused_naming_the_key(stage):
    with pytest.raises(ConfigError, match=f"zero_optimization.stage {stage}: mp_toolkit implements ZeRO stage 1"):
        read_ds_config({**BASE_DS, "zero_optimization": {"stage": stage}}, dp=2)


def test_the_deepspeed_key_is_applied_by_mpt_train(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                  "zero_optimization": {"stage": 1}}))
    rows, out = train(tmp_path, "ds", "--config", str(config), "--pp", "1", "--dp", "2", "--steps", "2",
                      microbatches=2, base=[*BASE, "--optimizer", "lamb"])
    assert "ZeRO-1 (masters and optimizer state 1/2 per replica)" in out and len(rows) == 2, out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}))
    r = mpt(*BASE, "--config", str(bad), "--pp", "1", "--dp", "2", "--steps", "1")
    assert r.returncode == 2 and "zero_optimization.stage 2" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_zero_stage_flag_is_checked():
    r = mpt(*BASE, "--pp", "1", "--dp", "2", "--zero", "2", "--steps", "1")
    assert r.returncode == 2 and "--zero 2" in r.stderr, r.stderr


# -- the planner ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision,optimizer,dp,plain,zero", [
    ("fp32", "adamw", 2, 16, 12), ("fp32", "adamw", 4, 16, 10), ("bf16", "adamw", 4, 16, 7),
    ("fp16", "lamb", 2, 16, 10), ("fp32", "lars", 2, 12, 10), ("fp32", "sgd", 1, 12, 12)])
def test_static_bytes_per_parameter_with_zero1(precision, optimizer, dp, plain, zero):
    """fp32 + Adam: 4 weight + 4 gradient stay, 8 of state divide: 16 -> 8 + 8/dp; fp16 / bf16: the
    2-byte weight and gradient stay, the fp32 master and the state divide: 16 -> 4 + 12/dp (the
    fp32 master gradient lives only during the step, `step_bytes_per_param`)."""
    assert bytes_per_param(precision, optimizer) == plain
    assert bytes_per_param(precision, optimizer, zero_dp=dp) == zero


def test_mpt_plan_zero1_lowers_each_stage_by_the_partitioned_bytes(capsys):
    common = dict(model="gpt-small-cpu", pp=2, dp=2, micro_batch=4, microbatches=4, seq_len=64, tflops=0.1)
    plain, zero = make_plan(PlanRequest(**common)), make_plan(PlanRequest(**common, zero=1))
    assert [s.params for s in plain.stages] == [s.params for s in zero.stages]
    for a, b in zip(plain.stages, zero.stages):  # AdamW fp32: 16 -> 12 bytes per parameter at dp 2
        assert a.memory_bytes - b.memory_bytes == pytest.approx(4 * a.params, rel=1e-9)
    assert main(["plan", "--model", "gpt-tiny", "--pp", "2", "--dp", "2", "--zero", "1", "--seq-len", "16",
                 "--tflops", "0.05"]) == 0
    assert "ZeRO-1" in capsys.readouterr().out.splitlines()[0]
