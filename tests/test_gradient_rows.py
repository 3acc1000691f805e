"""Training only the rows with a non-zero advantage: the same loss, gradient and update as the whole batch."""

import dataclasses
import types

import pytest
import torch

from launch import rl
from launch.memory import MemoryConfig
from miles_fn import model, objective, optim, packing, prng, train
from miles_fn.config import ModelConfig
from miles_fn.rollout_buffer import build_rollout_buffer, gradient_rows
from state.tree import tree_leaves

CFG = ModelConfig(vocab_size=13, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2, num_kv_heads=1,
                  max_position_embeddings=32)
GROUPS = [0, 0, 1, 1, 2, 2, 2, 3, 3, 3]
# group 0 all right, group 2 all wrong: no gradient; in group 3 the 0.5 is the group's mean, so advantage 0
REWARDS = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.5]
TRAINED = [2, 3, 7, 8]


def _buffer(rewards=REWARDS, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompt_of = {0: [1, 3, 4], 1: [1, 5], 2: [1, 6, 7, 8], 3: [1, 9]}
    prompts = [prompt_of[k] for k in GROUPS]
    lengths = (2, 3, 1, 0, 4, 2, 1, 3, 0, 2)
    responses = [[int(x) for x in torch.randint(3, 13, (n,), generator=g)] + [2] for n in lengths]
    # engine log-probs away from the model's, so that the ratios differ from 1 and some clip
    lps = [[-2.5 * float(x) for x in torch.rand(len(r), generator=g)] for r in responses]
    return build_rollout_buffer(prompts, responses, lps, rewards, GROUPS)


def _params():
    return model.init_params(CFG, prng.key(0), std=0.3)


def _grads(loss_fn, buf):
    g, (loss, _) = train.loss_and_grad(_params(), buf, prng.key(0), loss_fn)
    return loss, tree_leaves(g)


def _assert_same(a, b, what):
    (la, ga), (lb, gb) = a, b
    assert torch.allclose(la, lb, rtol=1e-5, atol=1e-7), (what, la, lb)
    for x, y in zip(ga, gb, strict=True):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-7), (what, (x - y).abs().max())


def test_the_cut_keeps_the_rows_with_a_non_zero_advantage_and_the_whole_batch_counts():
    buf = _buffer()
    cut = gradient_rows(buf)
    assert cut.group_ids.tolist() == [GROUPS[i] for i in TRAINED]
    assert torch.equal(cut.tokens, buf.tokens[TRAINED]) and torch.equal(cut.advantages, buf.advantages[TRAINED])
    assert float(cut.num_tokens) == float(buf.loss_mask.sum()) and float(cut.num_samples) == len(GROUPS)
    assert gradient_rows(cut) is cut  # a cut is its own cut, with the counts it carries


@pytest.mark.parametrize("shared_prefix", [False, True])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_the_default_loss_on_the_cut_equals_the_whole_batch(shared_prefix, agg):
    buf = _buffer()
    fn = train.make_grpo_loss(CFG, train.PolicyLossConfig(loss_agg=agg, shared_prefix=shared_prefix))
    full = _grads(fn, buf)
    assert float(full[0]) != 0.0
    _assert_same(_grads(fn, gradient_rows(buf)), full, (agg, shared_prefix))


@pytest.mark.parametrize("policy_loss", objective.ADVANTAGE_SCALED_LOSSES)
def test_every_advantage_scaled_loss_and_aggregation_on_the_cut_equals_the_whole_batch(policy_loss):
    buf = _buffer()
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        cfg = objective.ObjectiveConfig(policy_loss=policy_loss, loss_agg=agg, max_response_len=6)
        assert cfg.skips_zero_advantage_rows is False  # not asked for
        fn = objective.make_policy_loss(CFG, cfg)
        # the reference divides by the batch's own counts (Dr. GRPO: N * max_response_len)
        _assert_same(_grads(fn, gradient_rows(buf)), _grads(fn, objective.with_global_counts(buf)), (policy_loss, agg))


def test_packed_micro_batches_of_the_cut_accumulate_to_the_whole_batch_gradient():
    buf = _buffer()
    fn = train.make_grpo_loss(CFG, train.PolicyLossConfig())
    mbs = packing.pack(gradient_rows(buf), max_tokens=12)
    assert len(mbs) >= 2 and all(float(mb.num_tokens) == float(buf.loss_mask.sum()) for mb in mbs)
    g, loss, _, _ = train.accumulate_gradients(_params(), mbs, prng.key(0), fn)
    _assert_same((loss, tree_leaves(g)), _grads(fn, buf), "packed")


def test_a_batch_without_gradient_keeps_one_row_and_a_zero_gradient():
    buf = _buffer(rewards=[1.0] * len(GROUPS))
    cut = gradient_rows(buf)
    assert cut.tokens.shape[0] == 1
    loss, grads = _grads(train.make_grpo_loss(CFG, train.PolicyLossConfig()), cut)
    assert float(loss) == 0.0 and all(float(x.abs().max()) == 0.0 for x in grads)


def test_the_cut_applies_only_where_every_loss_term_scales_with_the_advantage():
    on = objective.ObjectiveConfig(skip_zero_advantage_rows=True)
    assert on.skips_zero_advantage_rows
    assert not dataclasses.replace(on, kl_coef=0.1).skips_zero_advantage_rows  # a KL loss term
    assert dataclasses.replace(on, kl_coef=0.1, use_kl_loss=False).skips_zero_advantage_rows  # KL in the reward
    assert not dataclasses.replace(on, entropy_coef=0.01).skips_zero_advantage_rows
    # Dr. GRPO's N * T without a fixed T would divide by the cut's width
    assert not dataclasses.replace(on, loss_agg="seq_mean_token_sum_norm").skips_zero_advantage_rows
    assert dataclasses.replace(on, loss_agg="seq_mean_token_sum_norm", max_response_len=6).skips_zero_advantage_rows


def _run_cfg(skip: bool):
    loss = train.PolicyLossConfig(shared_prefix=True)
    return types.SimpleNamespace(
        objective=objective.ObjectiveConfig(shared_prefix=True, skip_zero_advantage_rows=skip), model=CFG,
        memory=MemoryConfig(), custom_loss="", loss=loss, ops=train.ops.REFERENCE, offpolicy=None,
        optim=optim.OptimConfig(lr=1e-2),
    )


def test_the_runs_update_with_the_cut_is_the_update_of_the_whole_batch():
    buf, key = _buffer(), prng.key(3)
    state = train.init_state(_params(), prng.key(4))
    (s_cut, m_cut), (s_all, m_all) = (rl.make_update(_run_cfg(skip))(state, buf, key) for skip in (True, False))
    assert float(m_cut["train_rows_frac"]) == pytest.approx(len(TRAINED) / len(GROUPS))
    assert "train_rows_frac" not in m_all
    for k in ("loss", "grad_norm"):
        assert torch.allclose(m_cut[k], m_all[k], rtol=1e-5), k
    for a, b in zip(tree_leaves(s_cut.params), tree_leaves(s_all.params), strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
