"""Packing, gradient accumulation and OOM recovery against the unpacked, whole-batch computation.

The reference is the right-padded forward and train step (one sample per row), whose forward
tests/test_model_parity.py checks against transformers.
"""

import dataclasses
import weakref

import pytest
import torch
from torch.func import grad

import ops
from miles_fn import model, optim, packing, prng, train
from miles_fn.batching import pack_right_padded
from miles_fn.config import ModelConfig
from miles_fn.memory import MemoryConfig
from state.train_state import RolloutBuffer
from state.tree import tree_hash, tree_leaves, tree_map

CFG = ModelConfig(vocab_size=37, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
LENGTHS = [3, 17, 5, 12, 2, 9, 1, 14, 6, 8]


@pytest.fixture(scope="module")
def params():
    return model.init_params(CFG, prng.key(0), std=0.3)


def make_buffer(lengths=LENGTHS, seed=0, with_ref=True) -> RolloutBuffer:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, CFG.vocab_size, (min(2, n),), generator=g).tolist() for n in lengths]
    resps = [torch.randint(1, CFG.vocab_size, (n - min(2, n),), generator=g).tolist() for n in lengths]
    tokens, positions, seg, mask = pack_right_padded(prompts, resps)
    n = len(lengths)
    old = -torch.rand(mask.shape, generator=g) * 3 * mask
    adv = torch.randn(n, generator=g)[:, None] * mask
    ref = -torch.rand(mask.shape, generator=g) * 3 * mask if with_ref else None
    return RolloutBuffer(tokens, positions, seg, mask, old, adv, torch.randn(n, generator=g),
                         torch.arange(n) // 2, ref)


def assert_trees_close(a, b, rel=2e-5):
    """Leafwise |a - b| <= rel * max|b| + 1e-7: float32 agreement at each tensor's own scale."""
    for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True):
        if x.dtype.is_floating_point:
            assert float((x - y).abs().max()) <= rel * float(y.abs().max()) + 1e-7, (x - y).abs().max()
        else:
            assert torch.equal(x, y)


def valid_columns(buf: RolloutBuffer) -> torch.Tensor:
    lengths = (buf.segment_ids != 0).sum(-1)
    return torch.arange(buf.tokens.shape[1] - 1)[None, :] < (lengths[:, None] - 1)


def test_plan_is_deterministic_complete_and_within_budget():
    lengths = [5, 31, 7, 7, 2, 19, 30, 1, 12, 12, 3]
    mbs = packing.plan(lengths, max_tokens=64, row_len=32)
    assert mbs == packing.plan(lengths, max_tokens=64, row_len=32)
    seen = sorted(i for mb in mbs for row in mb for i in row)
    assert seen == list(range(len(lengths)))
    for mb in mbs:
        assert len(mb) * 32 <= 64
        assert all(sum(lengths[i] for i in row) <= 32 for row in mb)
    # first-fit-decreasing by hand: 31+1 | 30+2 | 19+12 | 12+7+7+5 | 3
    rows = [row for mb in mbs for row in mb]
    assert rows == [[1, 7], [6, 4], [5, 8], [9, 2, 3, 0], [10]]


def test_plan_names_a_sample_that_cannot_fit():
    with pytest.raises(ValueError, match="sample 1 has 40 tokens.*max_tokens_per_micro_batch=32"):
        packing.plan([3, 40], max_tokens=32)
    with pytest.raises(ValueError, match="pack_row_len=8"):
        packing.plan([3, 9], max_tokens=32, row_len=8)


def test_packed_layout_restarts_positions_and_masks_boundaries():
    buf = make_buffer()
    for mb in packing.pack(buf, max_tokens=34, row_len=17):
        assert mb.tokens.shape[0] * mb.tokens.shape[1] <= 34
        flat_pos, flat_seg = mb.positions.reshape(-1), mb.segment_ids.reshape(-1)
        width = mb.tokens.shape[1]
        for s, n, i in zip(mb.starts.tolist(), mb.lengths.tolist(), mb.sample_index.tolist(), strict=True):
            assert flat_pos[s : s + n].tolist() == list(range(n))
            assert torch.equal(mb.tokens.reshape(-1)[s : s + n], buf.tokens[i, :n])
            assert len(set(flat_seg[s : s + n].tolist())) == 1 and flat_seg[s] > 0
            r, o = divmod(s, width)
            if o + n - 1 < width - 1:  # the column predicting the next sample's first token
                assert mb.loss_mask[r, o + n - 1] == 0 and mb.advantages[r, o + n - 1] == 0
        # cu_seqlens: the boundaries of every run of one segment id in the flattened row(s)
        cu = mb.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == mb.tokens.numel() and mb.cu_seqlens.dtype == torch.int32
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            assert len(set(flat_seg[a:b].tolist())) == 1 and a // width == (b - 1) // width
        assert mb.max_seqlen == max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True))
    # per-token fields and the loss-mask token count survive the round trip
    mbs = packing.pack(buf, max_tokens=34, row_len=17)
    for f in ("loss_mask", "old_logprobs", "advantages", "ref_logprobs"):
        back = packing.unpack([getattr(mb, f) for mb in mbs], mbs, *buf.tokens.shape)
        assert torch.equal(back, getattr(buf, f) * valid_columns(buf)), f
    assert sum(float(mb.loss_mask.sum()) for mb in mbs) == float(buf.loss_mask.sum()) == float(mbs[0].num_tokens)
    for mb in mbs:  # per-sample view and back
        assert torch.equal(packing.packed_columns(packing.sample_columns(mb.old_logprobs, mb), mb), mb.old_logprobs)


@pytest.mark.parametrize("row_len", [17, 34, 64])
def test_packed_logprobs_equal_each_sample_run_alone(params, row_len):
    buf = make_buffer()
    mbs = packing.pack(buf, max_tokens=64, row_len=row_len)
    assert any(int((mb.segment_ids.max(-1).values > 1).sum()) for mb in mbs)  # some row does hold several
    lp = [model.sequence_logprobs(params, CFG, mb.tokens, mb.positions, mb.segment_ids) for mb in mbs]
    packed = packing.unpack(lp, mbs, *buf.tokens.shape)
    for i, n in enumerate(LENGTHS):
        alone = model.sequence_logprobs(params, CFG, buf.tokens[i : i + 1, :n], torch.arange(n)[None],
                                        torch.ones(1, n, dtype=torch.int64))
        torch.testing.assert_close(packed[i, : n - 1], alone[0], rtol=0, atol=2e-5)


def test_cu_seqlens_slices_run_alone_give_the_packed_logprobs(params):
    """The varlen form: each [cu[k], cu[k+1]) of the flattened tokens is one sequence on its own."""
    buf = make_buffer()
    (mb,) = packing.pack(buf, max_tokens=128, row_len=128)
    assert mb.tokens.shape[0] == 1
    lp = model.sequence_logprobs(params, CFG, mb.tokens, mb.positions, mb.segment_ids)[0]
    cu = mb.cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        if b - a < 2:
            continue
        alone = model.sequence_logprobs(params, CFG, mb.tokens[:, a:b], mb.positions[:, a:b],
                                        torch.ones(1, b - a, dtype=torch.int64))
        torch.testing.assert_close(lp[a : b - 1], alone[0], rtol=0, atol=2e-5)


def test_changing_one_sample_changes_no_logprob_of_another_bitwise(params):
    buf = make_buffer()
    other = buf.tokens.clone()
    victim = 3
    n = LENGTHS[victim]
    other[victim, :n] = (other[victim, :n] + 7) % (CFG.vocab_size - 1) + 1
    buf2 = buf._replace(tokens=other)
    mbs1, mbs2 = packing.pack(buf, 64, 32), packing.pack(buf2, 64, 32)
    lp1 = packing.unpack([model.sequence_logprobs(params, CFG, m.tokens, m.positions, m.segment_ids) for m in mbs1],
                         mbs1, *buf.tokens.shape)
    lp2 = packing.unpack([model.sequence_logprobs(params, CFG, m.tokens, m.positions, m.segment_ids) for m in mbs2],
                         mbs2, *buf.tokens.shape)
    (host,) = [m for m in mbs1 if victim in m.sample_index.tolist()]
    assert len(host.sample_index) > 1  # the victim shares its micro-batch
    keep = torch.ones(len(LENGTHS), dtype=torch.bool)
    keep[victim] = False
    assert torch.equal(lp1[keep], lp2[keep])
    assert not torch.equal(lp1[victim], lp2[victim])


def grpo_loss(agg: str, kl: float = 0.1):
    return train.make_grpo_loss(CFG, train.PolicyLossConfig(kl_coef=kl, loss_agg=agg, eps_clip=0.1))


@pytest.mark.parametrize("agg,layout", [("token_mean", "packed"), ("seq_mean_token_mean", "packed"),
                                        ("token_mean", "padded")])
def test_accumulated_gradients_equal_the_whole_batch(params, agg, layout):
    buf = make_buffer()
    loss_fn = grpo_loss(agg)
    key = prng.key(1)
    g_full, (loss_full, aux_full) = grad(lambda p: train._with_loss_aux(loss_fn(p, buf, key)), has_aux=True)(params)
    mbs = packing.pack(buf, max_tokens=34, row_len=17) if layout == "packed" else packing.pad(buf, 51)
    assert len(mbs) >= 3
    g_acc, loss_acc, aux_acc, stats = train.accumulate_gradients(params, mbs, key, loss_fn)
    assert stats["micro_batches"] == len(mbs) and stats["oom_splits"] == 0
    torch.testing.assert_close(loss_acc, loss_full, rtol=1e-5, atol=1e-6)
    for k in aux_full:
        torch.testing.assert_close(aux_acc[k], aux_full[k], rtol=1e-5, atol=1e-6, msg=k)
    assert_trees_close(g_acc, g_full)
    assert max(float(x.abs().max()) for x in tree_leaves(g_full)) > 1e-2  # the gradient is not trivially zero


def test_accumulated_update_equals_whole_batch_update(params):
    buf = make_buffer()
    loss_fn = grpo_loss("token_mean")
    # A large Adam eps makes the first update lr * g / (|g| + eps): continuous in g, so equal
    # gradients must give equal params (with eps 1e-8 it is lr * sign(g) and hides differences).
    ocfg = optim.OptimConfig(lr=0.1, eps=1e-2, max_grad_norm=1.0, weight_decay=0.01)
    s0 = train.init_state(params, prng.key(2))
    s_full, m_full = train.train_step(s0, buf, prng.key(3), loss_fn, ocfg)
    s_acc, m_acc = train.train_step_accumulated(s0, packing.pack(buf, 34, 17), prng.key(3), loss_fn, ocfg)
    again, _ = train.train_step_accumulated(s0, packing.pack(buf, 34, 17), prng.key(3), loss_fn, ocfg)
    assert tree_hash(again) == tree_hash(s_acc)  # a fixed plan and summation order: bitwise replayable
    assert int(s_acc.step) == int(s_full.step) == 1
    moved = max(float((a - b).abs().max())
                for a, b in zip(tree_leaves(s_full.params), tree_leaves(params), strict=True))
    assert moved > 1e-3
    assert_trees_close(s_acc, s_full)
    torch.testing.assert_close(m_acc["grad_norm"], m_full["grad_norm"], rtol=1e-5, atol=1e-6)


def test_accumulated_sft_loss_equals_whole_batch(params):
    buf = make_buffer(with_ref=False)
    loss_fn = train.make_sft_loss(CFG)
    key = prng.key(0)
    g_full, (l_full, _) = grad(lambda p: train._with_loss_aux(loss_fn(p, buf, key)), has_aux=True)(params)
    g_acc, l_acc, _, _ = train.accumulate_gradients(params, packing.pack(buf, 40, 20), key, loss_fn)
    torch.testing.assert_close(l_acc, l_full, rtol=1e-5, atol=1e-6)
    assert_trees_close(g_acc, g_full)


def oom_above(limit: int, loss_fn, seen: list):
    """A loss that raises torch.OutOfMemoryError on micro-batches of more than limit padded tokens."""

    def wrapped(p, batch, key):
        if batch.tokens.numel() > limit:
            raise torch.OutOfMemoryError(f"injected: {batch.tokens.numel()} tokens > {limit}")
        seen.extend(batch.sample_index.tolist())
        return loss_fn(p, batch, key)

    return wrapped


def test_injected_oom_splits_and_still_gives_the_unsplit_update(params):
    buf = make_buffer()
    loss_fn = grpo_loss("seq_mean_token_mean")
    ocfg = optim.OptimConfig(lr=0.1, eps=1e-2, max_grad_norm=1.0)
    s0 = train.init_state(params, prng.key(2))
    mbs = packing.pack(buf, max_tokens=128, row_len=64)
    s_ref, m_ref = train.train_step_accumulated(s0, mbs, prng.key(3), loss_fn, ocfg)
    seen, logged = [], []
    s_oom, m_oom = train.train_step_accumulated(s0, mbs, prng.key(3), oom_above(30, loss_fn, seen), ocfg,
                                                max_oom_splits=4, log=logged.append)
    assert sorted(seen) == list(range(len(LENGTHS)))  # every sample trained exactly once
    assert m_oom["oom_splits"] >= 2 and len(logged) == int(m_oom["oom_splits"])
    assert "splitting in two" in logged[0]
    assert m_oom["micro_batches"] > m_ref["micro_batches"]
    torch.testing.assert_close(m_oom["loss"], m_ref["loss"], rtol=1e-5, atol=1e-6)
    assert_trees_close(s_oom, s_ref)


def test_oom_retry_runs_after_the_failed_attempts_memory_is_released(params):
    # A failed attempt's activations live in its traceback's frames: a retry started inside the
    # `except` block would run with them still allocated (and, on a GPU, run out again).
    buf = make_buffer()
    mbs = packing.pack(buf, max_tokens=128, row_len=64)
    refs, alive_at_call = [], []
    inner = grpo_loss("token_mean")

    def loss_fn(p, batch, key):
        alive_at_call.append(sum(r() is not None for r in refs))
        if batch.tokens.numel() > 30:
            activations = torch.ones(4096)  # what the failed forward had allocated when it ran out
            refs.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("injected")
        return inner(p, batch, key)

    train.train_step_accumulated(train.init_state(params, prng.key(2)), mbs, prng.key(3), loss_fn,
                                 optim.OptimConfig(), max_oom_splits=4)
    assert refs and alive_at_call and max(alive_at_call) == 0, alive_at_call


def test_oom_recovery_is_bounded_and_says_what_to_change(params):
    buf = make_buffer()
    mbs = packing.pack(buf, max_tokens=128, row_len=64)
    ocfg = optim.OptimConfig()
    s0 = train.init_state(params, prng.key(2))
    with pytest.raises(torch.OutOfMemoryError, match="max_oom_splits=1.*max_tokens_per_micro_batch"):
        train.train_step_accumulated(s0, mbs, prng.key(3), oom_above(10, grpo_loss("token_mean"), []), ocfg,
                                     max_oom_splits=1)
    with pytest.raises(torch.OutOfMemoryError, match="micro-batch of 1 samples"):
        train.train_step_accumulated(s0, mbs, prng.key(3), oom_above(0, grpo_loss("token_mean"), []), ocfg,
                                     max_oom_splits=10)


def test_split_keeps_every_sample_and_the_whole_batch_normalisers():
    buf = make_buffer()
    (mb,) = packing.pack(buf, max_tokens=128, row_len=64)
    a, b = packing.split(mb)
    assert sorted(a.sample_index.tolist() + b.sample_index.tolist()) == list(range(len(LENGTHS)))
    assert float(a.num_tokens) == float(b.num_tokens) == float(buf.loss_mask.sum())
    back = packing.unpack([a.advantages, b.advantages], [a, b], *buf.tokens.shape)
    assert torch.equal(back, buf.advantages * valid_columns(buf))


def test_recompute_gives_the_same_gradients_under_torch_func_grad(params):
    buf = make_buffer()
    mb = packing.pack(buf, 64, 32)[0]
    key = prng.key(0)
    plain = train.make_grpo_loss(CFG, train.PolicyLossConfig(kl_coef=0.1))
    remat = train.make_grpo_loss(dataclasses.replace(CFG, recompute=True), train.PolicyLossConfig(kl_coef=0.1))
    g1 = grad(lambda p: plain(p, mb, key)[0])(params)
    g2 = grad(lambda p: remat(p, mb, key)[0])(params)
    assert_trees_close(g2, g1, rel=1e-5)


def test_autograd_gradient_equals_torch_func_grad_and_leaves_params_alone(params):
    buf = make_buffer()
    mb = packing.pack(buf, 64, 32)[0]
    loss_cfg = train.PolicyLossConfig(kl_coef=0.1, eps_clip=0.1)
    loss_fn = train.make_grpo_loss(dataclasses.replace(CFG, recompute=True), loss_cfg)
    before = tree_hash(params)
    g_func, (l_func, aux_func) = train.loss_and_grad(params, mb, prng.key(0), train.make_grpo_loss(CFG, loss_cfg),
                                                     use_autograd=False)
    g_ag, (l_ag, aux_ag) = train.loss_and_grad(params, mb, prng.key(0), loss_fn)
    assert tree_hash(params) == before and all(not x.requires_grad for x in tree_leaves(g_ag))
    torch.testing.assert_close(l_ag, l_func, rtol=1e-6, atol=1e-7)
    assert_trees_close(g_ag, g_func, rel=1e-5)
    assert_trees_close(aux_ag, aux_func, rel=1e-5)


def test_recompute_keeps_only_layer_inputs_for_backward(params):
    """Bytes autograd saves during the forward, counted with saved-tensor hooks (plain autograd)."""
    cfg = dataclasses.replace(CFG, num_layers=4)
    p = model.init_params(cfg, prng.key(0), std=0.3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    positions, seg = torch.arange(64).expand(2, 64), torch.ones(2, 64, dtype=torch.int64)

    def saved_bytes(c):
        q = dict(p)
        q["layers"] = [{n: w.detach().clone().requires_grad_() for n, w in layer.items()} for layer in p["layers"]]
        total = [0]

        def pack_hook(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
            out = model.forward(q, c, tokens, positions, model.causal_segment_mask(seg))
        out.sum().backward()
        return total[0], [w.grad.clone() for layer in q["layers"] for w in layer.values()]

    full, g_full = saved_bytes(cfg)
    remat, g_remat = saved_bytes(dataclasses.replace(cfg, recompute=True))
    assert remat < 0.6 * full, (remat, full)
    assert_trees_close(g_remat, g_full, rel=1e-5)


# Fixed-order accumulation (--true_on_policy): the update's bits do not depend on the token budget.

TILE = 34  # --invariant_grad_tile_tokens: rows of 17 (the longest sample), 2 rows a tile, 3 tiles


def invariant_update(params, budget: int, loss_fn=None, tile: int = TILE):
    """launch.memory.train_update as the main loop runs it with --true_on_policy at this budget."""
    from launch import memory as launch_memory

    loss_fn = loss_fn or train.make_grpo_loss(CFG, train.PolicyLossConfig(kl_coef=0.1, eps_clip=0.1), ops.INVARIANT)
    mcfg = MemoryConfig(max_tokens_per_micro_batch=budget, grad_tile_tokens=tile)
    ocfg = optim.OptimConfig(lr=0.1, eps=1e-2, max_grad_norm=1.0, weight_decay=0.01)
    return launch_memory.train_update(mcfg, CFG, train.init_state(params, prng.key(2)), make_buffer(), prng.key(3),
                                      loss_fn, ocfg)


def assert_bitwise(a, b):
    for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True):
        assert torch.equal(x, y), float((x.float() - y.float()).abs().max())


def test_true_on_policy_update_is_bitwise_the_same_under_every_budget(params):
    whole, m_whole = invariant_update(params, 10**6)  # every tile fits one micro-batch's budget
    assert int(whole.step) == 1 and float(m_whole["grad_norm"]) > 1.0  # a real, clipped update
    for budget in (TILE, 51, 2 * TILE + 1):  # one tile, 1.5 tiles, just over 2 tiles
        s, m = invariant_update(params, budget)
        assert_bitwise(s, whole)
        assert m.keys() == m_whole.keys() and float(m["token_budget"]) == budget
        for k in m_whole:
            if k != "token_budget":
                assert torch.equal(m[k], m_whole[k]), k


def test_true_on_policy_tiles_give_the_float64_whole_batch_gradient(params):
    """The tiled fold against an independent float64 whole-batch gradient (reference ops, right-padded)."""
    buf = make_buffer()
    pcfg = train.PolicyLossConfig(kl_coef=0.1, eps_clip=0.1)
    f64 = lambda t: t.double() if t is not None and t.dtype.is_floating_point else t  # noqa: E731
    p64, b64 = tree_map(f64, params), RolloutBuffer(*(f64(x) for x in buf))
    ref_loss = train.make_grpo_loss(CFG, pcfg, ops.REFERENCE)
    g64, (l64, _) = grad(lambda p: train._with_loss_aux(ref_loss(p, b64, prng.key(3))), has_aux=True)(p64)
    inv_loss = train.make_grpo_loss(CFG, pcfg, ops.INVARIANT)
    for tile in (17, TILE, 85):
        tiles = packing.pack(buf, tile, 17)
        g, loss, _, stats = train.accumulate_gradients(params, tiles, prng.key(3), inv_loss, fixed_order=True)
        assert stats["micro_batches"] == len(tiles)
        assert abs(float(loss) - float(l64)) <= 1e-5 * abs(float(l64))
        assert_trees_close(tree_map(torch.Tensor.double, g), g64, rel=1e-5)


def test_true_on_policy_never_splits_a_tile_on_oom(params):
    inv_loss = train.make_grpo_loss(CFG, train.PolicyLossConfig(kl_coef=0.1, eps_clip=0.1), ops.INVARIANT)
    whole, m_whole = invariant_update(params, 10**6)
    # an OOM above 40 tokens: the plain path at budget 85 would halve its micro-batches; the tiles fit
    s, m = invariant_update(params, 85, oom_above(40, inv_loss, seen := []))
    assert sorted(seen) == list(range(len(LENGTHS))) and m["oom_splits"] == 0
    assert_bitwise(s, whole)
    assert torch.equal(m["loss"], m_whole["loss"]) and torch.equal(m["grad_norm"], m_whole["grad_norm"])
    # an OOM on a tile itself is an error naming the tile size, not a split that would change the bits
    with pytest.raises(torch.OutOfMemoryError, match="gradient tile of .* lower --invariant_grad_tile_tokens"):
        invariant_update(params, 85, oom_above(20, inv_loss, []))


def test_true_on_policy_tile_that_does_not_fit_the_budget_is_named(params):
    from launch.memory import MemoryPlanError

    with pytest.raises(MemoryPlanError, match=r"--invariant_grad_tile_tokens=34\) does not fit .* budget of 20 tokens"):
        invariant_update(params, 20)
    with pytest.raises(MemoryPlanError, match="--invariant_grad_tile_tokens=10 is less than one row of 17"):
        invariant_update(params, 100, tile=10)
