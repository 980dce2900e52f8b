"""What each optimizer keeps and makes per parameter (`mp_toolkit.partition.cost.OPTIMIZER_BYTES`)
against the real optimizers the run builds (`mp_toolkit.optim.factory.build_optimizer`), at their
default momentum and weight decay and without them; and the planner charging a run's own (issue 34
item 8: SGD without momentum or decay holds 8 bytes per parameter, not 12, and makes no temporary)."""

import pytest
import torch

from mp_toolkit.errors import PartitionError
from mp_toolkit.optim.factory import build_optimizer
from mp_toolkit.optim.settings import Optim
from mp_toolkit.partition.cost import OPTIMIZER_BYTES, OPTIMIZER_STATE_BYTES, bytes_per_param, step_bytes_per_param
from mp_toolkit.partition.planner import PlanRequest, make_plan
from tests.new_tensors import NewTensors


def measured(optimizer: str, **options) -> tuple[float, float]:
    """(state bytes, peak bytes the step makes) per parameter of ``optimizer``'s second step over a
    512 x 512 matrix and its bias (named as a block's, so LAMB and LARS decay the one, not the other)."""
    torch.manual_seed(0)
    named = [("h.0.mlp.fc.weight", torch.nn.Parameter(torch.randn(512, 512))),
             ("h.0.mlp.fc.bias", torch.nn.Parameter(torch.randn(512)))]
    n = sum(p.numel() for _, p in named)
    opt = build_optimizer(Optim(optimizer, **options), named)
    for _ in range(2):  # the first step makes the state; the second is every later one
        for _, p in named:
            p.grad = torch.randn_like(p)
        counter = NewTensors()
        with counter:
            opt.step()
    state = sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return state / n, counter.peak / n


CASES = [(name, {}) for name in OPTIMIZER_BYTES] + [(name, {"weight_decay": 0.0}) for name in OPTIMIZER_BYTES] + [
    (name, options) for name in ("sgd", "lars", "rmsprop")
    for options in ({"momentum": 0.0}, {"momentum": 0.5}, {"momentum": 0.0, "weight_decay": 0.0})]


@pytest.mark.parametrize("optimizer,options", CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_state_and_step_bytes_are_what_the_optimizer_keeps_and_makes(optimizer, options):
    record = OPTIMIZER_BYTES[optimizer]
    state, step = measured(optimizer, **options)
    assert state == record.state_bytes(options.get("momentum"))
    # LAMB's fixed scratch, norms and per-group order leave less than 1% of a byte per parameter
    assert step == pytest.approx(record.step_bytes(options.get("weight_decay", 0.01)), abs=0.01)


def test_the_defaults_keep_todays_figures():
    """None momentum and the default weight decay: 16 B/param for Adam and LAMB, 12 for SGD and LARS."""
    assert OPTIMIZER_STATE_BYTES == {"adamw": 8, "adam": 8, "lamb": 8, "lars": 4, "sgd": 4, "adagrad": 4, "rmsprop": 4}
    assert [step_bytes_per_param("fp32", name) for name in OPTIMIZER_BYTES] == [0, 0, 0, 4, 4, 8, 8]
    assert bytes_per_param("fp32", "sgd") == 12 and bytes_per_param("fp32", "sgd", momentum=0) == 8
    assert bytes_per_param("bf16", "rmsprop", momentum=0.9) == 16 and bytes_per_param("bf16", "rmsprop") == 12
    assert step_bytes_per_param("bf16", "sgd", weight_decay=0) == 2  # the fp32 master gradient only


def test_the_plan_charges_the_runs_momentum_and_decay():
    """SGD: the momentum buffer is 4 bytes per parameter held, the decayed copy 4 made by the step
    (larger than what the schedule keeps here: it is the stage's peak); without either a stage is its
    weights and gradients plus what the schedule keeps (one micro-batch: nothing accumulates)."""
    base = dict(model="gpt-small-cpu", pp=2, micro_batch=1, microbatches=1, seq_len=16, tflops=1.0,
                optimizer="sgd", method="uniform")
    default = make_plan(PlanRequest(**base))
    decayed = make_plan(PlanRequest(**base, momentum=0))
    plain = make_plan(PlanRequest(**base, momentum=0, weight_decay=0))
    for d, m, p in zip(default.stages, decayed.stages, plain.stages):
        assert d.memory_bytes - m.memory_bytes == 4 * d.params  # the momentum buffer
        fixed = m.memory_bytes - 12 * m.params  # weights, gradients, the decayed copy; receive buffers
        kept = p.memory_bytes - 8 * p.params - fixed  # no step temporary: the schedule's peak counts
        assert 0 < kept < 4 * p.params


@pytest.mark.parametrize("fields,message", [
    (dict(optimizer="adamw", momentum=0.9), "--momentum 0.9 is not an option of --optimizer adamw: it applies to "
                                            "lars, sgd, rmsprop"),
    (dict(optimizer="sgd", momentum=1.0), "--momentum 1 must be in [0, 1)"),
    (dict(weight_decay=-0.1), "--weight-decay -0.1 must be a non-negative finite number"),
])
def test_a_bad_momentum_or_decay_is_one_line(fields, message):
    with pytest.raises(PartitionError) as e:
        make_plan(PlanRequest(model="gpt-tiny", pp=2, seq_len=16, tflops=1.0, **fields))
    assert str(e.value) == message
