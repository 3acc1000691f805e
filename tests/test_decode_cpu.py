"""The C decode kernel (ops.decode_cpu) against float64 forwards of the same weights, and its fallbacks."""

import pytest
import torch

import ops
from miles_fn import model, prng
from miles_fn.config import ModelConfig
from miles_fn.generate import generate
from miles_fn.sampling import SamplingConfig
from ops import decode_cpu
from state import hf

KERNEL = ops.OpsConfig(decode_backend="cpu_kernel")
# Left padding of several widths; 13 new tokens make key counts that are and are not multiples of 8.
PROMPTS = [[3, 7, 11, 2, 9], [4], [8, 8, 1, 30, 22, 17, 5, 6], [12, 40], [5, 5, 5]]

needs_kernel = pytest.mark.skipif(bool(decode_cpu.status()), reason=f"C decode kernel: {decode_cpu.status()}")


def _float64_logprobs(params, cfg, prompt, tokens, temperature):
    """Each response token's log-prob from one float64 full-sequence forward (no cache, no padding)."""
    p64 = {k: ([{n: w.double() for n, w in layer.items()} for layer in v] if k == "layers" else v.double())
           for k, v in params.items()}
    seq = torch.tensor([prompt + tokens])
    t = seq.shape[1]
    with torch.no_grad():
        logits = model.forward(p64, cfg, seq, torch.arange(t)[None], model.causal_segment_mask(torch.ones(1, t)))
    lp = torch.log_softmax(logits[0, len(prompt) - 1 : -1] / temperature, -1)
    return lp, lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def _tiny(cfg: ModelConfig, seed: int):
    params = model.init_params(cfg, prng.key(seed), std=0.15)
    g = torch.Generator().manual_seed(seed)
    for layer in params["layers"]:
        for n in ("attn_norm", "mlp_norm"):
            layer[n] = 1.0 + 0.2 * torch.randn(layer[n].shape, generator=g)
        for n in ("bq", "bk", "bv"):
            if n in layer:
                layer[n] = 0.1 * torch.randn(layer[n].shape, generator=g)
    return params


@needs_kernel
@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("llama", True)])
def test_kernel_logprobs_match_a_float64_forward(hf_models, arch, tie):
    _, path = hf_models[(arch, tie)]
    cfg, params = hf.load_hf(path)
    gen = generate(params, cfg, PROMPTS, prng.key(4), SamplingConfig(temperature=0.8, max_new_tokens=13),
                   ops_cfg=KERNEL)
    for prompt, tokens, lps in zip(PROMPTS, gen.tokens, gen.logprobs):
        assert len(tokens) == 13
        _, ref = _float64_logprobs(params, cfg, prompt, tokens, 0.8)
        assert torch.allclose(torch.tensor(lps, dtype=torch.float64), ref, atol=2e-5), (prompt, tokens)


@needs_kernel
def test_rows_that_stopped_leave_the_batch_and_the_rest_still_match_a_float64_forward(hf_models):
    """With a stop token the kernel's loop computes only the rows still decoding: each row's cache, mask and
    rope entries must follow it as the batch shrinks, so every row's log-probs stay the float64 ones."""
    _, path = hf_models[("llama", True)]
    cfg, params = hf.load_hf(path)
    free = generate(params, cfg, PROMPTS, prng.key(4), SamplingConfig(temperature=0.8, max_new_tokens=13),
                    ops_cfg=KERNEL)
    stop = free.tokens[0][2]  # row 0 stops at its 3rd token at the latest
    s = SamplingConfig(temperature=0.8, max_new_tokens=13, stop_token_ids=(stop,))
    gen = generate(params, cfg, PROMPTS, prng.key(4), s, ops_cfg=KERNEL)
    lengths = [len(t) for t in gen.tokens]
    assert min(lengths) <= 3 and max(lengths) > min(lengths), lengths  # the batch shrank, and went on
    for prompt, tokens, lps in zip(PROMPTS, gen.tokens, gen.logprobs):
        assert stop not in tokens[:-1]
        _, ref = _float64_logprobs(params, cfg, prompt, tokens, 0.8)
        assert torch.allclose(torch.tensor(lps, dtype=torch.float64), ref, atol=2e-5), (prompt, tokens)


@needs_kernel
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(12, 4, 1), (64, 2, 2), (40, 6, 3)])
def test_kernel_greedy_picks_the_float64_argmax_for_any_head_layout(head_dim, heads, kv_heads):
    """head_dim 12 and 40 take the scalar attention loops, 64 the 32-float chunks twice; MHA and GQA."""
    cfg = ModelConfig(vocab_size=47, hidden_size=48, intermediate_size=72, num_layers=2, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=head_dim, max_position_embeddings=64,
                      attention_bias=False, model_type="llama", tie_word_embeddings=False)
    params = _tiny(cfg, 3)
    gen = generate(params, cfg, PROMPTS, prng.key(0), SamplingConfig(temperature=0, max_new_tokens=21),
                   ops_cfg=KERNEL)
    for prompt, tokens, lps in zip(PROMPTS, gen.tokens, gen.logprobs):
        full, ref = _float64_logprobs(params, cfg, prompt, tokens, 1.0)
        assert torch.allclose(torch.tensor(lps, dtype=torch.float64), ref, atol=2e-5)
        # each pick is the float64 argmax, up to a float32 near-tie
        assert bool((full.max(-1).values - ref <= 1e-5).all()), (prompt, tokens)


@needs_kernel
def test_kernel_and_torch_decode_sample_the_same_tokens(hf_models):
    _, path = hf_models[("qwen2", True)]
    cfg, params = hf.load_hf(path)
    s = SamplingConfig(temperature=1.0, max_new_tokens=24, stop_token_ids=(13,))
    ours = generate(params, cfg, PROMPTS, prng.key(9), s, ops_cfg=KERNEL)
    torch_path = generate(params, cfg, PROMPTS, prng.key(9), s)
    assert ours.tokens == torch_path.tokens
    assert ours.finish_reasons == torch_path.finish_reasons
    for a, b in zip(ours.logprobs, torch_path.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_auto_falls_back_to_torch_where_the_kernel_cannot_run(hf_models, monkeypatch, tmp_path):
    _, path = hf_models[("qwen2", False)]
    cfg, params = hf.load_hf(path)
    cache = model.new_kv_cache(cfg, 2, 8)
    auto = ops.OpsConfig(decode_backend="auto")
    assert not decode_cpu.chosen(ops.REFERENCE, params, cache)  # decode_backend="torch"
    assert not decode_cpu.chosen(ops.OpsConfig(mode="invariant", decode_backend="auto"), params, cache)
    p64 = {k: ([{n: w.double() for n, w in layer.items()} for layer in v] if k == "layers" else v.double())
           for k, v in params.items()}
    assert not decode_cpu.chosen(auto, p64, model.new_kv_cache(cfg, 2, 8, torch.float64))
    with pytest.raises(ValueError, match="float32 weights"):
        decode_cpu.chosen(KERNEL, p64, model.new_kv_cache(cfg, 2, 8, torch.float64))
    # No compiler: status says why, auto decodes with torch, cpu_kernel refuses naming the flag.
    monkeypatch.setenv("MILES_FN_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    decode_cpu._library.cache_clear()
    try:
        assert "compiling" in decode_cpu.status()
        assert not decode_cpu.chosen(auto, params, cache)
        with pytest.raises(RuntimeError, match="--decode_backend=cpu_kernel cannot run here"):
            decode_cpu.chosen(KERNEL, params, cache)
        with pytest.raises(ImportError, match="--decode_backend=cpu_kernel"):
            ops.require_backends(KERNEL)
        gen = generate(params, cfg, PROMPTS, prng.key(0), SamplingConfig(temperature=0, max_new_tokens=3),
                       ops_cfg=auto)
        assert all(len(t) == 3 for t in gen.tokens)
        assert list(tmp_path.iterdir()) == []  # a failed build leaves nothing behind
    finally:
        decode_cpu._library.cache_clear()


def test_cpu_kernel_refuses_invariant_and_compiled_modes():
    with pytest.raises(ValueError, match="cpu_kernel"):
        ops.OpsConfig(mode="invariant", decode_backend="cpu_kernel")
    with pytest.raises(ValueError, match="cpu_kernel"):
        ops.OpsConfig(compile=True, decode_backend="cpu_kernel")
    with pytest.raises(ValueError, match="decode_backend"):
        ops.OpsConfig(decode_backend="cuda_graphs")


@needs_kernel
def test_plan_rejects_steps_and_tokens_outside_it(hf_models):
    _, path = hf_models[("llama", False)]
    cfg, params = hf.load_hf(path)
    cache = model.new_kv_cache(cfg, 2, 10)
    cos, sin = ops.rope_tables(torch.arange(4)[None].expand(2, 4), cfg.dim_head, cfg.rope_theta)
    plan = decode_cpu.DecodePlan(params, cfg, cache, torch.ones(2, 10, dtype=torch.bool), cos[:, 0], sin[:, 0])
    assert plan.step(torch.tensor([1, 2]), 0, 6).shape == (2, cfg.vocab_size)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        plan.step(torch.tensor([1, cfg.vocab_size]), 1, 7)
    with pytest.raises(ValueError, match="outside the plan"):
        plan.step(torch.tensor([1, 2]), 4, 7)
    with pytest.raises(ValueError, match="outside the plan"):
        plan.step(torch.tensor([1, 2]), 1, 10)
    with pytest.raises(ValueError, match="int64 of shape"):
        plan.step(torch.tensor([1, 2, 3]), 1, 7)


@needs_kernel
def test_plans_past_the_few_row_gemm_use_weights_packed_once_with_the_same_logits(hf_models, monkeypatch):
    """Up to 8 rows the kernel's few-row GEMM takes every product and nothing is packed; on the paired weights
    the blocked GEMM takes 9-64 rows in chunks of 8, and past that the plan packs its matrices once (MKL's
    packed GEMM, where torch's BLAS has it). All give BLAS's plain sgemm logits to float32 rounding. Their
    match with float64 is the tests above and below."""
    _, path = hf_models[("llama", False)]
    cfg, params = hf.load_hf(path)
    lib, _ = decode_cpu._library()
    blocked = int(lib.mf_blocked_rows())
    rows_max = blocked + 8
    cos, sin = ops.rope_tables(torch.arange(4)[None].expand(rows_max, 4), cfg.dim_head, cfg.rope_theta)
    tokens = torch.arange(1, rows_max + 1) % cfg.vocab_size

    def step(rows):
        cache = model.new_kv_cache(cfg, rows, 10)
        plan = decode_cpu.DecodePlan(params, cfg, cache, torch.ones(rows, 10, dtype=torch.bool), cos[:rows, 0],
                                     sin[:rows, 0])
        return plan, plan.step(tokens[:rows], 0, 6).clone()

    few = {r: step(r) for r in (1, 5, 8, 12, 29, blocked)}
    assert all(p.few_rows and not p.packed for p, _ in few.values())
    packed_plan, packed = step(rows_max)
    assert not packed_plan.few_rows and packed_plan.packed is bool(lib.mf_pack_available())
    monkeypatch.setenv("MILES_FN_DECODE_PACK", "0")
    monkeypatch.setenv("MILES_FN_DECODE_SMALL_GEMM", "0")
    plain_plan, plain = step(rows_max)
    assert not plain_plan.packed and not plain_plan.few_rows
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    for rows, (_, logits) in few.items():
        blas_plan, blas = step(rows)
        assert not blas_plan.few_rows
        torch.testing.assert_close(logits, blas, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_blocked_gemm_sums_each_chunk_of_8_rows_as_the_few_row_gemm_does(hf_models):
    """Past 8 rows the blocked GEMM runs the few-row GEMM on each chunk of 8 rows of x (the last chunk the
    rest): a 29-row step's logits are, bit for bit, those of steps of 8, 8, 8 and 5 rows on the same tokens.
    A BLAS or packed product past 8 rows would not give those bits."""
    _, path = hf_models[("qwen2", False)]
    cfg, params = hf.load_hf(path)
    cos, sin = ops.rope_tables(torch.arange(4)[None].expand(29, 4), cfg.dim_head, cfg.rope_theta)
    tokens = torch.randint(0, cfg.vocab_size, (29,), generator=torch.Generator().manual_seed(0))

    def step(lo, hi):
        cache = model.new_kv_cache(cfg, hi - lo, 10)
        plan = decode_cpu.DecodePlan(params, cfg, cache, torch.ones(hi - lo, 10, dtype=torch.bool), cos[lo:hi, 0],
                                     sin[lo:hi, 0])
        assert plan.few_rows
        return plan.step(tokens[lo:hi], 0, 6).clone()

    whole = step(0, 29)
    assert torch.equal(whole, torch.cat([step(0, 8), step(8, 16), step(16, 24), step(24, 29)]))
    assert not torch.equal(whole[:5], step(0, 5))  # a 5-row chunk sums in another order: the match is not trivial


@needs_kernel
def test_derived_weights_are_made_once_and_remade_after_an_in_place_update(hf_models):
    """The stacked (and, past the few-row GEMM, packed) weights are kept while the weights are unchanged: a
    second plan reuses them. A weight changed in place remakes them: generate on the kernel then matches a
    float64 forward of the new weights, which stale copies would not."""
    _, path = hf_models[("llama", True)]
    cfg, params = hf.load_hf(path)
    prompts = (PROMPTS * 3)[:12]  # 12 rows: the plan packs where MKL can
    cos, sin = ops.rope_tables(torch.arange(4)[None].expand(12, 4), cfg.dim_head, cfg.rope_theta)

    def plan():
        return decode_cpu.DecodePlan(params, cfg, model.new_kv_cache(cfg, 12, 10), torch.ones(12, 10, dtype=torch.bool),
                                     cos[:, 0], sin[:, 0])

    first, second = plan(), plan()
    assert second._keep[0][0]["wqkv"] is first._keep[0][0]["wqkv"]
    generate(params, cfg, prompts, prng.key(4), SamplingConfig(temperature=0.8, max_new_tokens=6), ops_cfg=KERNEL)
    with torch.no_grad():  # in place, as a weight sync into the engine's tensors would
        params["layers"][0]["wk"].mul_(-1.5)
        params["layers"][1]["w_down"].mul_(2.0)
        params["embed"].mul_(0.7)  # the tied output layer
    assert plan()._keep[0][0]["wqkv"] is not first._keep[0][0]["wqkv"]
    gen = generate(params, cfg, prompts, prng.key(4), SamplingConfig(temperature=0.8, max_new_tokens=6),
                   ops_cfg=KERNEL)
    for prompt, tokens, lps in zip(prompts, gen.tokens, gen.logprobs, strict=True):
        _, ref = _float64_logprobs(params, cfg, prompt, tokens, 0.8)
        assert torch.allclose(torch.tensor(lps, dtype=torch.float64), ref, atol=2e-5), (prompt, tokens)
    # A source replaced by a new tensor (a partial weight sync), the owner (wq) kept: remade too.
    before = plan()._keep[0][0]["wqkv"]
    params["layers"][0]["wv"] = -params["layers"][0]["wv"]
    after = plan()._keep[0][0]["wqkv"]
    nv = params["layers"][0]["wv"].shape[0]
    assert torch.equal(after[-nv:], -before[-nv:])
    # Weights no plan has used in the last _KEEP_PLANS builds are let go (the KL reference's first weights).
    _, other = hf.load_hf(path)
    for _ in range(decode_cpu._KEEP_PLANS + 1):
        decode_cpu.DecodePlan(other, cfg, model.new_kv_cache(cfg, 12, 10), torch.ones(12, 10, dtype=torch.bool),
                              cos[:, 0], sin[:, 0])
    assert params["layers"][0]["wq"] not in decode_cpu._DERIVED and other["layers"][0]["wq"] in decode_cpu._DERIVED


@needs_kernel
@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("llama", True)])
def test_block_steps_match_a_float64_forward_past_rejected_columns(hf_models, arch, tie):
    """Two speculative-style rounds of T=4 tokens a row: the first round's columns are then kept per row
    (2, 0, 4 of them, the rest masked: "rejected"), and the second round's logits must be those of a
    float64 forward over prompt + kept tokens + the second block, with each row at its own positions."""
    from miles_fn.generate import prefill_mask

    _, path = hf_models[(arch, tie)]
    cfg, params = hf.load_hf(path)
    prompts, t, keep = [[3, 7, 11, 2, 9], [4], [8, 1, 30]], 4, [2, 0, 4]
    b, lp = len(prompts), 5
    lens = torch.tensor([len(p) for p in prompts])
    width = lp + 2 * t
    valid = torch.zeros(b, width, dtype=torch.bool)
    valid[:, :lp] = torch.arange(lp)[None] >= (lp - lens)[:, None]
    tok = torch.tensor([[0] * (lp - len(p)) + p for p in prompts])
    pos = torch.clamp(torch.arange(lp)[None] - (lp - lens)[:, None], min=0)
    cache = model.new_kv_cache(cfg, b, width)
    with torch.no_grad():
        model.forward(params, cfg, tok, pos, prefill_mask(valid, lp), cache, 0)
    cos, sin = ops.rope_tables(lens[:, None] + torch.arange(2 * t)[None], cfg.dim_head, cfg.rope_theta)
    plan = decode_cpu.DecodePlan(params, cfg, cache, valid.view(torch.uint8), cos[:, 0], sin[:, 0], block=t)
    first = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    second = torch.tensor([[17, 18, 19, 20], [21, 22, 23, 24], [25, 26, 27, 28]])
    valid[:, lp : lp + t] = True  # the plan reads the caller's mask: causal within the block
    plan.block_step(first, torch.zeros(b, dtype=torch.int64), lp)
    valid[:, lp : lp + t] = torch.arange(t)[None] < torch.tensor(keep)[:, None]
    valid[:, lp + t :] = True
    out = torch.log_softmax(plan.block_step(second, torch.tensor(keep), lp + t).double(), -1)
    p64 = {k: ([{n: w.double() for n, w in layer.items()} for layer in v] if k == "layers" else v.double())
           for k, v in params.items()}
    for r in range(b):
        seq = torch.tensor([prompts[r] + first[r, : keep[r]].tolist() + second[r].tolist()])
        n = seq.shape[1]
        with torch.no_grad():
            ref = model.forward(p64, cfg, seq, torch.arange(n)[None], model.causal_segment_mask(torch.ones(1, n)))
        assert torch.allclose(out[r], torch.log_softmax(ref[0, -t:], -1), atol=2e-5), r
    # A third block over rows 2 and 0 only (row 1 has finished): computed in that order, row 1 untouched.
    third = torch.tensor([[29, 30, 31, 32], [33, 34, 35, 36]])
    before = [k[1].clone() for k, _ in cache]
    sub = torch.tensor([2, 0])
    cos3, sin3 = ops.rope_tables(lens[:, None] + torch.arange(3 * t)[None], cfg.dim_head, cfg.rope_theta)
    width3 = width + t
    valid3 = torch.zeros(b, width3, dtype=torch.bool)
    valid3[:, :width] = valid
    cache3 = [(torch.cat([k, k.new_zeros(*k.shape[:2], t, k.shape[-1])], 2),
               torch.cat([v, v.new_zeros(*v.shape[:2], t, v.shape[-1])], 2)) for k, v in cache]
    plan3 = decode_cpu.DecodePlan(params, cfg, cache3, valid3.view(torch.uint8), cos3[:, 0], sin3[:, 0], block=t)
    valid3[:, width:] = True
    out3 = torch.log_softmax(plan3.block_step(third, torch.tensor(keep)[sub] + t, width, sub).double(), -1)
    assert out3.shape == (2, t, cfg.vocab_size)
    for i, r in enumerate(sub.tolist()):
        seq = torch.tensor([prompts[r] + first[r, : keep[r]].tolist() + second[r].tolist() + third[i].tolist()])
        n = seq.shape[1]
        with torch.no_grad():
            ref = model.forward(p64, cfg, seq, torch.arange(n)[None], model.causal_segment_mask(torch.ones(1, n)))
        assert torch.allclose(out3[i], torch.log_softmax(ref[0, -t:], -1), atol=2e-5), r
    assert all(torch.equal(k3[1, :, :width], k0) and not k3[1, :, width:].any()
               for (k3, _), k0 in zip(cache3, before, strict=True))  # row 1: not computed, cache untouched
    with pytest.raises(ValueError, match="distinct indices"):
        plan3.block_step(third, torch.tensor([0, 0]), width, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="outside the plan"):
        plan.block_step(second, torch.tensor([5, 0, 0]), lp + t)  # rope entries 5..8 of 8
    with pytest.raises(ValueError, match="tokens must be"):
        plan.block_step(second[:, :2], torch.tensor(keep), lp + t)
    with pytest.raises(ValueError, match="use block_step"):
        plan.step(second[:, 0], 0, lp)


@needs_kernel
def test_kernel_sampler_is_the_float64_inverse_cdf():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(64, 37, generator=g)
    u = torch.rand(64, generator=g, dtype=torch.float64)
    tok, lp = decode_cpu.sample_rows(logits, u, 0.7)
    p = torch.softmax(logits.double() / 0.7, -1)
    ref = torch.searchsorted(torch.cumsum(p, -1) / p.sum(-1, keepdim=True), u[:, None], right=True)[:, 0]
    assert torch.equal(tok, ref)
    assert torch.allclose(lp.double(), torch.log(p.gather(-1, ref[:, None])[:, 0]), atol=1e-5)
    greedy, _ = decode_cpu.sample_rows(logits, None, 1.0)
    assert torch.equal(greedy, logits.argmax(-1))


def test_interleave_pairs_puts_two_rows_side_by_side_in_chunks_of_8():
    """Hand-checked layout: rows 2i, 2i+1 as [k/8][2][8]; an odd last row plainly at the end."""
    w = torch.arange(5 * 16, dtype=torch.float32).reshape(5, 16)
    got = decode_cpu.interleave_pairs(w)
    r = [w[i].tolist() for i in range(5)]
    want = (r[0][:8] + r[1][:8] + r[0][8:] + r[1][8:]) + (r[2][:8] + r[3][:8] + r[2][8:] + r[3][8:]) + r[4]
    assert got.tolist() == want
    with pytest.raises(ValueError, match="multiple of 8"):
        decode_cpu.interleave_pairs(torch.zeros(4, 12))


@needs_kernel
def test_weight_pairs_give_the_plain_layouts_logits_bit_for_bit(hf_models, monkeypatch):
    """The few-row GEMM on the paired copies (interleave_pairs) sums each output in the plain GEMM's order:
    at every row count it takes (1-8, one-token and 4-token steps) the logits are bitwise those of
    MILES_FN_DECODE_PAIRS=0. The tiny model's shapes cover an odd row count (61-token vocabulary) and row
    lengths that are not a multiple of the accumulators' stride (64 and 96 columns at 3 and 8 chains)."""
    _, path = hf_models[("qwen2", False)]
    cfg, params = hf.load_hf(path)
    lib, _ = decode_cpu._library()
    cos, sin = ops.rope_tables(torch.arange(8)[None].expand(8, 8), cfg.dim_head, cfg.rope_theta)

    def logits(rows, block):
        cache = model.new_kv_cache(cfg, rows, 12)
        valid = torch.ones(rows, 12, dtype=torch.bool)
        valid[:, 8:] = False  # the steps' columns are written before they are read
        plan = decode_cpu.DecodePlan(params, cfg, cache, valid, cos[:rows, 0], sin[:rows, 0], block=block)
        assert plan.few_rows and bool(plan._model.lm_head_i) is decode_cpu.pairs_on(lib)
        tok = torch.randint(0, cfg.vocab_size, (rows, block), generator=torch.Generator().manual_seed(rows))
        valid[:, 8 : 8 + block] = True
        return plan.block_step(tok, torch.zeros(rows, dtype=torch.int64), 8).clone()

    cases = [(r, 1) for r in range(1, 9)] + [(1, 4), (2, 4)]
    paired = {c: logits(*c) for c in cases}
    monkeypatch.setenv("MILES_FN_DECODE_PAIRS", "0")
    for c in cases:
        assert torch.equal(paired[c], logits(*c)), c


@needs_kernel
def test_a_block_step_without_its_head_writes_the_same_caches(hf_models):
    """head=False (a draft's plain step) skips the output layer: it returns None and leaves every cache as a
    step with logits does, bit for bit."""
    _, path = hf_models[("llama", True)]
    cfg, params = hf.load_hf(path)
    cos, sin = ops.rope_tables(torch.arange(4)[None].expand(3, 4), cfg.dim_head, cfg.rope_theta)
    tok = torch.tensor([[5, 6], [7, 8], [9, 10]])
    caches = []
    for head in (True, False):
        cache = model.new_kv_cache(cfg, 3, 6)
        valid = torch.ones(3, 6, dtype=torch.bool)
        plan = decode_cpu.DecodePlan(params, cfg, cache, valid, cos[:, 0], sin[:, 0], block=2)
        out = plan.block_step(tok, torch.zeros(3, dtype=torch.int64), 2, head=head)
        assert (out is None) is (not head)
        caches.append(cache)
    assert caches[0][0][0][:, :, 2:4].abs().sum() > 0
    assert all(torch.equal(a, b) for kv0, kv1 in zip(*caches, strict=True) for a, b in zip(kv0, kv1, strict=True))


@needs_kernel
@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("llama", True)])
def test_the_kernels_prefill_matches_a_float64_forward_across_its_pieces(hf_models, arch, tie):
    """decode_cpu.prefill, on top of cache columns an earlier prefill wrote: 3 rows of 40 tokens (120 GEMM rows,
    so pieces of 21 and 19 tokens a row, 63 and 57 GEMM rows: the blocked GEMM's last chunk partial, the
    second piece on the cache the first wrote), each row at its own positions. The last column's logits
    match a float64 forward of the whole sequence; head=False gives none and the same caches, bit for bit."""
    _, path = hf_models[(arch, tie)]
    cfg, params = hf.load_hf(path)
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(0, cfg.vocab_size, (3, 43), generator=g)
    pos = torch.tensor([[0], [5], [2]]) + torch.arange(43)[None]
    p64 = {k: ([{n: w.double() for n, w in layer.items()} for layer in v] if k == "layers" else v.double())
           for k, v in params.items()}
    caches, outs = [], []
    for head in (True, False):
        cache = model.new_kv_cache(cfg, 3, 48)
        decode_cpu.prefill(params, cfg, seq[:, :3], pos[:, :3], cache, 0)
        outs.append(decode_cpu.prefill(params, cfg, seq[:, 3:], pos[:, 3:], cache, 3, head=head))
        caches.append(cache)
    assert outs[1] is None
    assert all(torch.equal(a, b) for kv0, kv1 in zip(*caches, strict=True) for a, b in zip(kv0, kv1, strict=True))
    for r in range(3):
        with torch.no_grad():
            ref = model.forward(p64, cfg, seq[r : r + 1], pos[r : r + 1], model.causal_segment_mask(torch.ones(1, 43)))
        torch.testing.assert_close(torch.log_softmax(outs[0][r].double(), -1), torch.log_softmax(ref[0, -1], -1),
                                   atol=2e-5, rtol=0)


@needs_kernel
def test_generate_prefills_on_the_kernel_where_it_can_and_on_torch_otherwise(hf_models, monkeypatch):
    """Prompts of one length prefill on the kernel, left-padded ones on torch; both sample what the torch
    path samples, log-probs to rounding. A model the kernel cannot take (float64 weights) still prefills on
    torch under decode_backend=cpu_kernel, which insists only where it decodes."""
    cfg, params = hf.load_hf(hf_models[("qwen2", False)][1])
    shapes, run = [], decode_cpu.prefill
    monkeypatch.setattr(decode_cpu, "prefill", lambda *a, **k: shapes.append(tuple(a[2].shape)) or run(*a, **k))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=4)
    for prompts, on_kernel in (([[3, 5, 7, 9], [2, 4, 6, 8]], [(2, 4)]), ([[3, 5, 7], [2, 4, 6, 8, 10]], [])):
        shapes.clear()
        got = generate(params, cfg, prompts, prng.key(1), sampling, ops_cfg=ops.OpsConfig(decode_backend="auto"))
        assert shapes == on_kernel
        ref = generate(params, cfg, prompts, prng.key(1), sampling)  # decode_backend="torch"
        assert got.tokens == ref.tokens
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)
    p64 = {k: ([{n: w.double() for n, w in layer.items()} for layer in v] if k == "layers" else v.double())
           for k, v in params.items()}
    one = SamplingConfig(temperature=1.0, max_new_tokens=1)
    got = generate(p64, cfg, [[3, 5, 7, 9], [2, 4, 6, 8]], prng.key(1), one, ops_cfg=KERNEL)
    assert shapes == [] and got.tokens == generate(p64, cfg, [[3, 5, 7, 9], [2, 4, 6, 8]], prng.key(1), one).tokens
    with pytest.raises(ValueError, match="float32 weights"):
        generate(p64, cfg, [[3, 5, 7, 9], [2, 4, 6, 8]], prng.key(1), sampling, ops_cfg=KERNEL)
