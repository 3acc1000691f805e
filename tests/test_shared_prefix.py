"""The shared-prefix forward against each row run on its own, and the GRPO update with and without it.

The reference is the plain forward of one row at a time (tests/test_model_parity.py checks that
forward against transformers): no row shares anything with another there.
"""

import pytest
import torch
from torch.func import grad

import ops
from miles_fn import model, prng, train
from miles_fn.batching import pack_right_padded
from miles_fn.config import ModelConfig
from state.train_state import RolloutBuffer
from state.tree import tree_leaves

CFG = ModelConfig(vocab_size=37, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
# Three groups: prompt A's responses share their first token (the common prefix outgrows the prompt),
# prompt B has a response of one token, prompt C is alone in its group; groups are interleaved.
PROMPTS = [[1, 5, 6, 7], [2, 9], [1, 5, 6, 7], [3, 4, 4, 4, 4], [1, 5, 6, 7], [2, 9]]
RESPONSES = [[8, 9, 10], [5, 5, 5, 5], [8, 11], [7, 7], [8], [6]]
GROUPS = [0, 1, 0, 2, 0, 1]


@pytest.fixture(scope="module")
def params():
    return model.init_params(CFG, prng.key(0), std=0.3)


def batch() -> RolloutBuffer:
    tokens, positions, seg, mask = pack_right_padded(PROMPTS, RESPONSES)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(mask.shape, generator=g) * mask
    adv = torch.randn(len(PROMPTS), generator=g)[:, None] * mask
    return RolloutBuffer(tokens, positions, seg, mask, old, adv, torch.zeros(len(PROMPTS)), torch.tensor(GROUPS))


def alone(params, oc) -> list[torch.Tensor]:
    """Each row's log-probs from a forward of that row alone."""
    out = []
    for p, r in zip(PROMPTS, RESPONSES, strict=True):
        seq = torch.tensor([p + r])
        n = seq.shape[1]
        out.append(model.sequence_logprobs(params, CFG, seq, torch.arange(n)[None],
                                           torch.ones(1, n, dtype=torch.int64), ops_cfg=oc)[0])
    return out


def test_layout_is_each_groups_longest_common_prefix_capped_to_leave_each_row_a_token():
    b = batch()
    lay = model.shared_prefix_layout(b.tokens, b.segment_ids, b.group_ids)
    assert lay.prefix_rows.tolist() == [0, 1, 3]  # the first row of each group
    # A: [1,5,6,7,8] is common to all three rows, but row 4 ([1,5,6,7,8]) must keep one own token: 4.
    # B: the prompt [2,9] (the responses differ at once), capped by row 5's length 3 - 1 = 2.
    # C: alone, so everything but its last token: 6.
    assert lay.prefix_len.tolist() == [4, 2, 6]
    assert lay.row_group.tolist() == [0, 1, 0, 2, 0, 1]


def test_shared_prefix_logprobs_are_each_rows_own_bitwise_under_the_invariant_kernels(params):
    b = batch()
    got = model.sequence_logprobs(params, CFG, b.tokens, b.positions, b.segment_ids, ops_cfg=ops.INVARIANT,
                                  group_ids=b.group_ids)
    for i, ref in enumerate(alone(params, ops.INVARIANT)):
        assert torch.equal(got[i, : ref.numel()], ref), i


def test_shared_prefix_logprobs_and_entropy_match_each_row_alone_with_the_reference_kernels(params):
    b = batch()
    lp, ent = model.sequence_logprobs_and_entropy(params, CFG, b.tokens, b.positions, b.segment_ids,
                                                  group_ids=b.group_ids)
    plain_lp, plain_ent = model.sequence_logprobs_and_entropy(params, CFG, b.tokens, b.positions, b.segment_ids)
    for i, ref in enumerate(alone(params, ops.REFERENCE)):
        torch.testing.assert_close(lp[i, : ref.numel()], ref, atol=1e-5, rtol=0)
    valid = torch.arange(b.tokens.shape[1] - 1)[None] < ((b.segment_ids != 0).sum(-1, keepdim=True) - 1)
    torch.testing.assert_close(ent[valid], plain_ent[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(lp[valid], plain_lp[valid], atol=1e-5, rtol=0)


def test_the_grpo_gradient_is_the_plain_forwards(params):
    b = batch()
    key = prng.key(1)

    def g(shared: bool):
        loss_fn = train.make_grpo_loss(CFG, train.PolicyLossConfig(shared_prefix=shared))
        return grad(lambda p: loss_fn(p, b, key)[0])(params)

    shared, plain = tree_leaves(g(True)), tree_leaves(g(False))
    assert max(float(x.abs().max()) for x in plain) > 1e-3  # a real gradient, not zeros
    for x, y in zip(shared, plain, strict=True):
        assert float((x - y).abs().max()) <= 2e-5 * float(y.abs().max()) + 1e-7


def test_nothing_to_share_keeps_the_plain_forward():
    b = batch()
    # every row its own group, a packed row (two segments), a batch of one row
    assert model.shared_prefix_layout(b.tokens, b.segment_ids, torch.arange(len(PROMPTS))) is None
    seg = b.segment_ids.clone()
    seg[0, 3:] = 2 * (seg[0, 3:] > 0)
    assert model.shared_prefix_layout(b.tokens, seg, b.group_ids) is None
    assert model.shared_prefix_layout(b.tokens[:1], b.segment_ids[:1], b.group_ids[:1]) is None
