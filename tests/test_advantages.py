"""Advantage estimators against hand-computed values and independent float64 loops."""

import math

import pytest
import torch

from miles_fn import advantages as A
from miles_fn import dapo


def _rng(seed):
    return torch.Generator().manual_seed(seed)


def _response_mask(lengths_starts, width):
    m = torch.zeros(len(lengths_starts), width)
    for i, (start, n) in enumerate(lengths_starts):
        m[i, start:start + n] = 1.0
    return m


# --- group estimators ---------------------------------------------------------------------------

def test_rloo_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 5.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    a = A.rloo(r, g)
    expect = [1.0, -1 / 3, -1 / 3, -1 / 3, 2.0, -2.0, 0.0]  # singleton group: 0
    assert torch.allclose(a, torch.tensor(expect), atol=1e-6)


def test_group_estimators_match_python_loops():
    rewards = torch.rand(12, generator=_rng(0), dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3])
    r, g = rewards.tolist(), groups.tolist()
    members = {k: [i for i in range(len(g)) if g[i] == k] for k in set(g)}
    for i in range(len(r)):
        others = [r[j] for j in members[g[i]] if j != i]
        mean = sum(r[j] for j in members[g[i]]) / len(members[g[i]])
        std = math.sqrt(sum((r[j] - mean) ** 2 for j in members[g[i]]) / (len(members[g[i]]) - 1))
        assert math.isclose(float(A.rloo(rewards, groups)[i]), r[i] - sum(others) / len(others), abs_tol=1e-6)
        assert math.isclose(float(A.grpo(rewards, groups, True, 0.0)[i]), (r[i] - mean) / std, rel_tol=1e-5)
        assert math.isclose(float(A.grpo(rewards, groups, False)[i]), r[i] - mean, abs_tol=1e-6)


def test_group_estimators_broadcast_over_the_response_only():
    mask = _response_mask([(1, 2), (0, 3), (2, 1), (1, 1)], 4)
    inp = A.AdvantageInputs(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]), mask)
    for name in ("grpo", "dr_grpo", "rloo"):
        adv, _ = A.estimate(name, inp, A.AdvantageConfig())
        assert bool((adv[mask == 0] == 0).all()), name
    adv, _ = A.estimate("dr_grpo", inp, A.AdvantageConfig())
    assert torch.allclose(adv[0, 1:3], torch.tensor([0.5, 0.5])) and torch.allclose(adv[1, :3], torch.full((3,), -0.5))
    assert bool((adv[2:] == 0).all())  # equal rewards: no signal


def test_kl_folded_into_a_sequence_reward():
    mask = _response_mask([(0, 2), (0, 2)], 3)
    kl = torch.tensor([[0.5, 0.5, 9.0], [0.0, 0.0, 9.0]])  # column 2 is off the mask: ignored
    inp = A.AdvantageInputs(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), mask, kl)
    adv, _ = A.estimate("dr_grpo", inp, A.AdvantageConfig(kl_coef=0.1))
    # shaped rewards 1 - 0.1*1.0 = 0.9 and 1.0; group mean 0.95
    assert torch.allclose(adv[:, 0], torch.tensor([-0.05, 0.05]), atol=1e-6)


# --- token-level estimators ---------------------------------------------------------------------

def test_token_rewards_put_the_outcome_on_the_last_response_token():
    mask = _response_mask([(1, 3), (0, 1)], 5)
    kl = torch.full((2, 5), 0.2)
    tr = A.token_rewards(torch.tensor([2.0, -1.0]), mask, kl, kl_coef=0.5)
    expect = torch.tensor([[0, -0.1, -0.1, 1.9, 0], [-1.1, 0, 0, 0, 0]], dtype=torch.float64)
    assert torch.allclose(tr, expect)


def test_reinforce_pp_hand_computed():
    # one response of 2 tokens, one of 1; gamma = 0.5; no KL.
    mask = _response_mask([(0, 2), (0, 1)], 2)
    inp = A.AdvantageInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), mask)
    adv, ret = A.estimate("reinforce_pp", inp, A.AdvantageConfig(gamma=0.5, eps=0.0))
    # returns: row0 [0.5, 1.0], row1 [0.0]; mean 0.5, population std sqrt((0 + .25 + .25)/3)
    assert torch.allclose(ret, torch.tensor([[0.5, 1.0], [0.0, 0.0]]))
    std = math.sqrt(0.5 / 3)
    assert torch.allclose(adv, torch.tensor([[0.0, 0.5 / std], [-0.5 / std, 0.0]]), atol=1e-6)


@pytest.mark.parametrize("gapped", [False, True])
def test_reinforce_pp_matches_a_python_loop(gapped):
    n, t, gamma, beta = 4, 6, 0.9, 0.05
    mask = _response_mask([(1, 4), (0, 6), (2, 2), (3, 1)], t)
    if gapped:  # a masked tool-output column inside rows 0 and 1
        mask[0, 2] = mask[1, 1] = mask[1, 4] = 0.0
    r = torch.randn(n, generator=_rng(1), dtype=torch.float64)
    kl = torch.rand(n, t, generator=_rng(2), dtype=torch.float64)
    adv, _ = A.est_reinforce_pp(A.AdvantageInputs(r, torch.arange(n), mask, kl), A.AdvantageConfig(gamma=gamma,
                                                                                                      kl_coef=beta))
    returns = {}
    for i in range(n):
        cols = [c for c in range(t) if mask[i, c] > 0]
        for k, c in enumerate(cols):
            # G = sum over later response tokens of gamma^(s-c) * reward_s, written as an explicit double sum
            g = 0.0
            for j, s in enumerate(cols[k:]):
                rew = -beta * float(kl[i, s]) + (float(r[i]) if s == cols[-1] else 0.0)
                g += gamma ** j * rew
            returns[(i, c)] = g
    vals = list(returns.values())
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    for (i, c), g in returns.items():
        assert math.isclose(float(adv[i, c]), (g - mean) / (std + 1e-6), rel_tol=1e-5, abs_tol=1e-6)
    assert bool((adv[mask == 0] == 0).all())


def test_reinforce_baseline_hand_computed():
    mask = _response_mask([(0, 2), (0, 1), (1, 1)], 2)
    inp = A.AdvantageInputs(torch.tensor([1.0, 0.0, 2.0]), torch.zeros(3, dtype=torch.int64), mask)
    adv, ret = A.estimate("reinforce", inp, A.AdvantageConfig())
    assert torch.allclose(adv, torch.tensor([[0.0, 0.0], [-1.0, 0.0], [0.0, 1.0]]))  # baseline = mean R = 1
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 2.0]]))


def test_gae_hand_computed():
    # One response over columns 1..2, reward 1 at the end; V = [_, 0.5, 0.25]; gamma 0.9, lambda 0.5.
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    values = torch.tensor([[7.0, 0.5, 0.25, 7.0]])  # 7s are off the mask and must not matter
    adv, ret = A.gae(A.token_rewards(torch.tensor([1.0]), mask), values, mask, 0.9, 0.5)
    d2 = 1.0 - 0.25  # terminal: no bootstrap
    d1 = 0.0 + 0.9 * 0.25 - 0.5
    a1 = d1 + 0.9 * 0.5 * d2
    assert torch.allclose(adv, torch.tensor([[0.0, a1, d2, 0.0]], dtype=torch.float64))
    assert torch.allclose(ret, torch.tensor([[0.0, a1 + 0.5, d2 + 0.25, 0.0]], dtype=torch.float64))


def test_gae_matches_the_sum_of_discounted_td_errors():
    n, t, gamma, lam = 3, 7, 0.95, 0.8
    mask = _response_mask([(2, 5), (0, 7), (4, 1)], t)
    r = torch.randn(n, t, generator=_rng(3), dtype=torch.float64) * mask
    v = torch.randn(n, t, generator=_rng(4), dtype=torch.float64)
    adv, _ = A.gae(r, v, mask, gamma, lam)
    for i in range(n):
        cols = [c for c in range(t) if mask[i, c] > 0]
        vv = [float(v[i, c]) for c in cols] + [0.0]
        deltas = [float(r[i, c]) + gamma * vv[k + 1] - vv[k] for k, c in enumerate(cols)]
        for k, c in enumerate(cols):
            want = sum((gamma * lam) ** j * deltas[k + j] for j in range(len(cols) - k))
            assert math.isclose(float(adv[i, c]), want, rel_tol=1e-9, abs_tol=1e-12)


# --- multi-turn masks with gaps (tool output masked out, issue 16) -------------------------------------------
# Row 0 is a two-turn response: trained columns 0, 1, 2, then 2 masked tool columns, then trained 5, 6.
GAPPED = torch.tensor([[1.0, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0]])


def test_gapped_mask_gets_the_outcome_once_at_its_last_trained_token():
    assert A.last_token_mask(GAPPED).tolist() == [[0, 0, 0, 0, 0, 0, 1], [0, 1, 0, 0, 0, 0, 0]]
    assert A.first_token_mask(GAPPED).tolist() == [[1, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]]
    kl = torch.full((2, 7), 0.2)
    tr = A.token_rewards(torch.tensor([1.0, 3.0]), GAPPED, kl, kl_coef=0.5)
    expect = [[-0.1, -0.1, -0.1, 0, 0, -0.1, 0.9], [-0.1, 2.9, 0, 0, 0, 0, 0]]
    assert torch.allclose(tr, torch.tensor(expect, dtype=torch.float64))


def test_reinforce_on_a_gapped_mask_hand_computed():
    # gamma 0.5 per trained token: row 0's returns 1, .5 (cols 6, 5), then across the gap .25, .125, .0625
    inp = A.AdvantageInputs(torch.tensor([1.0, 3.0]), torch.zeros(2, dtype=torch.int64), GAPPED)
    adv, ret = A.estimate("reinforce", inp, A.AdvantageConfig(gamma=0.5))
    g = [[0.0625, 0.125, 0.25, 0, 0, 0.5, 1.0], [1.5, 3.0, 0, 0, 0, 0, 0]]
    assert torch.allclose(ret, torch.tensor(g))
    base = (0.0625 + 1.5) / 2  # the mean return at each row's first trained token
    want = [[(x - base) * m for x, m in zip(row, mrow)] for row, mrow in zip(g, GAPPED.tolist())]
    assert torch.allclose(adv, torch.tensor(want), atol=1e-7)


def test_reinforce_pp_on_a_gapped_mask_hand_computed():
    # rewards -0.1 a trained token (beta 0.5 * kl 0.2; the masked columns' kl of 50 is ignored), R at the last
    kl = torch.tensor([[0.2, 0.2, 0.2, 50, 50, 0.2, 0.2], [0.2, 0.2, 50, 50, 50, 50, 50]])
    inp = A.AdvantageInputs(torch.tensor([1.0, 3.0]), torch.tensor([0, 1]), GAPPED, kl)
    adv, ret = A.estimate("reinforce_pp", inp, A.AdvantageConfig(gamma=0.5, kl_coef=0.5, eps=0.0))
    g6, g1b = 0.9, 2.9
    g5 = -0.1 + 0.5 * g6
    g2 = -0.1 + 0.5 * g5  # across the gap: one discount, from trained column 2 to trained column 5
    g1 = -0.1 + 0.5 * g2
    g0 = -0.1 + 0.5 * g1
    g0b = -0.1 + 0.5 * g1b
    g = [[g0, g1, g2, 0, 0, g5, g6], [g0b, g1b, 0, 0, 0, 0, 0]]
    assert torch.allclose(ret, torch.tensor(g), atol=1e-6)
    vals = [g0, g1, g2, g5, g6, g0b, g1b]
    mean = sum(vals) / 7
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 7)
    want = [[(x - mean) / std * m for x, m in zip(row, mrow)] for row, mrow in zip(g, GAPPED.tolist())]
    assert torch.allclose(adv, torch.tensor(want), atol=1e-6)


def test_gae_on_a_gapped_mask_hand_computed():
    mask = GAPPED[:1]
    values = torch.tensor([[0.5, 0.4, 0.3, 9.0, 9.0, 0.2, 0.1]])  # the 9s are masked: never bootstrapped from
    gamma, lam = 0.9, 0.5
    d6 = 1.0 - 0.1  # terminal
    d5 = gamma * 0.1 - 0.2
    d2 = gamma * 0.2 - 0.3  # V bootstraps across the gap from trained column 5
    d1 = gamma * 0.3 - 0.4
    d0 = gamma * 0.4 - 0.5
    a6 = d6
    a5 = d5 + gamma * lam * a6
    a2 = d2 + gamma * lam * a5
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    adv, ret = A.gae(A.token_rewards(torch.tensor([1.0]), mask), values, mask, gamma, lam)
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2, 0, 0, a5, a6]], dtype=torch.float64))
    assert torch.allclose(ret, torch.tensor([[a0 + .5, a1 + .4, a2 + .3, 0, 0, a5 + .2, a6 + .1]], dtype=torch.float64))
    inp = A.AdvantageInputs(torch.tensor([1.0]), torch.zeros(1, dtype=torch.int64), mask, values=values)
    adv2, _ = A.estimate("gae", inp, A.AdvantageConfig(gamma=gamma, lam=lam))
    assert torch.allclose(adv2, adv.float())


def test_group_estimators_with_kl_on_gapped_masks_hand_computed():
    # One group: row 0 (R 1, 5 trained tokens), row 1 (R 0, trained 0 and 2); kl 0.5 everywhere, beta 0.1
    mask = torch.tensor([[1.0, 1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 0, 0, 0]])
    inp = A.AdvantageInputs(torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.int64), mask, torch.full((2, 7), 0.5))
    cfg = A.AdvantageConfig(kl_coef=0.1, eps=0.0)
    r0, r1 = 1.0 - 0.1 * 0.5 * 5, 0.0 - 0.1 * 0.5 * 2  # R counted once: 0.75 and -0.1
    mean, std = (r0 + r1) / 2, abs(r0 - r1) / math.sqrt(2)
    for name, a0, a1 in [("dr_grpo", r0 - mean, r1 - mean), ("grpo", (r0 - mean) / std, (r1 - mean) / std),
                         ("rloo", r0 - r1, r1 - r0)]:
        adv, _ = A.estimate(name, inp, cfg)
        assert torch.allclose(adv, torch.tensor([[a0] * 7, [a1] * 7]) * mask, atol=1e-6), name


def _token_reference(rewards, mask, kl, values, beta, gamma, lam):
    """Float64 loops over each row's trained columns: (reinforce returns, GAE advantages), by the definitions."""
    returns, gae = {}, {}
    for i in range(mask.shape[0]):
        cols = [c for c in range(mask.shape[1]) if mask[i, c] > 0]
        rew = [-beta * float(kl[i, c]) + (float(rewards[i]) if c == cols[-1] else 0.0) for c in cols]
        vv = [float(values[i, c]) for c in cols] + [0.0]
        deltas = [rew[k] + gamma * vv[k + 1] - vv[k] for k in range(len(cols))]
        for k, c in enumerate(cols):
            returns[(i, c)] = sum(gamma ** j * rew[k + j] for j in range(len(cols) - k))
            gae[(i, c)] = sum((gamma * lam) ** j * deltas[k + j] for j in range(len(cols) - k))
    return returns, gae


@pytest.mark.parametrize("gapped", [False, True])
def test_token_estimators_match_float64_loops_with_and_without_gaps(gapped):
    n, t, gamma, lam, beta = 4, 9, 0.9, 0.7, 0.05
    mask = _response_mask([(1, 5), (0, 9), (3, 2), (6, 1)], t)
    if gapped:
        mask[0, 3] = mask[1, 2] = mask[1, 6] = mask[1, 7] = 0.0
    r = torch.randn(n, generator=_rng(7), dtype=torch.float64)
    kl = torch.rand(n, t, generator=_rng(8), dtype=torch.float64)
    v = torch.randn(n, t, generator=_rng(9), dtype=torch.float64)
    returns, gae = _token_reference(r, mask, kl, v, beta, gamma, lam)
    inp = A.AdvantageInputs(r, torch.arange(n), mask, kl, v)
    cfg = A.AdvantageConfig(gamma=gamma, lam=lam, kl_coef=beta)
    adv_g, ret_g = A.gae(A.token_rewards(r, mask, kl, beta), v, mask, gamma, lam)
    adv_r, ret_r = A.estimate("reinforce", inp, cfg)
    firsts = [min(c for (i, c) in returns if i == row) for row in range(n)]
    base = sum(returns[(row, c)] for row, c in enumerate(firsts)) / n
    for (i, c), g in returns.items():
        assert math.isclose(float(adv_g[i, c]), gae[(i, c)], rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(float(ret_g[i, c]), gae[(i, c)] + float(v[i, c]), rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(float(ret_r[i, c]), g, rel_tol=1e-6, abs_tol=1e-6)
        assert math.isclose(float(adv_r[i, c]), g - base, rel_tol=1e-6, abs_tol=1e-6)
    off = mask == 0
    assert bool((adv_g[off] == 0).all() and (ret_g[off] == 0).all() and (adv_r[off] == 0).all())


def test_gae_needs_values_and_unknown_names_are_listed():
    inp = A.AdvantageInputs(torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.ones(2, 2))
    with pytest.raises(ValueError, match="values"):
        A.estimate("gae", inp, A.AdvantageConfig())
    with pytest.raises(ValueError, match="rloo"):
        A.estimate("nope", inp, A.AdvantageConfig())


def test_off_mask_inputs_change_no_advantage():
    mask = _response_mask([(1, 3), (0, 2), (2, 2)], 5)
    base = A.AdvantageInputs(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 1]), mask,
                             torch.rand(3, 5, generator=_rng(5)), torch.rand(3, 5, generator=_rng(6)))
    poisoned = base._replace(kl=torch.where(mask > 0, base.kl, torch.full_like(mask, 1e6)),
                             values=torch.where(mask > 0, base.values, torch.full_like(mask, float("nan"))))
    cfg = A.AdvantageConfig(kl_coef=0.1, gamma=0.9)
    for name in A.ESTIMATORS:
        a1, r1 = A.estimate(name, base, cfg)
        a2, r2 = A.estimate(name, poisoned, cfg)
        assert torch.equal(a1, a2) and torch.equal(r1, r2), name


# --- DAPO pieces --------------------------------------------------------------------------------

def test_informative_groups_hand_computed():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.3])
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert dapo.informative_groups(r, g).tolist() == [False, True, False, False]


def test_overlong_penalty_hand_computed_and_by_cases():
    lengths = torch.tensor([1, 4, 5, 6, 7])
    pen = dapo.overlong_penalty(lengths, max_len=6, buffer=2, factor=0.5)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.25, -0.5, -0.5]))
    for n in range(0, 12):
        want = 0.0 if n <= 7 else (-1.0 if n > 10 else (7 - n) / 3)
        assert math.isclose(float(dapo.overlong_penalty(torch.tensor([n]), 10, 3)[0]), want, rel_tol=1e-6)
    assert bool((dapo.overlong_penalty(lengths, 6, 0) == 0).all())
    with pytest.raises(ValueError, match="overlong_buffer"):
        dapo.overlong_penalty(lengths, 6, 7)
