"""LAMB and LARS against independent fp64 implementations of the papers' formulas, written here
element by element (You et al. 2019, Algorithm 2; You et al. 2017, Algorithm 1, and apex's LARC).

Tolerance: the optimizers run in fp32 and the references in fp64, so after 10 steps every element
agrees to 1e-6 of its value or of its tensor's largest element (``close``: fp32 rounding of
intermediate values of that size, e.g. momentum buffers; near-zero elements need the second
clause), and trust ratios to ``rel=1e-6`` (fp32 norms; nothing else may differ).
"""

import math

import pytest
import torch

import mp_toolkit.optim.lamb as lamb_module
from mp_toolkit.optim.groups import lamb_param_groups
from mp_toolkit.optim.lamb import LAMB
from mp_toolkit.optim.lars import LARS
from tests.dist_harness import run_world
from tests.lamb_workers import sharded_cases

STEPS = 10


def close(got, want):
    """Elementwise within 1e-6 of the value or of the tensor's largest element (see the docstring)."""
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()) + 1e-12)

# (shape, weight scale, gradient scale): a matrix, a 1-D tensor, a zero tensor, a 3-D tensor, and
# a vector that spans several waves when the wave is cut to 64 elements. The scales put LAMB's
# trust ratio of tensor 0 above 2 and of tensor 3 below 0.1, and LARS's rate of tensor 4 above lr.
TENSORS = [((24, 16), 3.0, 1.0), ((40,), 0.05, 0.3), ((8, 8), 0.0, 1.0), ((3, 5, 7), 0.02, 1.0), ((300,), 0.5, 1e-3)]


def make_data(seed=0, tensors=TENSORS, steps=STEPS):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) * w for s, w, _ in tensors]
    grads = [[torch.randn(s, generator=gen) * g for s, _, g in tensors] for _ in range(steps)]
    return init, grads


def reference_lamb(init, grads, hp):
    """Algorithm 2 per tensor, in fp64; hp[i] holds tensor i's hyper-parameters."""
    ws = [w.double().clone() for w in init]
    ms, vs = [torch.zeros_like(w) for w in ws], [torch.zeros_like(w) for w in ws]
    trusts = []
    for t, step_grads in enumerate(grads, start=1):
        gs = [g.double() for g in step_grads]
        if hp[0].get("max_grad_norm"):  # NVLAMB: one global norm over every tensor
            norm = math.sqrt(sum(float((g * g).sum()) for g in gs))
            gs = [g / max(1.0, norm / hp[0]["max_grad_norm"]) for g in gs]
        trusts = []
        for i, (w, g, h) in enumerate(zip(ws, gs, hp)):
            b1, b2 = h["betas"]
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            m_hat = ms[i] / (1 - b1 ** t) if h["bias_correction"] else ms[i]
            v_hat = vs[i] / (1 - b2 ** t) if h["bias_correction"] else vs[i]
            u = m_hat / (torch.sqrt(v_hat) + h["eps"]) + h["weight_decay"] * w
            w_norm, u_norm = math.sqrt(float((w * w).sum())), math.sqrt(float((u * u).sum()))
            trust = 1.0
            if h["adapt"] and w_norm > 0 and u_norm > 0:
                trust = w_norm / u_norm
                trust = max(trust, h["min_trust"]) if h["min_trust"] is not None else trust
                trust = min(trust, h["max_trust"]) if h["max_trust"] is not None else trust
            ws[i] = w - h["lr"] * trust * u
            trusts.append(trust)
    return ws, trusts


def reference_lars(init, grads, hp):
    """Algorithm 1 per tensor (LARC's clipping when clip), in fp64."""
    ws = [w.double().clone() for w in init]
    bufs = [torch.zeros_like(w) for w in ws]
    scales = []
    for step_grads in grads:
        scales = []
        for i, (w, g, h) in enumerate(zip(ws, [g.double() for g in step_grads], hp)):
            w_norm, g_norm = math.sqrt(float((w * w).sum())), math.sqrt(float((g * g).sum()))
            scale = 1.0
            if h["adapt"] and w_norm > 0 and g_norm > 0:
                scale = h["trust_coefficient"] * w_norm / (g_norm + h["weight_decay"] * w_norm + h["eps"])
                scale = min(scale / h["lr"], 1.0) if h["clip"] else scale
            d = g + h["weight_decay"] * w
            bufs[i] = h["momentum"] * bufs[i] + h["lr"] * scale * d
            step = h["momentum"] * bufs[i] + h["lr"] * scale * d if h["nesterov"] else bufs[i]
            ws[i] = w - step
            scales.append(scale)
    return ws, scales


def run(cls, init, grads, groups_hp, **kwargs):
    """Step ``cls`` over param groups built from (indices, group options); return params, ratios."""
    params = [torch.nn.Parameter(w.clone()) for w in init]
    opt = cls([dict(params=[params[i] for i in idx], **opts) for idx, opts in groups_hp], **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    ratios = opt.last_trust_ratios()
    return [p.detach() for p in params], [ratios[p] for p in params]


def per_tensor(opt_defaults, groups_hp, n):
    """Each tensor's effective hyper-parameters (defaults overridden by its group's options)."""
    hp = [None] * n
    for idx, opts in groups_hp:
        for i in idx:
            hp[i] = {**opt_defaults, **opts}
    return hp


LAMB_DEFAULTS = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True,
                     min_trust=None, max_trust=None, adapt=True)
PATHS = ["per-tensor", "foreach-fused", "foreach-plain"]


def set_path(monkeypatch, path):
    """Select LAMB's code path; waves cut to 64 elements so tensors span several waves."""
    monkeypatch.setitem(lamb_module._WAVE, "cpu", 64)
    monkeypatch.setattr(lamb_module, "_HAS_FUSED_ADAM", path != "foreach-plain")
    return path != "per-tensor"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clamp", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("adapt", [True, False])
def test_lamb_matches_algorithm_2(monkeypatch, path, clamp, weight_decay, adapt):
    foreach = set_path(monkeypatch, path)
    init, grads = make_data()
    trust = dict(min_trust=0.1, max_trust=2.0) if clamp else {}
    # Group 0 as lamb_param_groups' decay group; group 1 (the 1-D tensor) never decays nor adapts.
    groups = [([0, 2, 3, 4], dict(weight_decay=weight_decay, adapt=adapt, **trust)),
              ([1], dict(weight_decay=0.0, adapt=False))]
    got, ratios = run(LAMB, init, grads, groups, lr=1e-2, foreach=foreach)
    want, want_ratios = reference_lamb(init, grads, per_tensor(LAMB_DEFAULTS, groups, len(init)))
    for g, w in zip(got, want):
        close(g, w)
    assert ratios == pytest.approx(want_ratios, rel=1e-6)
    assert ratios[1] == 1.0
    if clamp and adapt:  # the clamp is really exercised: tensor 0 hits the top, tensor 3 the bottom
        assert ratios[0] == 2.0 and ratios[3] == pytest.approx(0.1, rel=1e-12)
    if not adapt:
        assert ratios == [1.0] * len(init)


@pytest.mark.parametrize("path", PATHS)
def test_lamb_without_bias_correction_and_with_nvlamb_prenormalisation(monkeypatch, path):
    foreach = set_path(monkeypatch, path)
    init, grads = make_data(seed=1)
    groups = [([0, 1, 2, 3, 4], dict(bias_correction=False, betas=(0.8, 0.99), eps=1e-4))]
    got, ratios = run(LAMB, init, grads, groups, lr=1e-2, foreach=foreach, max_grad_norm=1.0)
    hp = per_tensor({**LAMB_DEFAULTS, "max_grad_norm": 1.0}, groups, len(init))
    want, want_ratios = reference_lamb(init, grads, hp)
    for g, w in zip(got, want):
        close(g, w)
    assert ratios == pytest.approx(want_ratios, rel=1e-6)


def test_lamb_default_wave_on_a_large_tensor_and_grad_holds_the_update():
    """The real wave size (several waves in one 300k-element tensor); p.grad holds u afterwards.

    Trust ratios to 2e-6 here: an fp32 norm of 300k elements is good to about 1e-6."""
    init, grads = make_data(seed=2, tensors=[((600, 500), 0.1, 1.0), ((7,), 1.0, 1.0)], steps=2)
    want, want_ratios = reference_lamb(init, grads, per_tensor(LAMB_DEFAULTS, [([0, 1], {})], 2))
    for foreach in (True, False):
        got, ratios = run(LAMB, init, grads, [([0, 1], {})], foreach=foreach, lr=LAMB_DEFAULTS["lr"])
        for g, w in zip(got, want):
            close(g, w)
        assert ratios == pytest.approx(want_ratios, rel=2e-6)
    p = torch.nn.Parameter(init[0].clone())
    opt = LAMB([p], lr=0.5)
    p.grad = grads[0][0].clone()
    before = p.detach().clone()
    opt.step()
    torch.testing.assert_close(before - p.detach(), 0.5 * opt.last_trust_ratios()[p] * p.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("wave", [64, None])
@pytest.mark.parametrize("path", ["foreach-fused", "foreach-plain"])
def test_lamb_update_of_a_tensor_is_bitwise_independent_of_the_other_tensors(monkeypatch, wave, path):
    """A pipeline stage's optimizer holds a subset of the unsplit model's tensors: each tensor's
    update and trust ratio must be bitwise those of the optimizer over all tensors (the oracle)."""
    set_path(monkeypatch, path)
    big = ((30, 20), 0.1, 1.0)  # several 64-element waves; with the real wave size, several of those:
    if wave is None:
        monkeypatch.setitem(lamb_module._WAVE, "cpu", 1 << 18)
        big = ((600, 500), 0.1, 1.0)
    init, grads = make_data(seed=6, tensors=TENSORS + [big], steps=3)
    whole, whole_ratios = run(LAMB, init, grads, [(list(range(6)), {})])
    for stages in ([[0, 1, 2], [3, 4, 5]], [[1, 4], [0, 2, 3, 5]]):
        for stage in stages:
            sub = [init[i] for i in stage]
            got, ratios = run(LAMB, sub, [[g[i] for i in stage] for g in grads], [(list(range(len(stage))), {})])
            for j, i in enumerate(stage):
                assert torch.equal(got[j], whole[i]), (stage, i)
                assert ratios[j] == whole_ratios[i]


def test_lamb_state_dict_round_trip_resumes_exactly():
    init, grads = make_data(seed=3)
    straight, _ = run(LAMB, init, grads, [([0, 1, 2, 3, 4], {})])
    params = [torch.nn.Parameter(w.clone()) for w in init]
    opt = LAMB(params)
    for i, step_grads in enumerate(grads):
        if i == 4:  # rebuild the optimizer from its state dict half-way
            saved = opt.state_dict()
            opt = LAMB(params)
            opt.load_state_dict(saved)
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    for a, b in zip(params, straight):
        assert torch.equal(a.detach(), b)


LARS_DEFAULTS = dict(lr=0.1, momentum=0.9, weight_decay=0.0, trust_coefficient=0.02, eps=1e-8, nesterov=False,
                     clip=False, adapt=True)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
@pytest.mark.parametrize("adapt", [True, False])
@pytest.mark.parametrize("momentum,nesterov", [(0.9, False), (0.9, True), (0.0, False)])
def test_lars_matches_algorithm_1(foreach, clip, weight_decay, adapt, momentum, nesterov):
    init, grads = make_data(seed=4)
    groups = [([0, 2, 3, 4], dict(weight_decay=weight_decay, adapt=adapt, clip=clip, momentum=momentum,
                                  nesterov=nesterov)),
              ([1], dict(weight_decay=0.0, adapt=False, momentum=momentum, nesterov=nesterov))]
    got, ratios = run(LARS, init, grads, groups, lr=0.1, trust_coefficient=0.02, foreach=foreach)
    want, want_ratios = reference_lars(init, grads, per_tensor(LARS_DEFAULTS, groups, len(init)))
    for g, w in zip(got, want):
        close(g, w)
    assert ratios == pytest.approx(want_ratios, rel=1e-6)
    if clip and adapt:  # LARC caps the effective rate at lr for the small-gradient tensor 4
        assert ratios[4] == 1.0 and ratios[0] < 1.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), r"lr must be .* got -1.0"),
    (dict(lr=math.nan), r"lr must be .* got nan"),
    (dict(eps=-1e-6), r"eps must be .* got -1e-06"),
    (dict(weight_decay=math.inf), r"weight_decay must be .* got inf"),
    (dict(betas=(1.0, 0.999)), r"betas\[0\] must be in \[0, 1\), got 1.0"),
    (dict(betas=(0.9, -0.1)), r"betas\[1\] must be in \[0, 1\), got -0.1"),
    (dict(min_trust=2.0, max_trust=1.0), r"min_trust \(2.0\) must not exceed max_trust \(1.0\)"),
    (dict(max_grad_norm=0.0), r"max_grad_norm must be a finite number > 0, got 0.0"),
])
def test_lamb_rejects_bad_hyper_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LAMB([torch.nn.Parameter(torch.ones(2))], **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-0.1), r"LARS: lr must be .* got -0.1"),
    (dict(lr=0.1, momentum=math.nan), r"momentum must be .* got nan"),
    (dict(lr=0.1, trust_coefficient=-1.0), r"trust_coefficient must be .* got -1.0"),
    (dict(lr=0.1, weight_decay=-1.0), r"weight_decay must be .* got -1.0"),
    (dict(lr=0.1, momentum=0.0, nesterov=True), r"nesterov=True needs momentum > 0"),
])
def test_lars_rejects_bad_hyper_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LARS([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_group_hyper_parameters_are_validated_too():
    with pytest.raises(ValueError, match=r"LAMB: weight_decay must be .* got -0.5"):
        LAMB([{"params": [torch.nn.Parameter(torch.ones(2))], "weight_decay": -0.5}])


TP_CASES = [("lamb", dict(lr=1e-2, min_trust=0.1, max_trust=5.0)),
            ("lamb", dict(lr=1e-2, max_grad_norm=0.5, foreach=False)),
            ("lars", dict(lr=0.1, weight_decay=1e-2, trust_coefficient=0.02))]


def test_tensor_parallel_halves_equal_the_whole_tensor_update():
    """Two gloo ranks each hold one half (dim 0) of two sharded tensors plus a replicated one: the
    halves' updates concatenated equal the single-process update of the whole tensors."""
    init, grads = make_data(seed=5, tensors=[((24, 16), 2.0, 1.0), ((10,), 0.5, 1.0), ((6, 3), 1.0, 0.3)], steps=4)
    sharded = [True, True, False]
    cases = [(name, kwargs, init, grads, sharded) for name, kwargs in TP_CASES]
    reports = run_world(sharded_cases, 2, cases, timeout_s=120)
    for c, (name, kwargs) in enumerate(TP_CASES):
        whole, whole_ratios = run({"lamb": LAMB, "lars": LARS}[name], init, grads, [([0, 1, 2], {})], **kwargs)
        for i, shard in enumerate(sharded):
            got = torch.cat([r[c][0][i] for r in reports]) if shard else reports[0][c][0][i]
            close(got, whole[i].double())
            for r in reports:
                assert r[c][1][i] == pytest.approx(whole_ratios[i], rel=1e-6), (name, i)
        # One all-reduce per step batches every shard's squared norms (NVLAMB's global norm adds one).
        per_step = 2 if kwargs.get("max_grad_norm") else 1
        assert all(r[c][2] == [per_step] * len(grads) for r in reports), name


def test_lamb_param_groups_on_tiny_gpt():
    from model_zoo.gpt import GPT, get_config

    model = GPT(get_config("gpt-tiny"))
    groups = lamb_param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, plain = groups
    assert (decay["weight_decay"], decay["adapt"], plain["weight_decay"], plain["adapt"]) == (0.1, True, 0.0, False)
    decay_names = sorted(names[id(p)] for p in decay["params"])
    plain_names = sorted(names[id(p)] for p in plain["params"])
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert "h.0.ln_1.weight" in plain_names and "ln_f.ln_f.weight" in plain_names and "h.0.attn.qkv.bias" in plain_names
    assert "h.0.attn.qkv.weight" in decay_names and "embed.wte.weight" in decay_names
    assert len(decay_names) + len(plain_names) == len(list(model.parameters()))  # tied weight once
    opt = LAMB(groups, lr=1e-3)
    model(torch.randint(0, 256, (2, 8))).float().pow(2).mean().backward()
    opt.step()
    ratios = opt.last_trust_ratios()
    assert all(ratios[p] == 1.0 for p in plain["params"])


def test_lamb_param_groups_name_rule_is_case_insensitive_and_skips_frozen():
    w, frozen = torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.ones(3, 3), requires_grad=False)
    named = [("enc.LayerNorm.weight2d", w), ("enc.dense.weight", torch.nn.Parameter(torch.ones(3, 3))),
             ("enc.frozen.weight", frozen), ("again", w)]
    decay, plain = lamb_param_groups(named, 0.01)
    assert plain["params"] == [w] and len(decay["params"]) == 1
    assert lamb_param_groups([("x.bias", torch.nn.Parameter(torch.ones(3, 3)))], 0.01)[0]["adapt"] is False
