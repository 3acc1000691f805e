"""GRPO advantages, PPO clip, k3 KL and aggregation against hand-computed values."""

import math

import torch

from miles_fn import advantages, losses


def test_grpo_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.5])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    a = advantages.grpo(r, g, normalize_std=True, eps=0.0)
    std0 = math.sqrt(((0.75**2) + 3 * 0.25**2) / 3)  # unbiased over 4 samples
    assert torch.allclose(a[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / std0, atol=1e-6)
    assert torch.equal(a[4:], torch.zeros(3))  # equal rewards (and singletons) give 0
    dr = advantages.grpo(r, g, normalize_std=False)
    assert torch.allclose(dr[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_ppo_clip_hand_computed():
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    old = torch.log(torch.tensor([[0.25, 0.9, 0.2]]))  # ratios 2.0, 1.0, 0.5
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    per_tok, aux = losses.ppo_clip(logp, old, adv, mask, eps_low=0.2, eps_high=0.3)
    # token 0: min(2*1, 1.3*1) = 1.3; token 1: 1; token 2: min(-0.5, -0.8) = -0.8
    assert torch.allclose(per_tok, torch.tensor([[-1.3, -1.0, 0.8]]), atol=1e-6)
    assert math.isclose(float(aux["clip_frac"]), 2 / 3, rel_tol=1e-6)


def test_ppo_clip_gradient_is_zero_where_clipped():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[2.0, 1.1]])).requires_grad_()
    adv = torch.ones(1, 2)
    per_tok, _ = losses.ppo_clip(logp, old, adv, torch.ones(1, 2), 0.2)
    per_tok.sum().backward()
    assert logp.grad[0, 0] == 0.0  # ratio 2 > 1.2: clipped, no gradient
    assert math.isclose(float(logp.grad[0, 1]), -1.1, rel_tol=1e-6)  # d(-rho A)/dlogp = -rho A


def test_k3_hand_computed_and_nonnegative():
    logp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.2)])
    k3 = losses.kl_k3(logp, ref)
    assert math.isclose(float(k3[0]), 0.5 - math.log(0.5) - 1, rel_tol=1e-6)
    assert float(k3[1]) == 0.0
    assert bool((losses.kl_k3(torch.randn(100), torch.randn(100)) >= 0).all())


def test_aggregation_modes_and_mask():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert math.isclose(float(losses.aggregate(x, m, "token_mean")), 7 / 3, rel_tol=1e-6)
    assert math.isclose(float(losses.aggregate(x, m, "seq_mean_token_mean")), (1.5 + 4) / 2, rel_tol=1e-6)
    poisoned = x.clone()
    poisoned[m == 0] = float("nan")
    assert math.isclose(float(losses.aggregate(poisoned, m)), 7 / 3, rel_tol=1e-6)


def test_masked_tokens_change_neither_loss_nor_gradient():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g).requires_grad_()
    old, adv = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.4).float()

    def loss_and_grad(old_, adv_):
        if logp.grad is not None:
            logp.grad = None
        per_tok, _ = losses.ppo_clip(logp, old_, adv_, mask, 0.2)
        loss = losses.aggregate(per_tok, mask)
        loss.backward()
        return loss.detach(), logp.grad.clone()

    l1, g1 = loss_and_grad(old, adv)
    old2, adv2 = old.clone(), adv.clone()
    old2[mask == 0] = 1e4
    adv2[mask == 0] = float("inf")
    l2, g2 = loss_and_grad(old2, adv2)
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    assert bool((g1[mask == 0] == 0).all())
