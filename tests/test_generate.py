"""The embedded engine against transformers' generate(), and its sampling contract."""

import torch

from miles_fn import generate as generate_module
from miles_fn import model, prng
from miles_fn.generate import MIN_SHARED_PREFIX, generate, shared_prefix_len
from miles_fn.sampling import SamplingConfig, filter_logits, sample, sample_with_uniform
from state import hf

PROMPTS = [[3, 7, 11, 2, 9], [4], [8, 8, 1, 30, 22, 17, 5, 6], [12, 40]]


def test_greedy_matches_transformers_generate(hf_models):
    ref_model, path = hf_models[("qwen2", False)]
    cfg, params = hf.load_hf(path)
    eos = 13
    gen = generate(params, cfg, PROMPTS, prng.key(0), SamplingConfig(temperature=0, max_new_tokens=10,
                                                                       stop_token_ids=(eos,)))
    for prompt, tokens, reason in zip(PROMPTS, gen.tokens, gen.finish_reasons):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                     eos_token_id=eos, pad_token_id=0)
        theirs = out[0, len(prompt):].tolist()
        if eos in theirs:
            theirs = theirs[: theirs.index(eos) + 1]
        assert tokens == theirs
        assert reason == ("stop" if tokens[-1] == eos else "length")
        assert len(tokens) == 10 or tokens[-1] == eos


def test_engine_logprobs_match_full_forward(hf_models):
    _, path = hf_models[("llama", True)]
    cfg, params = hf.load_hf(path)
    gen = generate(params, cfg, PROMPTS, prng.key(1), SamplingConfig(temperature=0.7, max_new_tokens=7))
    for prompt, tokens, lps in zip(PROMPTS, gen.tokens, gen.logprobs):
        seq = torch.tensor([prompt + tokens])
        t = seq.shape[1]
        full = model.sequence_logprobs(params, cfg, seq, torch.arange(t)[None], torch.ones(1, t, dtype=torch.long), 0.7)
        assert torch.allclose(full[0, len(prompt) - 1 :], torch.tensor(lps), atol=1e-4)


def test_sampling_is_a_function_of_the_key_and_request_not_the_batch(hf_models):
    _, path = hf_models[("qwen2", True)]
    cfg, params = hf.load_hf(path)
    s = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=6)
    full = generate(params, cfg, PROMPTS, prng.key(2), s)
    again = generate(params, cfg, PROMPTS, prng.key(2), s)
    assert full.tokens == again.tokens
    alone = generate(params, cfg, [PROMPTS[2]], prng.key(2), s, request_ids=[2])
    assert alone.tokens[0] == full.tokens[2]
    other = generate(params, cfg, PROMPTS, prng.key(3), s)
    assert other.tokens != full.tokens


def test_top_k_and_top_p_filters_hand_computed():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, 1.0)[0, 2:]).all()
    assert torch.isfinite(filter_logits(logits, 2, 1.0)[0, :2]).all()
    kept = torch.isfinite(filter_logits(logits, 0, 0.8))[0].tolist()
    assert kept == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    kept = torch.isfinite(filter_logits(logits, 0, 0.81))[0].tolist()
    assert kept == [True, True, True, False]
    keys = prng.fold_in(prng.key(0), torch.arange(2000))
    toks, _ = sample(logits.expand(2000, 4), keys, SamplingConfig(top_k=2))
    assert set(toks.tolist()) == {0, 1}


def test_inverse_cdf_picks_the_token_whose_interval_holds_u():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).expand(6, 4)
    u = torch.tensor([0.0, 0.1, 0.6, 0.9, 0.97, 1.0 - 2.0**-53], dtype=torch.float64)
    toks, lps = sample_with_uniform(logits, u, SamplingConfig())
    assert toks.tolist() == [0, 0, 1, 2, 3, 3]  # CDF 0.5, 0.8, 0.95, 1
    assert torch.allclose(lps, logits[0, toks], atol=1e-6)
    # a token outside top-k is never picked, even by u next to 1; its log-prob is the untruncated one
    toks, lps = sample_with_uniform(logits, u, SamplingConfig(top_k=2))
    assert toks.tolist() == [0, 0, 0, 1, 1, 1]  # CDF 0.625, 1
    assert torch.allclose(lps, logits[0, toks], atol=1e-6)


def test_sampled_frequencies_match_the_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, -30.0]])
    n = 40_000
    toks, _ = sample(logits.expand(n, 5), prng.fold_in(prng.key(5), torch.arange(n)), SamplingConfig())
    freq = torch.bincount(toks, minlength=5).double() / n
    p = torch.softmax(logits[0].double(), 0)
    assert torch.all((freq - p).abs() <= 5 * torch.sqrt(p * (1 - p) / n) + 1e-12), (freq, p)


def test_stop_tokens_and_max_new_tokens():
    from miles_fn.config import ModelConfig

    cfg = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1)
    params = model.init_params(cfg, prng.key(0), std=1.0)
    gen = generate(params, cfg, [[1, 2]] * 8, prng.key(4), SamplingConfig(max_new_tokens=5, stop_token_ids=(3, 4)))
    for toks, lps, reason in zip(gen.tokens, gen.logprobs, gen.finish_reasons):
        assert 1 <= len(toks) <= 5 and len(lps) == len(toks)
        assert not any(t in (3, 4) for t in toks[:-1])
        assert reason == ("stop" if toks[-1] in (3, 4) else "length")
        assert reason == "stop" or len(toks) == 5


def test_repeated_prompts_are_prefilled_once_and_sample_as_if_alone(hf_models):
    # A GRPO batch repeats each prompt group-size times; the engine prefills each distinct prompt once.
    # Under the invariant kernels every request must still get the bits it gets in a batch of its own.
    import ops

    _, path = hf_models[("qwen2", False)]
    cfg, params = hf.load_hf(path)
    prompts = [PROMPTS[i] for i in (0, 0, 2, 1, 2, 0, 3, 3)]
    sc = SamplingConfig(temperature=1.0, max_new_tokens=6)
    gen = generate(params, cfg, prompts, prng.key(5), sc, ops_cfg=ops.INVARIANT)
    assert len(set(map(tuple, gen.tokens))) > 1  # the copies sample different responses (own keys)
    for i, p in enumerate(prompts):
        alone = generate(params, cfg, [p], prng.key(5), sc, [i], ops_cfg=ops.INVARIANT)
        assert alone.tokens[0] == gen.tokens[i] and alone.logprobs[0] == gen.logprobs[i]
    # the reference kernels: the same tokens, log-probs to float tolerance
    fast = generate(params, cfg, prompts, prng.key(5), sc)
    for i, p in enumerate(prompts):
        alone = generate(params, cfg, [p], prng.key(5), sc, [i])
        assert alone.tokens[0] == fast.tokens[i]
        torch.testing.assert_close(torch.tensor(fast.logprobs[i]), torch.tensor(alone.logprobs[0]), atol=1e-5,
                                   rtol=0)


def test_shared_prefix_len_hand_computed():
    a = list(range(1, 11))  # 10 tokens
    assert shared_prefix_len([a + [50], a + [51, 52], a + [53]]) == 10
    assert shared_prefix_len([a, a + [60]]) == 9  # the shortest keeps a column of its own
    assert shared_prefix_len([a[:MIN_SHARED_PREFIX] + [70], a[:MIN_SHARED_PREFIX] + [71]]) == MIN_SHARED_PREFIX
    assert shared_prefix_len([a[: MIN_SHARED_PREFIX - 1] + [70], a[: MIN_SHARED_PREFIX - 1] + [71]]) == 0
    assert shared_prefix_len([a + [1]]) == 0 and shared_prefix_len([[9] + a, a]) == 0


def test_a_common_prefix_is_prefilled_once_and_rows_sample_as_if_alone(hf_models, monkeypatch):
    """Prompts that open alike (a chat template's system turn): those tokens run once as [1, c] and every
    row runs from column c on. Under the invariant kernels each request still gets the bits of a batch of
    its own, where nothing is shared; with the reference kernels the log-probs agree to float rounding."""
    import ops

    _, path = hf_models[("qwen2", False)]
    cfg, params = hf.load_hf(path)
    head = [5, 9, 2, 14, 3, 3, 8, 1, 20, 6]
    prompts = [head + [4], head + [7, 30, 2], head + [11, 12], head + [4], head + [25, 1, 9, 9, 3]]
    sc = SamplingConfig(temperature=1.0, max_new_tokens=5)
    shapes = []
    run = generate_module._forward  # each prefill forward, on torch or the C kernel
    monkeypatch.setattr(generate_module, "_forward", lambda *a, **k: shapes.append(tuple(a[2].shape)) or run(*a, **k))
    gen = generate(params, cfg, prompts, prng.key(3), sc, ops_cfg=ops.INVARIANT)
    assert shapes == [(1, 10), (4, 5)]  # the prefix once; the 4 distinct prompts from column 10 of 15
    fast = generate(params, cfg, prompts, prng.key(3), sc)
    for i, p in enumerate(prompts):
        alone = generate(params, cfg, [p], prng.key(3), sc, [i], ops_cfg=ops.INVARIANT)
        assert alone.tokens[0] == gen.tokens[i] and alone.logprobs[0] == gen.logprobs[i]
        ref = generate(params, cfg, [p], prng.key(3), sc, [i])
        assert ref.tokens[0] == fast.tokens[i]
        torch.testing.assert_close(torch.tensor(fast.logprobs[i]), torch.tensor(ref.logprobs[0]), atol=1e-5, rtol=0)
