"""Composed objectives on a tiny model: the default equals make_grpo_loss bit for bit, micro-batches with
global counts equal the full batch, PPO's actor-critic state updates both halves and checkpoints."""

import torch
from torch.func import grad

from miles_fn import model, objective, optim, prng, train
from miles_fn.config import ModelConfig
from miles_fn.rollout_buffer import build_rollout_buffer
from state import checkpoint
from state.train_state import ActorCriticState
from state.tree import tree_hash, tree_leaves, tree_map

CFG = ModelConfig(vocab_size=13, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2, num_kv_heads=1,
                  max_position_embeddings=32)


def _params(seed=0):
    return model.init_params(CFG, prng.key(seed), std=0.3)


def _buffer(seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [[1, 3, 4], [1, 5], [1, 3, 4], [1, 5], [1, 6, 7, 8], [1, 6, 7, 8]]
    responses = [[int(x) for x in torch.randint(3, 13, (n,), generator=g)] + [2] for n in (2, 3, 1, 0, 4, 2)]
    lps = [[-float(x) for x in torch.rand(len(r), generator=g)] for r in responses]
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5]
    buf = build_rollout_buffer(prompts, responses, lps, rewards, [0, 1, 0, 1, 2, 2])
    ref = buf.old_logprobs - 0.2 * torch.rand(buf.old_logprobs.shape, generator=g)
    return buf._replace(ref_logprobs=ref)


def _loss_and_grads(loss_fn, params, buf):
    return grad(lambda p: loss_fn(p, buf, prng.key(0))[0])(params), loss_fn(params, buf, prng.key(0))[0]


def test_default_objective_is_make_grpo_loss_bit_for_bit():
    params, buf = _params(), _buffer()
    for kl_coef in (0.0, 0.05):
        old = train.make_grpo_loss(CFG, train.PolicyLossConfig(kl_coef=kl_coef))
        new = objective.make_policy_loss(CFG, objective.ObjectiveConfig(kl_coef=kl_coef))
        (g1, l1), (g2, l2) = _loss_and_grads(old, params, buf), _loss_and_grads(new, params, buf)
        assert torch.equal(l1, l2) and tree_hash(g1) == tree_hash(g2)
        a1, a2 = old(params, buf, None)[1], new(params, buf, None)[1]
        assert a1.keys() == a2.keys() and all(torch.equal(a1[k], a2[k]) for k in a1)
    # and the default estimator leaves the rollout buffer's GRPO advantages as they were
    assert torch.equal(objective.with_advantages(buf, objective.ObjectiveConfig()).advantages, buf.advantages)


def test_micro_batches_with_global_counts_accumulate_to_the_full_batch_gradient():
    params, buf = _params(), _buffer()
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        cfg = objective.ObjectiveConfig(loss_agg=agg, kl_coef=0.1, entropy_coef=0.01, max_response_len=5,
                                        policy_loss="dual_clip")
        fn = objective.make_policy_loss(CFG, cfg)
        full = objective.with_global_counts(buf)
        g_full, l_full = _loss_and_grads(fn, params, full)
        halves = [tree_map(lambda x, rows=rows: x[rows] if x.dim() else x, full) for rows in (slice(0, 2), slice(2, 6))]
        parts = [_loss_and_grads(fn, params, h) for h in halves]
        g_sum = tree_map(lambda a, b: a + b, parts[0][0], parts[1][0])
        assert torch.allclose(parts[0][1] + parts[1][1], l_full, atol=1e-6), agg
        for a, b in zip(tree_leaves(g_sum), tree_leaves(g_full), strict=True):
            assert torch.allclose(a, b, atol=1e-6), agg


def test_entropy_helper_agrees_with_sequence_logprobs_and_lowers_the_loss_of_flat_policies():
    params, buf = _params(), _buffer()
    args = (params, CFG, buf.tokens, buf.positions, buf.segment_ids)
    lp, ent = model.sequence_logprobs_and_entropy(*args)
    assert torch.equal(lp, model.sequence_logprobs(*args))
    assert ent.shape == lp.shape and bool((ent > 0).all()) and bool((ent <= torch.log(torch.tensor(13.0)) + 1e-5).all())
    base = objective.make_policy_loss(CFG, objective.ObjectiveConfig())(params, buf, None)[0]
    bonus, aux = objective.make_policy_loss(CFG, objective.ObjectiveConfig(entropy_coef=0.1))(params, buf, None)
    assert torch.allclose(bonus, base - 0.1 * aux["entropy"], atol=1e-6)


def test_kl_in_reward_changes_advantages_not_the_loss_terms():
    buf = _buffer()
    cfg = objective.ObjectiveConfig(advantage_estimator="reinforce_pp", kl_coef=0.1, use_kl_loss=False, kl_type="k1")
    out = objective.with_advantages(buf, cfg)
    plain = objective.with_advantages(buf, objective.ObjectiveConfig(advantage_estimator="reinforce_pp"))
    assert not torch.equal(out.advantages, plain.advantages)
    _, aux = objective.make_policy_loss(CFG, cfg)(_params(), out, None)
    assert "kl" not in aux


def test_ppo_actor_critic_step_trains_both_and_round_trips_a_checkpoint(tmp_path):
    policy = train.init_state(_params(), prng.key(3))
    state = objective.init_actor_critic(policy)
    assert state.params is policy.params and int(state.step) == 0
    cfg = objective.ObjectiveConfig(advantage_estimator="gae", lam=0.9)
    buf = _buffer()
    values = objective.critic_values(state, CFG, buf)
    assert torch.equal(values, torch.zeros_like(values))  # zero value head: V = 0 at the start
    buf = objective.with_advantages(buf, cfg, values)
    # with V = 0 and gamma = 1, GAE's returns are lambda-returns: lam^(tokens to the end) * R
    to_end = buf.loss_mask.flip(-1).cumsum(-1).flip(-1) - 1
    assert torch.allclose(buf.returns, buf.rewards[:, None] * 0.9**to_end * buf.loss_mask)
    oc = optim.OptimConfig(lr=1e-2)
    new, metrics = objective.actor_critic_step(state, buf, prng.key(4), objective.make_policy_loss(CFG, cfg),
                                               objective.make_value_loss(CFG, cfg), oc, oc)
    assert int(new.policy.step) == 1 and int(new.critic.step) == 1 and "critic_loss" in metrics
    assert tree_hash(new.policy.params) != tree_hash(policy.params)
    assert tree_hash(new.critic.params) != tree_hash(state.critic.params)
    after = objective.make_value_loss(CFG, cfg)(new.critic.params, buf, None)[0]
    assert float(after) < float(metrics["critic_loss"])  # one step lowers the value loss
    checkpoint.save(str(tmp_path / "ck"), new)
    back = checkpoint.load(str(tmp_path / "ck")).tree
    assert isinstance(back, ActorCriticState) and tree_hash(back) == tree_hash(new)


def test_packed_micro_batches_accumulate_to_the_whole_batch_gradient():
    from miles_fn import packing

    params, buf = _params(), _buffer()
    for agg, pl in (("token_mean", "dual_clip"), ("seq_mean_token_mean", "pg")):
        fn = objective.make_policy_loss(CFG, objective.ObjectiveConfig(loss_agg=agg, policy_loss=pl, kl_coef=0.1,
                                                                       entropy_coef=0.01))
        g_full, l_full = _loss_and_grads(fn, params, buf)
        g_sum, l_sum, _, stats = train.accumulate_gradients(params, packing.pack(buf, 12), prng.key(0), fn)
        assert float(stats["micro_batches"]) > 1
        assert torch.allclose(l_sum, l_full, atol=1e-6), agg
        for a, b in zip(tree_leaves(g_sum), tree_leaves(g_full), strict=True):
            assert torch.allclose(a, b, atol=1e-6), agg


def test_composed_objective_with_tis_weights_each_token_by_the_capped_ratio():
    """pg + TIS by hand in float64: loss = sum(-A * logp * min(exp(logp - logp_engine), cap) * mask) / sum(mask)."""
    from miles_fn import offpolicy

    params, buf = _params(), _buffer()
    cap = 0.1  # the ratios on this batch are about 0.03 to 0.45
    fn = objective.make_policy_loss(CFG, objective.ObjectiveConfig(policy_loss="pg"),
                                    offpolicy_cfg=offpolicy.OffPolicyConfig(correction="tis", tis_cap=cap))
    loss, aux = fn(params, buf, None)
    logp = model.sequence_logprobs(params, CFG, buf.tokens, buf.positions, buf.segment_ids).double()
    m = buf.loss_mask.double()
    w = torch.clamp(torch.exp(logp - buf.old_logprobs.double()), max=cap) * m
    want = (-buf.advantages.double() * logp * w * m).sum() / m.sum()
    assert torch.allclose(loss.double(), want, rtol=1e-5, atol=1e-7)
    assert torch.allclose(aux["is_weight_mean"].double(), w.sum() / m.sum(), rtol=1e-5)
    assert (w < cap).any() and (w[m > 0] == cap).any()  # the cap binds on some tokens and not on others
