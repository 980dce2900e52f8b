"""The run plan (`mp_toolkit.run.plan`): an `mpt train` run decided once, as the CLI decides it.

Each schedule candidate is planned once and the winner's plan is the run's prediction; a rank that
`mpt train` started receives the plan and plans nothing; ``--precision auto`` is resolved before any
check, so ``--dry-run`` and the DeepSpeed engine's checks see the precision the ranks train in.
"""

import json

import pytest
import torch

from mp_toolkit.cli import build_parser, main
from mp_toolkit.commands.train import plan_run
from mp_toolkit.optim.master import resolve_precision
from mp_toolkit.partition import auto_schedule, planner
from mp_toolkit.partition.auto_schedule import CANDIDATES
from mp_toolkit.run import predict, recompute_plan
from mp_toolkit.run.config import TrainConfig
from mp_toolkit.run.plan import RunPlan
from mp_toolkit.run.recompute_plan import default_candidates

TINY = ["--model", "gpt-tiny", "--seq-len", "64", "--pp", "2", "--data", "synthetic", "--microbatches", "4"]
PLANNING = (planner, auto_schedule, predict, recompute_plan)
"""Every module that calls `planner.make_plan` by name on the way to a run plan."""


def _count_plans(monkeypatch, fail: bool = False) -> list:
    """Wrap `make_plan` wherever the run plan reaches it; the list grows by one request per call
    (``fail``: a call is an error)."""
    calls, real = [], planner.make_plan

    def counted(request):
        if fail:
            raise AssertionError(f"planned {request} where nothing should be planned")
        calls.append(request)
        return real(request)

    for module in PLANNING:
        if hasattr(module, "make_plan"):
            monkeypatch.setattr(module, "make_plan", counted)
    return calls


def _plan(*flags: str) -> RunPlan:
    return plan_run(build_parser().parse_args(["train", *TINY, *flags]))


def test_the_default_schedule_plans_each_candidate_once_and_predicts_from_the_winner(monkeypatch):
    calls = _count_plans(monkeypatch)
    run = _plan()
    cfg = TrainConfig.of(model="gpt-tiny", seq_len=64, pp=2, microbatches=4, data="synthetic")
    assert [r.schedule for r in calls] == list(default_candidates(cfg))  # nothing planned twice
    assert run.prediction is not None and run.prediction.request.schedule == run.cfg.parallel.schedule
    assert tuple(run.prediction.boundaries) == run.boundaries
    assert run.stage_bytes == tuple(s.memory_bytes for s in run.prediction.stages)
    assert run.schedule.num_stages == len(run.boundaries) - 1 == run.cfg.parallel.pp * run.cfg.parallel.chunks


def test_the_default_schedule_is_planned_on_the_partition_cut(monkeypatch):
    """Issue 36: every candidate is planned on the cut the run trains (--partition's), so the winner's plan
    is the run's prediction and nothing is planned again."""
    calls = _count_plans(monkeypatch)
    run = _plan("--partition", "0,2,7")
    assert run.boundaries == (0, 2, 7)
    assert [r.schedule for r in calls] == ["1f1b", "zbdrain", "zbh1"]  # interleaved would re-cut: left out
    assert all(r.boundaries == (0, 2, 7) for r in calls) and run.prediction.request in calls
    assert run.prediction.request.schedule == run.cfg.parallel.schedule


def test_a_named_schedule_plans_only_the_prediction(monkeypatch):
    calls = _count_plans(monkeypatch)
    run = _plan("--schedule", "gpipe")
    assert len(calls) == 1 and run.cfg.parallel.schedule == "gpipe" and run.notes == ()


def test_recompute_auto_takes_its_cut_from_the_winning_candidate(monkeypatch):
    calls = _count_plans(monkeypatch)
    run = _plan("--schedule", "auto", "--recompute", "auto", "--memory-gb", "1")
    assert [r.schedule for r in calls] == list(CANDIDATES)  # the cut and the prediction are the winner's
    assert run.prediction.request.recompute == "auto" and run.boundaries == tuple(run.prediction.boundaries)
    assert len(run.recompute) == len(run.boundaries) - 1


@pytest.mark.parametrize("flags", [(), ("--schedule", "interleaved", "--recompute", "full", "--recompute-layers", "1")])
def test_a_rank_started_by_mpt_receives_the_plan_and_plans_nothing(monkeypatch, flags):
    run = _plan(*flags)
    doc = json.loads(json.dumps(run.to_json()))  # as MPT_RUN_PLAN carries it
    _count_plans(monkeypatch, fail=True)
    given = TrainConfig.of(model="gpt-tiny", seq_len=64, pp=2, microbatches=4, data="synthetic",
                           **({"schedule": "interleaved", "chunks": 2, "recompute": "full", "recompute_layers": (1,)}
                              if flags else {}))
    received = RunPlan.received(given, doc)
    assert received.cfg == run.cfg and received.spec == run.spec
    assert (received.boundaries, received.recompute, received.stage_bytes) == \
        (run.boundaries, run.recompute, run.stage_bytes)
    assert received.schedule.actions == run.schedule.actions
    assert [received.predicted_rank_bytes(r) for r in range(2)] == [run.predicted_rank_bytes(r) for r in range(2)]
    assert all(run.predicted_rank_bytes(r) > 0 for r in range(2))


def test_a_run_plan_from_elsewhere_is_refused_in_one_line():
    with pytest.raises(ValueError, match="MPT_RUN_PLAN is not a run plan"):
        RunPlan.received(TrainConfig.of(model="gpt-tiny", seq_len=64), {"format": 99})


def test_dry_run_plans_the_precision_the_ranks_train_in(capsys):
    """``--precision auto`` resolves before every check: the dry run names what the ranks would train
    in, and DeepSpeed's refusal of bf16 with LAMB comes before any rank starts where auto means bf16."""
    here = resolve_precision("auto", torch.device("cpu"))
    assert main(["train", *TINY, "--precision", "auto", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"precision {here}, " in out and f", {here}, " in out  # the run's line and mpt plan's table
    code = main(["train", *TINY, "--precision", "auto", "--engine", "deepspeed", "--optimizer", "lamb",
                 "--schedule", "1f1b", "--dry-run"])
    err = capsys.readouterr().err
    if here == "bf16":
        assert code == 2 and "--optimizer lamb with --precision bf16 and --engine deepspeed" in err
    else:
        assert code == 0 and err == ""


def test_resolving_a_run_leaves_torchs_random_state_alone():
    """The checks build the model on meta (its init seed drawn from torch's generator): a run plan
    resolved between ``torch.manual_seed`` and the model's build must not move the weights."""
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    _plan()
    assert torch.equal(torch.random.get_rng_state(), before)


def test_async_save_adds_each_writers_copy_to_its_prediction():
    """--async-save: 4 + 8 bytes per parameter with AdamW (fp32 tensor and two moments) per stage, carried
    to the ranks; without it, nothing."""
    assert _plan().stage_copy_bytes is None and _plan().copy_bytes(0) == 0
    run = _plan("--async-save", "--save-dir", "unused")
    assert run.stage_copy_bytes == tuple(12 * s.params for s in run.prediction.stages)
    given = TrainConfig.of(model="gpt-tiny", seq_len=64, pp=2, microbatches=4, data="synthetic", async_save=True,
                           save_dir="unused")
    received = RunPlan.received(given, json.loads(json.dumps(run.to_json())))
    assert [received.copy_bytes(r) for r in range(2)] == [run.copy_bytes(r) for r in range(2)]
    assert sum(run.copy_bytes(r) for r in range(2)) == 12 * sum(s.params for s in run.prediction.stages)
