"""Qwen3 and Qwen3-MoE against transformers' own models (tiny random configs built offline).

transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM are the independent reference: logits of our
pure forward on the imported weights, export loaded back by transformers, greedy decoding against
HF generate, the router's load-balancing loss against transformers' load_balancing_loss_func, and,
under ops.INVARIANT, the engine's log-probs and routes equal to the trainer's bit for bit.
"""

import os
import tempfile

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ops
from miles_fn import model, moe, prng
from miles_fn.generate import generate
from miles_fn.sampling import SamplingConfig
from ops import decode_cpu
from state import hf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

INV = ops.OpsConfig(mode="invariant", tile_rows=8, kv_block=4)
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rope_theta=10000.0, max_position_embeddings=128, eos_token_id=None, pad_token_id=0)


def _perturb(m: torch.nn.Module) -> None:
    """transformers initialises norms to 1 and the MoE router to 0 (every route ties): make them matter."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _hf_dense() -> torch.nn.Module:
    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_hidden_layers=2, tie_word_embeddings=True,
                                                               **COMMON))
    _perturb(m)
    return m.eval()


def _hf_moe(norm_topk_prob: bool = True, decoder_sparse_step: int = 1, mlp_only_layers=(1,)) -> torch.nn.Module:
    torch.manual_seed(0)
    c = transformers.Qwen3MoeConfig(num_hidden_layers=3, tie_word_embeddings=False, moe_intermediate_size=24,
                                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
                                    decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers),
                                    router_aux_loss_coef=0.01, **COMMON)
    m = transformers.Qwen3MoeForCausalLM(c)
    _perturb(m)
    return m.eval()


def _import(m: torch.nn.Module):
    with tempfile.TemporaryDirectory() as d:
        m.save_pretrained(d)
        return hf.load_hf(d)


@pytest.fixture(scope="module")
def dense():
    m = _hf_dense()
    return (m, *_import(m))


@pytest.fixture(scope="module")
def sparse():
    m = _hf_moe()
    return (m, *_import(m))


def _batch(b: int = 3, t: int = 11, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(1, 64, (b, t), generator=g)
    pos = torch.arange(t)[None].expand(b, t)
    return tok, pos, model.causal_segment_mask(torch.ones(b, t, dtype=torch.int64))


def test_config_reads_qwen3_and_moe_fields(dense, sparse):
    _, cfg, params = dense
    assert (cfg.model_type, cfg.qk_norm, cfg.attention_bias, cfg.dim_head) == ("qwen3", True, False, 16)
    assert cfg.num_heads * cfg.dim_head != cfg.hidden_size  # explicit head_dim, as in Qwen3-0.6B
    assert params["layers"][0]["q_norm"].shape == (16,) and "bq" not in params["layers"][0]
    _, mcfg, mparams = sparse
    assert (mcfg.num_experts, mcfg.num_experts_per_tok, mcfg.moe_layers) == (8, 2, (0, 2))
    assert params is not mparams and "router" not in mparams["layers"][1] and "w_gate" in mparams["layers"][1]
    assert mparams["layers"][0]["e_gate"].shape == (8, 24, 32) and mparams["layers"][0]["e_down"].shape == (8, 32, 24)


@pytest.mark.parametrize("which", ["dense", "sparse"])
def test_logits_match_transformers(which, request):
    m, cfg, params = request.getfixturevalue(which)
    tok, pos, mask = _batch()
    with torch.no_grad():
        ref = m(tok).logits
    for oc in (ops.REFERENCE, INV):
        ours = model.forward(params, cfg, tok, pos, mask, ops_cfg=oc)
        assert (ours - ref).abs().max().item() < 1e-5, oc.mode


@pytest.mark.parametrize("kw", [dict(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=()),
                                dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(0, 2))])
def test_moe_layer_rules_and_norm_topk_match_transformers(kw):
    m = _hf_moe(**kw)
    cfg, params = _import(m)
    assert cfg.moe_layers == tuple(i for i, layer in enumerate(m.model.layers) if hasattr(layer.mlp, "gate"))
    tok, pos, mask = _batch(2, 9, seed=3)
    with torch.no_grad():
        assert (model.forward(params, cfg, tok, pos, mask) - m(tok).logits).abs().max().item() < 1e-5


@pytest.mark.parametrize("which", ["dense", "sparse"])
def test_export_loads_back_in_transformers(which, request, tmp_path):
    m, cfg, params = request.getfixturevalue(which)
    hf.save_hf(str(tmp_path / "ours"), cfg, params)
    m.save_pretrained(str(tmp_path / "theirs"))

    def names(d):
        with safe_open(str(tmp_path / d / "model.safetensors"), framework="pt") as f:
            return set(f.keys())

    assert names("ours") == names("theirs")  # per-expert tensors, as save_pretrained writes
    back = type(m).from_pretrained(str(tmp_path / "ours")).eval()
    tok, _, _ = _batch(2, 7, seed=1)
    with torch.no_grad():
        assert torch.equal(back(tok).logits, m(tok).logits)


def test_moe_import_reads_fused_experts(sparse, tmp_path):
    m, cfg, params = sparse
    fused = {k: v.contiguous() for k, v in m.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in fused)  # transformers 5's in-memory form
    save_file(fused, str(tmp_path / "model.safetensors"))
    m.config.to_json_file(str(tmp_path / "config.json"))
    cfg2, params2 = hf.load_hf(str(tmp_path))
    assert cfg2 == cfg
    for a, b in zip(params2["layers"], params["layers"], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_greedy_decode_equals_transformers_generate(dense, sparse):
    prompts = [[5, 9, 17, 3], [40, 2, 11, 23, 8, 31, 6]]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=8)
    for m, cfg, params in (dense, sparse):
        gen = generate(params, cfg, prompts, prng.key(0), sampling)
        for p, ours in zip(prompts, gen.tokens, strict=True):
            with torch.no_grad():
                out = m.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                                 max_new_tokens=8, do_sample=False)
            assert ours == out[0, len(p):].tolist(), cfg.model_type


def test_c_decode_kernel_falls_back_with_a_reason(dense, sparse):
    for _, cfg, params in (dense, sparse):
        cache = model.new_kv_cache(cfg, 1, 8)
        why = decode_cpu.unsupported(params)
        assert ("MoE" if cfg.num_experts else "q/k norms") in why
        assert not decode_cpu.chosen(ops.REFERENCE, params, cache)
        with pytest.raises(ValueError, match="cpu_kernel cannot take this model"):
            decode_cpu.chosen(ops.OpsConfig(decode_backend="cpu_kernel"), params, cache)


@pytest.mark.parametrize("which", ["dense", "sparse"])
def test_engine_logprobs_and_routes_equal_trainer_bitwise_under_invariant_ops(which, request):
    _, cfg, params = request.getfixturevalue(which)
    prompts = [[5, 9, 17, 3], [40, 2, 11, 23, 8, 31, 6], [5, 9, 17, 3], [12]]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6, stop_token_ids=(7,))
    gen = generate(params, cfg, prompts, prng.key(3), sampling, ops_cfg=INV)
    seqs = [p + r for p, r in zip(prompts, gen.tokens, strict=True)]
    t = max(map(len, seqs))
    tok = torch.zeros(len(seqs), t, dtype=torch.int64)
    seg = torch.zeros_like(tok)
    for i, s in enumerate(seqs):
        tok[i, : len(s)], seg[i, : len(s)] = torch.tensor(s), 1
    pos = torch.arange(t)[None].expand_as(tok).contiguous()
    routes: list = []
    with torch.no_grad():
        lp = model.sequence_logprobs(params, cfg, tok, pos, seg, 1.0, ops_cfg=INV, routes_out=routes)
    for i, (p, r) in enumerate(zip(prompts, gen.tokens, strict=True)):
        assert torch.equal(lp[i, len(p) - 1 : len(p) - 1 + len(r)], torch.tensor(gen.logprobs[i]))
    if not cfg.num_experts:
        assert gen.routed_experts is None
        return
    trainer_routes = torch.stack([r.used.view(len(seqs), t - 1, -1) for r in routes], 2)  # [N, T-1, L, k]
    for i, s in enumerate(seqs):
        rec = gen.routed_experts[i]
        assert rec.shape == (len(s) - 1, len(cfg.moe_layers), cfg.num_experts_per_tok)
        assert torch.equal(rec.to(torch.int64), trainer_routes[i, : len(s) - 1])


def test_aux_loss_matches_transformers_load_balancing_loss(sparse):
    m, cfg, params = sparse
    tok, pos, _ = _batch(3, 10, seed=2)
    am = torch.ones(3, 10, dtype=torch.int64)
    am[1, 6:] = 0
    am[2, 3:] = 0
    with torch.no_grad():
        out = m(tok, attention_mask=am, output_router_logits=True)
        theirs = transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func(
            out.router_logits, cfg.num_experts, cfg.num_experts_per_tok, am)
        routes: list = []
        seg = am.clone()
        model.forward(params, cfg, tok, pos, model.causal_segment_mask(seg), routes_out=routes)
    ours = moe.load_balancing_loss(routes, am.reshape(-1))
    assert abs(ours.item() - theirs.item()) < 1e-5 and ours.item() > 0.5
    # transformers adds coef * aux to its loss: our objective does the same (test_routing_replay)


def test_grouped_experts_equal_dense_float64_loop():
    """The per-expert grouped compute against every token through its k experts one by one, float64."""
    g = torch.Generator().manual_seed(0)
    e, k, h, i, n = 6, 3, 8, 5, 40
    p = {"router": torch.randn(e, h, generator=g, dtype=torch.float64),
         "e_gate": torch.randn(e, i, h, generator=g, dtype=torch.float64),
         "e_up": torch.randn(e, i, h, generator=g, dtype=torch.float64),
         "e_down": torch.randn(e, h, i, generator=g, dtype=torch.float64)}
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    y, r = moe.moe_mlp(p, x, k, True, ops.REFERENCE)
    probs = torch.softmax(x @ p["router"].T, -1)
    ref = torch.zeros_like(x)
    for t in range(n):
        top = torch.topk(probs[t], k)
        w = top.values / top.values.sum()
        for j in range(k):
            ex = int(top.indices[j])
            a = torch.nn.functional.silu(p["e_gate"][ex] @ x[t]) * (p["e_up"][ex] @ x[t])
            ref[t] += w[j] * (p["e_down"][ex] @ a)
    assert torch.allclose(y, ref, atol=1e-5, rtol=1e-6)  # the router's softmax runs in float32, as in transformers
    assert torch.equal(r.used, torch.topk(probs, k).indices)
