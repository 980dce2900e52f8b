"""Freeing sent stage outputs (issue 18, item 5): storage released, graph and gradients unchanged.

Each case trains the same 2-stage pipeline twice on 2 gloo ranks, with ``free_sent_outputs`` on
and off, and records on the sending stage (rank 0) the storage of each stored output just before
its backward (B, or I under ZB-H1). On: the storage is one element where the rules of
`mp_toolkit.engine.free_sent` allow it, whole where they do not; the gradients of every step are
bitwise those of off either way.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from model_zoo.gpt import GPT, GPTConfig, lm_loss
from mp_toolkit.engine.free_sent import releasable
from mp_toolkit.engine.pipeline import PipelineEngine
from mp_toolkit.layers import LayerList
from mp_toolkit.parallel.context import build_context
from mp_toolkit.schedule import Action, Kind, get_schedule
from mp_toolkit.schedule.completion import comm_batches, runs_with_waits, send_waits, sends_known_received
from tests.dist_harness import run_world

CFG = GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=False)
B, T, M, STEPS, WIDTH = 2, 16, 4, 2, 24


class Tanh(nn.Module):
    def forward(self, x):
        return torch.tanh(x)  # TanhBackward saves its result: the output must stay


class Reshaped(nn.Module):
    def forward(self, x):
        return x.view(x.shape[0], -1).view(x.shape)  # a view of the Linear's output


def gpt_layers() -> LayerList:
    return LayerList.from_model(GPT(CFG))  # embed, h.0, h.1, ln_f, lm_head: cut at 2


def ending_in(last: nn.Module):
    """Linear -> ``last`` | Linear: stage 0's output is ``last``'s, cut at 2."""
    def build() -> LayerList:
        return LayerList([("fc0", nn.Linear(WIDTH, WIDTH)), ("end", last), ("fc1", nn.Linear(WIDTH, WIDTH))])
    return build


MODELS = {"gpt": (gpt_layers, 2, lm_loss), "tanh": (ending_in(Tanh()), 2, nn.functional.mse_loss),
          "view": (ending_in(Reshaped()), 2, nn.functional.mse_loss)}


def batches(model: str):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        if model == "gpt":
            seqs = [torch.randint(0, CFG.vocab_size, (B, T + 1), generator=g) for _ in range(M)]
            out.append([(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seqs])
        else:
            out.append([(torch.randn(B, WIDTH, generator=g), torch.randn(B, WIDTH, generator=g)) for _ in range(M)])
    return out


class GradsBeforeStep:
    """Stands in for the engine's OptimizerStep: keeps a copy of every gradient, then steps."""

    def __init__(self, step, params):
        self.inner, self.params, self.grads = step, params, []

    @property
    def loss_scale(self) -> float:
        return self.inner.loss_scale

    def __call__(self, **kwargs):
        self.grads.append([p.grad.clone() for p in self.params])
        return self.inner(**kwargs)


def train(rank: int, world: int, model: str, schedule: str, precision: str, free: bool) -> dict:
    """Train STEPS steps; return the gradients per step, the losses, and on rank 0 the storage
    bytes of each stored output just before its backward."""
    build, cut, loss_fn = MODELS[model]
    torch.manual_seed(0)
    layers = build()
    engine = PipelineEngine(layers, build_context(world), [0, cut, len(layers)], M, schedule,
                            optimizer=lambda ps: torch.optim.SGD([p for _, p in ps], lr=0.1),
                            loss_fn=loss_fn, precision=precision, free_sent_outputs=free)
    engine.step = GradsBeforeStep(engine.step, [p for _, p in engine.named_parameters()])
    data = batches(model)
    seen, freed, losses = [], [], []
    for step, mbs in enumerate(data):
        if step == 1:  # the executor exists after the first batch: watch its backward handlers
            watch(engine.executor, seen)
        losses.append(engine.train_batch(iter(mbs)).loss)
        freed.append(engine.executor.freed_bytes)
    return {"grads": engine.step.grads, "losses": losses, "seen": seen, "freed": freed}


def watch(executor, seen: list) -> None:
    """Record (full bytes, stored bytes, releasable) of stage 0's outputs before each B or I."""
    for kind in (Kind.B, Kind.I):
        inner = executor.handlers[kind]

        def handler(a, inner=inner):
            if a.stage == 0 and executor.rank == 0:
                (out,) = executor._outputs[(0, a.microbatch)][1]
                seen.append((out.nelement() * out.element_size(), out.untyped_storage().nbytes()))
            inner(a)
        executor.handlers[kind] = handler


def both(model: str, schedule: str, precision: str = "fp32"):
    on = run_world(train, 2, model, schedule, precision, True, timeout_s=180)
    off = run_world(train, 2, model, schedule, precision, False, timeout_s=180)
    for r_on, r_off in zip(on, off):
        assert r_on["losses"] == r_off["losses"]
        assert len(r_on["grads"]) == STEPS
        for g_on, g_off in zip(r_on["grads"], r_off["grads"]):
            assert all(torch.equal(a, b) for a, b in zip(g_on, g_off)), "gradients differ with outputs freed"
    return on, off


@pytest.mark.parametrize("schedule, precision", [("1f1b", "fp32"), ("zbh1", "fp32"), ("1f1b", "bf16")])
def test_sent_output_storage_released_and_gradients_bitwise(schedule, precision):
    on, off = both("gpt", schedule, precision)
    full = B * T * CFG.n_embd * (4 if precision == "fp32" else 2)
    elem = 4 if precision == "fp32" else 2
    # rank 0, with freeing: every output was sent and released before its backward
    assert len(on[0]["seen"]) == M
    assert on[0]["seen"] == [(elem, elem)] * M
    assert on[0]["freed"] == [M * full] * STEPS
    # without: kept whole; and the last stage sends no output, so frees nothing
    assert off[0]["seen"] == [(full, full)] * M
    assert off[0]["freed"] == [0] * STEPS and on[1]["freed"] == [0] * STEPS


@pytest.mark.parametrize("model", ["tanh", "view"])
def test_output_read_by_its_backward_or_a_view_is_kept(model):
    on, off = both(model, "1f1b")
    full = B * WIDTH * 4
    assert on[0]["seen"] == off[0]["seen"] == [(full, full)] * M
    assert on[0]["freed"] == [0] * STEPS


def test_releasable_rules():
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)
    plain = x @ w
    assert releasable(plain)
    assert not releasable(torch.tanh(x @ w))            # saves its result
    assert not releasable((x @ w).view(-1))             # a view
    assert not releasable(x) and not releasable(w)      # no grad_fn: data, a leaf
    assert not releasable((x @ w).long())               # not floating
    held = x @ w
    _ = held * held                                     # MulBackward saved it: still read
    assert not releasable(held)
    alias = x @ w
    copy = alias.detach()                               # another tensor on the same storage
    assert not releasable(alias)
    del copy
    assert releasable(alias)


@pytest.mark.parametrize("plan_of", [send_waits, sends_known_received], ids=["send_waits", "clocks"])
def test_every_schedule_frees_each_send_before_its_backward(plan_of):
    """Both plans wait for each SEND_F at or before the receive of its gradient and run every
    schedule to its end: each stored output is freed before its backward, and nothing deadlocks."""
    for name, pp, chunks in [("gpipe", 2, 1), ("1f1b", 2, 1), ("zbh1", 2, 1), ("interleaved", 2, 2),
                             ("1f1b", 4, 1), ("interleaved", 4, 2), ("zbh1", 4, 1), ("zbdrain", 2, 1),
                             ("zbdrain", 4, 1)]:
        schedule = get_schedule(name, pp, 8, chunks=chunks)
        assert runs_with_waits(schedule, plan_of(schedule)), name
        for rank, plan in enumerate(plan_of(schedule)):
            acts = schedule.actions[rank]
            when = {pos: last for last, sends in plan.items() for pos in sends}
            for pos, a in enumerate(acts):
                if a.kind is Kind.SEND_F and plan_of is sends_known_received and pos not in when:
                    continue  # the clocks leave some sends to the end of the step (not the eager plan)
                if a.kind is Kind.SEND_F:
                    recv_b = acts.index(Action(a.stage, Kind.RECV_B, a.microbatch))
                    assert pos in when and pos <= when[pos] <= recv_b, (name, rank, a)


def test_waits_that_would_deadlock_fall_back_to_the_clocks():
    """Interleaved 1F1B on 4 ranks deadlocks if every forward send is waited for at once (a rank
    waits for a peer that waits for it); `send_waits` then keeps to what the clocks prove."""
    schedule = get_schedule("interleaved", 4, 8, chunks=2)
    eager = [{last: [p for p in range(first, last + 1) if acts[p].kind is Kind.SEND_F]
              for first, last in comm_batches(acts)} for acts in schedule.actions]
    assert not runs_with_waits(schedule, eager)
    assert send_waits(schedule) != eager and runs_with_waits(schedule, send_waits(schedule))
    # 1F1B runs with them: each forward send is waited for at the end of the batch that posts it
    one_f_one_b = get_schedule("1f1b", 4, 8)
    for acts, plan in zip(one_f_one_b.actions, send_waits(one_f_one_b)):
        for first, last in comm_batches(acts):
            assert plan.get(last, []) == [p for p in range(first, last + 1) if acts[p].kind is Kind.SEND_F]
