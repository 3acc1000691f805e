"""Prompt turns cut at stop tokens, and the cross-call prefix cache that serves them: faster, never different."""

import dataclasses

import optree
import pytest
import torch

import ops
from launch.engines.base import Request
from launch.engines.embedded import EmbeddedEngine
from miles_fn import draft, model, prng
from miles_fn import generate as generate_module
from miles_fn.generate import MIN_SHARED_PREFIX, common_bounds, generate, turn_bounds
from miles_fn.prefix_cache import PrefixCache
from miles_fn.sampling import SamplingConfig
from miles_fn.speculative import generate_speculative
from state import hf

STOP = 1  # a chat template's end of turn
SYSTEM = [5, 9, 3, 14, 3, 3, 8, 6, 20, STOP]  # 10 tokens: a system turn
USERS = [[4, 7, 30, 2, 11, 12, 13, 15, STOP, 22, 23], [16, 17, 30, 2, 11, 12, 4, 4, STOP, 22, 23],
         [8, 8, 21, 2, 18, 12, 13, 15, 9, STOP, 22, 23]]
PROMPTS = [SYSTEM + u for u in USERS]  # the user turn's STOP leaves 2 tokens: under MIN_SHARED_PREFIX, no cut
SC = SamplingConfig(temperature=1.0, max_new_tokens=6, stop_token_ids=(STOP,))
MB = 1 << 20


def test_turn_bounds_hand_computed():
    m = MIN_SHARED_PREFIX
    assert m == 8
    assert turn_bounds(PROMPTS[0], (STOP,)) == [10]
    assert turn_bounds(PROMPTS[0], ()) == []
    # a stop under 8 tokens after the last cut, or leaving under 8, is no cut
    assert turn_bounds([2] * 7 + [STOP] + [2] * 8, (STOP,)) == [8]
    assert turn_bounds([2] * 6 + [STOP] + [2] * 9, (STOP,)) == []
    assert turn_bounds([2] * 7 + [STOP] + [2] * 7, (STOP,)) == []
    # turns of a multi-turn history (31 tokens): the end at 14 is 4 past the cut at 10; 23 leaves 8
    conv = [2] * 9 + [STOP] + [3] * 3 + [STOP] + [4] * 8 + [STOP] + [5] * 8
    assert turn_bounds(conv, (STOP,)) == [10, 23]
    assert turn_bounds(conv[:30], (STOP,)) == [10]
    assert turn_bounds(conv, (STOP, 4)) == [10, 18]  # the 4s end turns too: the one at 17 is 8 past 10
    # the cuts every prompt shares, within their common prefix; one prompt keeps all its own
    assert common_bounds(PROMPTS, (STOP,)) == [10]
    assert common_bounds([conv, conv[:23] + [7] * 9], (STOP,)) == [10, 23]
    assert common_bounds([conv, conv[:22] + [7] * 9], (STOP,)) == [10]
    assert common_bounds([conv], (STOP,)) == [10, 23]
    assert common_bounds([[9] + conv, conv], (STOP,)) == []


def _model(hf_models, tied: bool = False):
    _, path = hf_models[("qwen2", tied)]
    return hf.load_hf(path)


def _shapes(monkeypatch) -> list:
    shapes = []
    run = generate_module._forward  # each prefill forward, on torch or the C kernel
    monkeypatch.setattr(generate_module, "_forward", lambda *a, **k: shapes.append(tuple(a[2].shape)) or run(*a, **k))
    return shapes


def test_a_prompt_is_cut_at_its_turns_and_gets_the_trainers_bits(hf_models, monkeypatch):
    """One request alone is prefilled in pieces, at its turn end then the rest; under the invariant kernels
    its log-probs are the trainer's full-sequence ones bit for bit, and with the reference kernels to rounding."""
    cfg, params = _model(hf_models)
    shapes = _shapes(monkeypatch)
    gen = generate(params, cfg, [PROMPTS[2]], prng.key(1), SC, ops_cfg=ops.INVARIANT)
    assert shapes == [(1, 10), (1, 12)]  # the system turn, then the user turn from column 10
    seq = torch.tensor([PROMPTS[2] + gen.tokens[0]])
    t = seq.shape[1]
    full = model.sequence_logprobs(params, cfg, seq, torch.arange(t)[None], torch.ones(1, t, dtype=torch.long), 1.0,
                                   ops_cfg=ops.INVARIANT)[0, len(PROMPTS[2]) - 1:]
    assert full.tolist() == gen.logprobs[0]
    ref = generate(params, cfg, [PROMPTS[2]], prng.key(1), SC)
    seq = torch.tensor([PROMPTS[2] + ref.tokens[0]])
    t = seq.shape[1]
    with torch.no_grad():  # one float64 full-sequence forward, no cache, no cut
        logits = model.forward(optree.tree_map(torch.Tensor.double, params), cfg, seq, torch.arange(t)[None],
                               model.causal_segment_mask(torch.ones(1, t)))
    f64 = torch.log_softmax(logits[0, len(PROMPTS[2]) - 1 : -1], -1).gather(-1, torch.tensor(ref.tokens[0])[:, None])
    torch.testing.assert_close(torch.tensor(ref.logprobs[0], dtype=torch.float64), f64[:, 0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("oc", [ops.OpsConfig(decode_backend="auto"), ops.OpsConfig(decode_backend="torch")],
                         ids=["c_kernel", "torch"])
def test_the_cache_serves_a_later_call_the_bits_it_would_compute(hf_models, monkeypatch, oc):
    """Reference kernels, where how a prompt is cut changes its bits: calls that find the system turn cached
    sample exactly what calls without a cache do, and skip that turn's forward."""
    cfg, params = _model(hf_models)
    calls = [[PROMPTS[0]], [PROMPTS[1]], PROMPTS, [PROMPTS[2], PROMPTS[2]], [PROMPTS[0]]]
    plain = [generate(params, cfg, c, prng.key(i), SC, ops_cfg=oc) for i, c in enumerate(calls)]
    cache = PrefixCache(64 * MB)
    shapes = _shapes(monkeypatch)
    cached = [generate(params, cfg, c, prng.key(i), SC, ops_cfg=oc, prefix_cache=cache) for i, c in enumerate(calls)]
    assert cached == plain
    # the first call runs the system turn; the others find it and run from column 10 (the 3 prompts, padded to 22)
    assert shapes == [(1, 10), (1, 11), (1, 11), (3, 12), (1, 12), (1, 11)]
    assert (cache.hits, cache.hit_tokens) == (4, 40) and len(cache._entries) == 1
    assert len(set(map(tuple, cached[2].tokens))) > 1  # not a degenerate model: prompts sample differently


def test_weights_changed_in_place_or_replaced_are_never_served_stale(hf_models):
    cfg, params = _model(hf_models)
    oc = ops.OpsConfig(decode_backend="torch")
    cache = PrefixCache(64 * MB)
    first = generate(params, cfg, [PROMPTS[0]], prng.key(0), SC, ops_cfg=oc, prefix_cache=cache)
    with torch.no_grad():
        params["layers"][0]["wk"].mul_(1.5)  # an optimizer step writes in place
    want = generate(params, cfg, [PROMPTS[1]], prng.key(0), SC, ops_cfg=oc)
    assert generate(params, cfg, [PROMPTS[1]], prng.key(0), SC, ops_cfg=oc, prefix_cache=cache) == want
    assert cache.hits == 0
    synced = {**params, "layers": [{**layer, "wv": layer["wv"] * 0.5} for layer in params["layers"]]}
    want = generate(synced, cfg, [PROMPTS[2]], prng.key(0), SC, ops_cfg=oc)
    assert generate(synced, cfg, [PROMPTS[2]], prng.key(0), SC, ops_cfg=oc, prefix_cache=cache) == want
    assert cache.hits == 0 and want.logprobs != first.logprobs
    assert generate(synced, cfg, [PROMPTS[0]], prng.key(0), SC, ops_cfg=oc, prefix_cache=cache) == \
        generate(synced, cfg, [PROMPTS[0]], prng.key(0), SC, ops_cfg=oc)
    assert cache.hits == 1


def test_the_cache_keeps_its_budget_least_recently_used_first(hf_models):
    cfg, params = _model(hf_models)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.dim_head * 4  # float32 keys+values
    systems = [[40 + i] + SYSTEM[1:] for i in range(3)]  # three system turns of 10 tokens
    cache = PrefixCache(2 * 10 * per_token)  # room for two
    for s in systems:
        generate(params, cfg, [s + USERS[0]], prng.key(0), SC, prefix_cache=cache)
    assert cache.bytes == 2 * 10 * per_token and len(cache._entries) == 2
    generate(params, cfg, [systems[0] + USERS[1]], prng.key(0), SC, prefix_cache=cache)
    assert cache.hits == 0  # the oldest went first
    generate(params, cfg, [systems[2] + USERS[1]], prng.key(0), SC, prefix_cache=cache)
    assert cache.hits == 1
    off = PrefixCache(0)
    generate(params, cfg, [PROMPTS[0]], prng.key(0), SC, prefix_cache=off)
    assert off.bytes == 0 and not off._entries
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)


def test_speculation_with_the_cache_samples_as_plain_decoding(hf_models):
    cfg, params = _model(hf_models)
    dcfg = draft.random_draft_config(draft.SpeculativeConfig(draft_hidden_size=32), cfg)
    dparams = model.init_params(dcfg, prng.key(4))
    oc = ops.OpsConfig(decode_backend="auto")
    cache = PrefixCache(64 * MB)
    for i, c in enumerate([[PROMPTS[0]], [PROMPTS[1]], PROMPTS]):
        plain = generate(params, cfg, c, prng.key(i), SC, ops_cfg=oc)
        spec, _ = generate_speculative(params, cfg, dparams, dcfg, c, prng.key(i), SC, 2, ops_cfg=oc,
                                       prefix_cache=cache)
        assert spec.tokens == plain.tokens
        torch.testing.assert_close(torch.tensor(sum(spec.logprobs, [])), torch.tensor(sum(plain.logprobs, [])),
                                   atol=1e-5, rtol=0)
    assert cache.hits == 4  # the target's and the draft's system turn, in the second and third calls


def test_the_embedded_engine_caches_until_its_weights_change(hf_models):
    cfg, params = _model(hf_models)
    reqs = [Request(i, p, 7 + i) for i, p in enumerate(PROMPTS)]
    sc = dataclasses.replace(SC, max_new_tokens=4)
    off, on = EmbeddedEngine(cfg, params, batch_size=1), EmbeddedEngine(cfg, params, batch_size=1, prefix_cache_mb=8)
    assert on.generate(reqs, sc) == off.generate(reqs, sc)
    assert on.prefix_cache.hits == 2 and on.prefix_cache.bytes > 0 and off.prefix_cache.bytes == 0
    on.update_weights(1, params)
    assert on.prefix_cache.bytes == 0
    on.generate(reqs[:1], sc)
    on.flush_cache()
    assert on.prefix_cache.bytes == 0


def test_the_rollout_server_caches_and_refuses_a_negative_budget(hf_models):
    from launch import rollout_server

    cfg, params = _model(hf_models)
    body = {"input_ids": PROMPTS, "sampling_params": [{"max_new_tokens": 4, "sampling_seed": 3, "temperature": 1.0,
                                                       "stop_token_ids": [STOP]}] * 3}
    one = {**body, "input_ids": [PROMPTS[1]], "sampling_params": body["sampling_params"][:1]}
    plain = rollout_server.RolloutState(cfg, params, 0)
    cached = rollout_server.RolloutState(cfg, params, 0, prefix_cache_mb=8)
    assert [cached.generate(b) for b in (one, body)] == [plain.generate(b) for b in (one, body)]
    assert cached.prefix_cache.hits == 1 and plain.prefix_cache.bytes == 0
    with pytest.raises(SystemExit, match=r"--prefix-cache-mb=-1: must be >= 0"):
        rollout_server.main(["--model-path", "/nonexistent", "--prefix-cache-mb", "-1"])
