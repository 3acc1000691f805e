"""Policy, KL, entropy, value and SFT losses and their aggregation: hand-computed values, float64
references written differently, finite-difference gradients, and masked tokens that change nothing."""

import math

import pytest
import torch
from torch.autograd import gradcheck

import ops
from miles_fn import losses as L

AGG = L.AGG_MODES


def _rng(seed):
    return torch.Generator().manual_seed(seed)


def _batch(seed, n=3, t=5, dtype=torch.float64):
    g = _rng(seed)
    logp = -torch.rand(n, t, generator=g, dtype=dtype) * 2 - 0.05
    old = logp + 0.1 * torch.randn(n, t, generator=g, dtype=dtype)
    adv = torch.randn(n, t, generator=g, dtype=dtype)
    mask = torch.zeros(n, t, dtype=dtype)
    for i in range(n):
        mask[i, i % 2 : i % 2 + 2 + i] = 1.0
    return logp, old, adv, mask


# --- aggregation --------------------------------------------------------------------------------

def test_aggregation_modes_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert math.isclose(float(L.aggregate(x, m, "token_mean")), 7 / 3, rel_tol=1e-6)
    assert math.isclose(float(L.aggregate(x, m, "seq_mean_token_mean")), (1.5 + 4) / 2, rel_tol=1e-6)
    assert math.isclose(float(L.aggregate(x, m, "seq_mean_token_sum")), (3 + 4) / 2, rel_tol=1e-6)
    assert math.isclose(float(L.aggregate(x, m, "seq_mean_token_sum_norm")), 7 / (2 * 3), rel_tol=1e-6)
    assert math.isclose(float(L.aggregate(x, m, "seq_mean_token_sum_norm", normalizer=2 * 10)), 7 / 20, rel_tol=1e-6)
    with pytest.raises(ValueError, match="seq_mean_token_sum"):
        L.aggregate(x, m, "mean")


@pytest.mark.parametrize("mode", AGG)
def test_micro_batches_with_global_normaliser_sum_to_the_full_batch(mode):
    logp, old, adv, mask = _batch(0, n=4, t=6)
    d = L.normalizer_for(mode, mask.sum(), float(mask.shape[0]), max_response_len=6)

    def loss_and_grad(rows):
        lp = logp[rows].clone().requires_grad_()
        per_tok, _ = L.ppo_clip(lp, old[rows], adv[rows], mask[rows], 0.2, 0.3)
        loss = L.aggregate(per_tok, mask[rows], mode, d)
        (g,) = torch.autograd.grad(loss, lp)
        return loss.detach(), g

    full, g_full = loss_and_grad(slice(0, 4))
    a, g_a = loss_and_grad(slice(0, 1))
    b, g_b = loss_and_grad(slice(1, 4))
    assert torch.allclose(a + b, full, rtol=1e-12)
    assert torch.allclose(torch.cat([g_a, g_b]), g_full, rtol=1e-12)
    if mode != "seq_mean_token_sum_norm":  # the default normaliser is the batch's own count
        local = L.aggregate(L.ppo_clip(logp, old, adv, mask, 0.2, 0.3)[0], mask, mode)
        assert torch.allclose(local, full, rtol=1e-12)


# --- policy losses ------------------------------------------------------------------------------

def test_dual_clip_hand_computed():
    logp = torch.log(torch.tensor([[0.8, 0.8, 0.5]]))
    old = torch.log(torch.tensor([[0.2, 0.2, 0.25]]))  # ratios 4, 4, 2
    adv = torch.tensor([[-1.0, 1.0, -0.1]])
    per_tok, aux = L.dual_clip(logp, old, adv, torch.ones(1, 3), 0.2, 0.2, clip_c=3.0)
    # A<0, ratio 4: ppo = max(4, 0.8) = 4, capped at c|A| = 3; A>0: min(4, 1.2) -> 1.2; ratio 2, A=-0.1: 0.2 < 0.3
    assert torch.allclose(per_tok, torch.tensor([[3.0, -1.2, 0.2]]), atol=1e-6)
    assert math.isclose(float(aux["dual_clip_frac"]), 1 / 3, rel_tol=1e-6)
    with pytest.raises(ValueError, match="dual_clip_c"):
        L.dual_clip(logp, old, adv, torch.ones(1, 3), clip_c=1.0)


def test_gspo_hand_computed():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.9]]))
    old = torch.log(torch.tensor([[0.25, 1.0, 0.1]]))  # token log-ratios log2, -log2, (masked)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    per_tok, aux = L.gspo(logp, old, torch.full((1, 3), 2.0), mask, 0.1, 0.1)
    # geometric-mean ratio exp((log2 - log2)/2) = 1: unclipped, loss = -A on each response token
    assert torch.allclose(per_tok[0, :2], torch.tensor([-2.0, -2.0]), atol=1e-6)
    assert math.isclose(float(aux["ratio_mean"]), 1.0, rel_tol=1e-6)
    old2 = torch.log(torch.tensor([[0.125, 0.125, 0.1]]))  # log-ratios log4, log4: s = 4 -> clipped to 1.1
    per_tok2, aux2 = L.gspo(logp, old2, torch.full((1, 3), 2.0), mask, 0.1, 0.1)
    assert torch.allclose(per_tok2[0, :2], torch.tensor([-2.2, -2.2]), atol=1e-6)
    assert float(aux2["clip_frac"]) == 1.0


def test_gspo_gradient_is_that_of_the_sequence_level_objective():
    """autograd(GSPO-token, seq-mean-token-mean) == finite differences of -(1/N) sum_i min(s_i A_i, clip(s_i) A_i)."""
    logp, old, _, mask = _batch(1)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)[:, None].expand(3, 5).contiguous()
    eps = 0.5  # wide: this point is unclipped, where the objective is smooth

    def sequence_objective(lp):
        total = 0.0
        for i in range(lp.shape[0]):
            cols = [c for c in range(lp.shape[1]) if mask[i, c] > 0]
            s = math.exp(sum(float(lp[i, c] - old[i, c]) for c in cols) / len(cols))
            a = float(adv[i, 0])
            total += -min(s * a, min(max(s, 1 - eps), 1 + eps) * a)
        return total / lp.shape[0]

    lp = logp.clone().requires_grad_()
    loss = L.aggregate(L.gspo(lp, old, adv, mask, eps, eps)[0], mask, "seq_mean_token_mean")
    (g,) = torch.autograd.grad(loss, lp)
    assert math.isclose(float(loss.detach()), sequence_objective(logp), rel_tol=1e-12)
    h = 1e-6
    for i in range(3):
        for c in range(5):
            e = torch.zeros_like(logp)
            e[i, c] = h
            fd = (sequence_objective(logp + e) - sequence_objective(logp - e)) / (2 * h)
            assert math.isclose(float(g[i, c]), fd, rel_tol=1e-5, abs_tol=1e-9), (i, c)


def test_policy_gradient_hand_computed():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    per_tok, _ = L.policy_gradient(logp, torch.zeros(1, 2), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2))
    assert torch.allclose(per_tok, torch.tensor([[2.0, -2.0]]))
    per_tok.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-2.0, 1.0]]))


def test_ppo_clip_matches_a_float64_loop():
    logp, old, adv, mask = _batch(2)
    per_tok, _ = L.ppo_clip(logp, old, adv, mask, 0.1, 0.25)
    for i in range(3):
        for t in range(5):
            if mask[i, t] == 0:
                continue
            rho, a = math.exp(float(logp[i, t] - old[i, t])), float(adv[i, t])
            want = -min(rho * a, min(max(rho, 0.9), 1.25) * a)
            assert math.isclose(float(per_tok[i, t]), want, rel_tol=1e-12)


# --- KL, entropy, value, SFT --------------------------------------------------------------------

def test_kl_estimators_hand_computed_and_clamped():
    logp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.2)])
    d = math.log(0.5)  # log ref - log p at token 0
    assert torch.allclose(L.kl("k1", logp, ref), torch.tensor([-d, 0.0]))
    assert torch.allclose(L.kl("k2", logp, ref), torch.tensor([0.5 * d * d, 0.0]))
    assert torch.allclose(L.kl("k3", logp, ref), torch.tensor([math.exp(d) - d - 1, 0.0]))
    far = L.kl("k3", torch.tensor([0.0]), torch.tensor([-100.0]), clamp=5.0)
    assert math.isclose(float(far[0]), math.exp(-5.0) + 5.0 - 1.0, rel_tol=1e-6)
    with pytest.raises(ValueError, match="k3"):
        L.kl("k4", logp, ref)


def test_kl_estimators_are_unbiased_or_low_variance_on_a_known_pair():
    """Under samples x ~ p, E[k1] = E[k3] = KL(p||q) exactly; computed as explicit expectations."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    true = float((p * (p / q).log()).sum())
    for kind in ("k1", "k3"):
        est = float((p * L.kl(kind, p.log(), q.log())).sum())
        assert math.isclose(est, true, rel_tol=1e-12), kind
    assert bool((L.kl("k3", p.log(), q.log()) >= 0).all()) and bool((L.kl("k2", p.log(), q.log()) >= 0).all())


def test_token_entropy_matches_a_loop_and_model_helper_agrees():
    logits = torch.randn(2, 3, 7, generator=_rng(3), dtype=torch.float64)
    h = ops.token_entropy(logits, temperature=0.7)
    for i in range(2):
        for t in range(3):
            z = [float(v) / 0.7 for v in logits[i, t]]
            mx = max(z)
            e = [math.exp(v - mx) for v in z]
            p = [v / sum(e) for v in e]
            assert math.isclose(float(h[i, t]), -sum(pi * math.log(pi) for pi in p), rel_tol=1e-6)
    assert math.isclose(float(ops.token_entropy(torch.zeros(1, 8))[0]), math.log(8), rel_tol=1e-6)


def test_value_loss_hand_computed():
    v = torch.tensor([[1.0, 0.0, 5.0]])
    old = torch.tensor([[0.5, 0.0, 0.0]])
    ret = torch.tensor([[2.0, 1.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    per_tok, aux = L.value_loss(v, old, ret, m, clip=0.2)
    # token 0: unclipped (1-2)^2 = 1, clipped v = 0.7: (0.7-2)^2 = 1.69 -> max 1.69; token 1: 1 both
    assert torch.allclose(per_tok, torch.tensor([[0.5 * 1.69, 0.5, 0.0]]), atol=1e-6)
    assert math.isclose(float(aux["value_clip_frac"]), 0.5, rel_tol=1e-6)
    unclipped, _ = L.value_loss(v, old, ret, m, clip=0.0)
    assert torch.allclose(unclipped, torch.tensor([[0.5, 0.5, 0.0]]))


# --- gradients vs finite differences, and the mask ----------------------------------------------

def _loss_cases():
    """name -> f(logp [N,T] float64, mask) -> scalar, at points away from clip kinks."""
    _, old, adv, _ = _batch(4)
    ref = old - 0.3
    c = L.ClipConfig(eps_clip=0.5, eps_clip_high=0.6, dual_clip_c=3.0)
    cases = {name: (lambda lp, m, fn=fn: L.aggregate(fn(lp, old, adv, m, c)[0], m, "seq_mean_token_mean"))
             for name, fn in L.POLICY_LOSSES.items()}
    # GSPO's token gradient is its sequence objective's gradient when A is constant along the sequence
    seq_adv = adv[:, :1].expand_as(adv).contiguous()
    cases["gspo"] = lambda lp, m: L.aggregate(L.gspo(lp, old, seq_adv, m, 0.5, 0.6)[0], m, "seq_mean_token_mean")
    for kind in L.KL_ESTIMATORS:
        cases[f"kl_{kind}"] = lambda lp, m, kind=kind: L.aggregate(L.kl(kind, lp, ref), m)
    cases["value"] = lambda v, m: L.aggregate(L.value_loss(v, old, adv, m, clip=10.0)[0], m)
    cases["sft"] = lambda lp, m: L.aggregate(L.sft_nll(lp), m, "seq_mean_token_sum")
    return cases


@pytest.mark.parametrize("name", sorted(_loss_cases()))
def test_gradient_matches_finite_differences(name):
    f = _loss_cases()[name]
    logp, _, _, mask = _batch(4)
    assert gradcheck(lambda lp: f(lp, mask), (logp.clone().requires_grad_(),), eps=1e-6, atol=1e-8, rtol=1e-5)


def test_entropy_bonus_gradient_matches_finite_differences():
    logits = torch.randn(2, 3, 5, generator=_rng(5), dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    assert gradcheck(lambda z: L.aggregate(L.entropy_bonus(ops.token_entropy(z)), mask), (logits,), eps=1e-6,
                     atol=1e-8)


@pytest.mark.parametrize("name", sorted(_loss_cases()))
@pytest.mark.parametrize("mode", AGG)
def test_masked_tokens_change_neither_loss_nor_gradient(name, mode):
    logp, old, adv, mask = _batch(6)
    ref = old - 0.3
    c = L.ClipConfig(0.2, 0.28, 3.0)

    def f(lp, old_, adv_, ref_):
        if name in L.POLICY_LOSSES:
            per_tok = L.POLICY_LOSSES[name](lp, old_, adv_, mask, c)[0]
        elif name.startswith("kl_"):
            per_tok = L.kl(name[3:], lp, ref_)
        elif name == "value":
            per_tok = L.value_loss(lp, old_, adv_, mask, 0.2)[0]
        else:
            per_tok = L.sft_nll(lp)
        return L.aggregate(per_tok, mask, mode)

    def loss_and_grad(lp, old_, adv_, ref_):
        lp = lp.clone().requires_grad_()
        loss = f(lp, old_, adv_, ref_)
        (g,) = torch.autograd.grad(loss, lp)
        return loss.detach(), g

    l1, g1 = loss_and_grad(logp, old, adv, ref)
    off = mask == 0
    lp2, old2, adv2, ref2 = logp.clone(), old.clone(), adv.clone(), ref.clone()
    lp2[off], old2[off], adv2[off], ref2[off] = -50.0, 1e4, float("inf"), float("nan")
    l2, g2 = loss_and_grad(lp2, old2, adv2, ref2)
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    assert bool((g1[off] == 0).all())
