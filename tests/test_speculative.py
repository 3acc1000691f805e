"""Speculative decoding against plain decoding (the independent reference: miles_fn.generate)."""

import pytest
import torch

import ops
from miles_fn import model, prng
from miles_fn.config import ModelConfig
from miles_fn.generate import generate
from miles_fn.sampling import SamplingConfig
from miles_fn.speculative import SpecStats, generate_speculative, verify
from ops import decode_cpu

CFG = ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
DRAFT_CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                        num_kv_heads=1)
# Mixed lengths, a repeated prompt (the shared prefill), a one-token prompt.
PROMPTS = [[3, 7, 11, 2, 9], [4], [8, 8, 1, 30, 22, 17, 5, 6], [12, 40], [4]]
TORCH = ops.OpsConfig(decode_backend="torch")
SAMPLINGS = (
    SamplingConfig(temperature=1.0, max_new_tokens=12, stop_token_ids=(5,)),
    SamplingConfig(temperature=0, max_new_tokens=9),
    SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=10, vocab_limit=40),
)


@pytest.fixture(scope="module")
def models():
    target = model.init_params(CFG, prng.key(0), std=0.3)  # peaked enough that drafts get accepted
    random_draft = model.init_params(DRAFT_CFG, prng.key(1), std=0.3)
    # "trained-ish": a perturbed copy of the target, which agrees with it often but not always
    near = {**target, "layers": [{n: w + 0.05 * prng.normal(prng.fold_in(prng.key(2), i), tuple(w.shape))
                                  for n, w in layer.items()} for i, layer in enumerate(target["layers"])]}
    return target, [(random_draft, DRAFT_CFG), (near, CFG), (target, CFG)]


def _both(target, draft, dcfg, s, k, oc):
    plain = generate(target, CFG, PROMPTS, prng.key(3), s, ops_cfg=oc)
    spec, stats = generate_speculative(target, CFG, draft, dcfg, PROMPTS, prng.key(3), s, k, ops_cfg=oc)
    return plain, spec, stats


@pytest.mark.parametrize("k", [1, 3, 4])
def test_bitwise_plain_decoding_under_invariant_ops(models, k):
    target, drafts = models
    accepted = 0
    for draft, dcfg in drafts:
        for s in SAMPLINGS:
            plain, spec, stats = _both(target, draft, dcfg, s, k, ops.INVARIANT)
            assert spec.tokens == plain.tokens
            assert spec.finish_reasons == plain.finish_reasons
            for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
                assert torch.equal(torch.tensor(a), torch.tensor(b))  # bit for bit
            assert stats.verifies > 0
            accepted += sum(stats.accepted_at)
    assert accepted > 0  # the accepting path ran, not only the rejecting one


@pytest.mark.parametrize("k", [1, 3])
def test_reference_ops_same_tokens_logprobs_to_rounding(models, k):
    target, drafts = models
    for draft, dcfg in drafts:
        for s in SAMPLINGS:
            plain, spec, _ = _both(target, draft, dcfg, s, k, TORCH)
            assert spec.tokens == plain.tokens
            for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
                assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


@pytest.mark.skipif(bool(decode_cpu.status()), reason="no C decode kernel here")
@pytest.mark.parametrize("k", [1, 3])
def test_on_the_c_kernel_the_same_tokens_as_plain_decoding_on_it(models, monkeypatch, k):
    """decode_backend='auto': plain generate decodes with the C kernel, speculation drafts and verifies with
    its block steps (k+1 tokens a row in one call). Same tokens, log-probs to float32 rounding."""
    blocks, computed = [], []
    real = decode_cpu.DecodePlan.block_step

    def counted(self, tokens, t0, col, rows=None, head=True):
        blocks.append((self._model.hidden, tokens.shape[1]))
        computed.append(tokens.shape[0])
        return real(self, tokens, t0, col, rows, head)

    monkeypatch.setattr(decode_cpu.DecodePlan, "block_step", counted)
    target, drafts = models
    auto = ops.OpsConfig(decode_backend="auto")
    for draft, dcfg in drafts:
        for s in SAMPLINGS:
            plain, spec, _ = _both(target, draft, dcfg, s, k, auto)
            assert spec.tokens == plain.tokens
            assert spec.finish_reasons == plain.finish_reasons
            for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
                assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    # the verify and the (hidden-32) draft's first forward ran in the kernel
    assert (CFG.hidden_size, k + 1) in blocks and (DRAFT_CFG.hidden_size, 2) in blocks
    assert min(computed) < len(PROMPTS)  # rows that had stopped left the kernel's forwards
    blocks.clear()
    _both(target, drafts[0][0], DRAFT_CFG, SAMPLINGS[0], k, ops.INVARIANT)
    assert blocks and all(h == DRAFT_CFG.hidden_size for h, _ in blocks)  # the target never under invariant ops


@pytest.mark.parametrize("oc", [ops.INVARIANT, TORCH, ops.OpsConfig(decode_backend="auto")],
                         ids=["invariant", "torch", "auto"])
def test_plain_steps_past_disable_by_batch_size_keep_plain_decodings_samples(models, oc):
    """disable_by_batch_size=3: rounds with more live rows are plain steps (1 token a row, no drafts), then the
    rows left speculate. The tokens are plain decoding's; the log-probs bitwise under invariant ops."""
    target, drafts = models
    # This stop token ends the rows after 4, 8, 11, 12 and 12 tokens: 5 live rows, then 3 and fewer.
    s = SamplingConfig(temperature=1.0, max_new_tokens=12, stop_token_ids=(15,))
    plain = generate(target, CFG, PROMPTS, prng.key(3), s, ops_cfg=oc)
    assert sorted(len(t) for t in plain.tokens) == [4, 8, 11, 12, 12]
    for draft, dcfg in drafts[1:]:
        spec, stats = generate_speculative(target, CFG, draft, dcfg, PROMPTS, prng.key(3), s, 3, ops_cfg=oc,
                                           disable_by_batch_size=3)
        assert spec.tokens == plain.tokens and spec.finish_reasons == plain.finish_reasons
        for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
            if oc.invariant:
                assert torch.equal(torch.tensor(a), torch.tensor(b))
            else:
                assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
        assert sum(stats.plain) > 0 and stats.verifies > 0 and sum(stats.accepted_at) > 0
        # each row's tokens after the first: 1 per plain step, 1..k+1 per verify
        for toks, h, p in zip(spec.tokens, stats.rows, stats.plain, strict=True):
            assert sum(h) + p <= len(toks) - 1 <= 4 * sum(h) + p
    # Counts of calls add up row by row, a call without plain steps counting 0 for each of its rows.
    both = stats.add(SpecStats(1, 2, (1, 0, 0), ((0, 1, 0, 0),)))
    assert both.plain == (*stats.plain, 0) and len(both.rows) == len(both.plain)
    with pytest.raises(ValueError, match="disable_by_batch_size must be >= 0"):
        generate_speculative(target, CFG, *drafts[1], PROMPTS, prng.key(3), s, 3, disable_by_batch_size=-1)


def test_acceptance_rule_on_hand_built_distributions():
    # p = (.5, .3, .2) at every column: inverse CDF with cdf (.5, .8, 1) maps u < .5 -> 0, [.5, .8) -> 1, else 2.
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2])).expand(4, 3, 3)
    u = torch.tensor([[0.6, 0.1, 0.9],   # samples 1, 0, 2
                      [0.6, 0.1, 0.9],
                      [0.2, 0.7, 0.85],  # samples 0, 1, 2
                      [0.99, 0.0, 0.55]], dtype=torch.float64)  # samples 2, 0, 1
    drafts = torch.tensor([[1, 0], [1, 2], [1, 1], [2, 0]])
    s, lps, a = verify(logits, drafts, u, SamplingConfig(temperature=1.0))
    assert s.tolist() == [[1, 0, 2], [1, 0, 2], [0, 1, 2], [2, 0, 1]]
    assert a.tolist() == [2, 1, 0, 2]  # all / first only / none (target's 0 kept) / all, bonus 1
    expect = torch.log(torch.tensor([0.5, 0.3, 0.2]))[s]
    assert torch.allclose(lps, expect, atol=1e-6)
    # P(accept d) = p(d) for a deterministic draft: over a fine uniform grid, exactly the CDF step widths.
    grid = (torch.arange(10000, dtype=torch.float64) + 0.5) / 10000
    one = torch.log(torch.tensor([0.5, 0.3, 0.2])).expand(10000, 2, 3)
    for tok, p in ((0, 0.5), (1, 0.3), (2, 0.2)):
        _, _, acc = verify(one, torch.full((10000, 1), tok), torch.stack([grid, grid], 1), SamplingConfig())
        assert abs(acc.double().mean().item() - p) < 1e-3
    # Greedy target: accept exactly the argmax.
    _, _, g = verify(logits[:2], torch.tensor([[0, 0], [1, 0]]), None, SamplingConfig(temperature=0))
    assert g.tolist() == [2, 0]


def test_stop_tokens_and_lengths(models):
    target, drafts = models
    # The target as its own draft under greedy decoding accepts every draft: stops land inside accepted blocks.
    greedy = generate(target, CFG, PROMPTS, prng.key(3), SamplingConfig(temperature=0, max_new_tokens=12),
                      ops_cfg=ops.INVARIANT)
    stop = greedy.tokens[2][4]  # a token the greedy target emits mid-block
    for n_new in (1, 2, 5, 12):
        for stops in ((), (stop,)):
            s = SamplingConfig(temperature=0, max_new_tokens=n_new, stop_token_ids=stops)
            plain, spec, stats = _both(target, target, CFG, s, 3, ops.INVARIANT)
            assert spec.tokens == plain.tokens and spec.finish_reasons == plain.finish_reasons
            assert all(len(t) <= n_new for t in spec.tokens)
            if n_new == 1:
                assert stats.verifies == 0  # the prefill's token alone
    s = SamplingConfig(temperature=0, max_new_tokens=12, stop_token_ids=(stop,))
    _, spec, stats = _both(target, target, CFG, s, 3, ops.INVARIANT)
    assert spec.tokens[2][-1] == stop and spec.finish_reasons[2] == "stop"
    assert len(spec.tokens[2]) == greedy.tokens[2].index(stop) + 1 < 12
    assert stats.accept_rate == 1.0


def test_padded_vocab_draft_proposes_only_sampled_ids(models):
    target, _ = models
    limit = 40
    # Rows past vocab_limit (no tokens) dominate every argmax of this copy: only the cut makes its drafts usable.
    padded = {**target, "embed": target["embed"].clone()}
    padded["embed"][limit:] *= 30.0
    s = SamplingConfig(temperature=0, max_new_tokens=8, vocab_limit=limit)
    plain, spec, stats = _both(padded, padded, CFG, s, 3, ops.INVARIANT)
    assert spec.tokens == plain.tokens
    assert max(max(t) for t in spec.tokens) < limit
    assert stats.accept_rate == 1.0


def test_stats_and_bad_inputs(models):
    target, drafts = models
    st = SpecStats(10, 25, (8, 5, 2))
    assert st.tokens_per_verify == 2.5 and st.accept_rate == 15 / 30
    assert st.accept_by_position == (0.8, 5 / 8, 2 / 5)
    assert st.add(SpecStats()).add(st) == SpecStats(20, 50, (16, 10, 4))
    other = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                        num_kv_heads=1)
    with pytest.raises(ValueError, match="vocab_size"):
        generate_speculative(target, CFG, model.init_params(other, prng.key(0)), other, PROMPTS, prng.key(0),
                             SamplingConfig(), 2)
    with pytest.raises(ValueError, match="speculative_num_steps"):
        generate_speculative(target, CFG, target, CFG, PROMPTS, prng.key(0), SamplingConfig(), 0)
