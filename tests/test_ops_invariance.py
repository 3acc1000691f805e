"""The invariant ops against float64 references, their batch invariance, and the evidence that the
plain kernels on this CPU are not invariant (so the invariance tests can fail)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ops
import third_party
from miles_fn import model
from ops.attention import blocked_attention, varlen_layout

INV = ops.OpsConfig(mode="invariant", tile_rows=16, kv_block=4)
G = torch.Generator().manual_seed(0)
W = torch.randn(96, 64, generator=G) * 0.2
X = torch.randn(300, 64, generator=G)


def test_plain_matmul_depends_on_the_row_count_here():
    full = X @ W.t()
    assert any(not torch.equal((X[:n] @ W.t()), full[:n]) for n in (1, 2, 3, 5, 7))


def test_plain_silu_depends_on_the_offset_here():
    x = torch.randn(4096, generator=G) * 4
    full = torch.nn.functional.silu(x)
    assert any(not torch.equal(torch.nn.functional.silu(x[o : o + 37]), full[o : o + 37]) for o in range(40))
    inv = ops.silu(x, INV)
    assert all(torch.equal(ops.silu(x[o : o + 37], INV), inv[o : o + 37]) for o in range(40))
    assert torch.allclose(inv.double(), x.double() * torch.sigmoid(x.double()), rtol=1e-6, atol=1e-7)


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.integers(0, 299), min_size=1, max_size=70))
def test_tiled_linear_row_is_independent_of_its_batch(rows):
    alone = torch.cat([ops.linear(X[i : i + 1], W, None, INV) for i in sorted(set(rows))[:3]])
    batch = ops.linear(X[rows], W, None, INV)
    first = {i: batch[j] for j, i in reversed(list(enumerate(rows)))}
    for k, i in enumerate(sorted(set(rows))[:3]):
        assert torch.equal(alone[k], first[i])
    ref = X[rows].double() @ W.t().double()
    assert torch.allclose(batch.double(), ref, atol=1e-5)


def _attention64(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("kv_block", [1, 4, 16])
@pytest.mark.parametrize("seg", [[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 0]])
def test_invariant_attention_matches_float64_and_decode_equals_full(seg, kv_block):
    inv = ops.OpsConfig(mode="invariant", kv_block=kv_block)
    seg_ids = torch.tensor([seg])
    mask = model.causal_segment_mask(seg_ids)
    q = torch.randn(1, 4, 11, 8, generator=G)
    k, v = torch.randn(1, 2, 11, 8, generator=G), torch.randn(1, 2, 11, 8, generator=G)
    full = ops.attention(q, k, v, mask, inv)
    assert torch.allclose(full.double(), _attention64(q, k, v, mask), atol=1e-6)
    for t in range(11):  # one query over a cache of the first t + 1 keys, as a decode step
        step = ops.attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], mask[:, t : t + 1, : t + 1], inv)
        assert torch.equal(step[:, :, 0], full[:, :, t])
    # the same queries left-padded by 3 columns of garbage keys, as the engine's prefill lays them out
    pad = torch.randn(1, 2, 3, 8, generator=G)
    mask_l = torch.zeros(1, 11, 14, dtype=torch.bool)
    mask_l[:, :, 3:] = mask
    left = ops.attention(q, torch.cat([pad, k], 2), torch.cat([pad, v], 2), mask_l, inv)
    assert torch.equal(left, full)


def test_sdpa_decode_differs_from_full_here():
    mask = model.causal_segment_mask(torch.ones(1, 40, dtype=torch.long))
    q = torch.randn(1, 4, 40, 16, generator=G)
    k, v = torch.randn(1, 4, 40, 16, generator=G), torch.randn(1, 4, 40, 16, generator=G)
    full = ops.attention(q, k, v, mask)
    steps = [ops.attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], mask[:, t : t + 1, : t + 1])
             for t in range(40)]
    assert not torch.equal(torch.cat(steps, 2), full)


def test_rms_norm_and_logprobs_match_float64():
    x = torch.randn(5, 7, 64, generator=G) * 3
    w = torch.rand(64, generator=G) + 0.5
    ref = w.double() * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(ops.rms_norm(x, w, 1e-6, INV).double(), ref, atol=1e-5)
    logits = torch.randn(5, 7, 61, generator=G) * 4
    tgt = torch.randint(0, 61, (5, 7), generator=G)
    ref = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, tgt[..., None])[..., 0]
    got = ops.token_logprobs(logits, tgt, 0.7, INV)
    assert torch.allclose(got.double(), ref, atol=1e-5)
    assert torch.equal(ops.token_logprobs(logits[2:3, 4:6], tgt[2:3, 4:6], 0.7, INV), got[2:3, 4:6])


def _from_varlen(key_index, cu_q, cu_k, b, tq, tk):
    """Rebuild the [B, Tq, Tk] mask FlashAttention's causal varlen call would apply."""
    mask = torch.zeros(b * tq, b * tk, dtype=torch.bool)
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        for i in range(q1 - q0):
            visible = (k1 - k0) - (q1 - q0) + i + 1
            mask[q0 + i, key_index[k0 : k0 + visible]] = True
    return torch.stack([mask[r * tq : (r + 1) * tq, r * tk : (r + 1) * tk] for r in range(b)])


def test_varlen_layout_expresses_training_prefill_and_decode_masks():
    packed = model.causal_segment_mask(torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]]))
    valid = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    causal = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    prefill = (causal[None] & valid[:, None]) | torch.eye(5, dtype=torch.bool)[None]
    decode = torch.cat([valid, torch.ones(2, 2, dtype=torch.bool)], 1)[:, None]
    for m in (packed, prefill, decode):
        key_index, cu_q, cu_k, _, _ = varlen_layout(m)
        assert torch.equal(_from_varlen(key_index, cu_q, cu_k, *m.shape), m)
    with pytest.raises(ValueError, match="varlen"):
        varlen_layout(torch.tensor([[[True, False, True]]]))


def test_blocked_attention_counts_only_allowed_keys():
    """A key that is masked out cannot change the output, even by rounding (and blocks align to ranks)."""
    q = torch.randn(1, 2, 1, 8, generator=G)
    k, v = torch.randn(1, 2, 9, 8, generator=G), torch.randn(1, 2, 9, 8, generator=G)
    mask = torch.tensor([[[True, False, True, True, False, False, True, True, True]]])
    out = blocked_attention(q, k, v, mask, 4)
    keep = mask[0, 0]
    dense = blocked_attention(q, k[:, :, keep], v[:, :, keep], torch.ones(1, 1, int(keep.sum()), dtype=torch.bool), 4)
    assert torch.equal(out, dense)


@pytest.mark.parametrize("cfg,package", [(ops.OpsConfig(attention_backend="flash_attn"), "flash-attn"),
                                         (ops.OpsConfig(attention_backend="flash_attn_3"), "flash_attn_interface"),
                                         (ops.OpsConfig(gemm_backend="deep_gemm"), "deep-gemm")])
def test_missing_gpu_backend_is_named(cfg, package):
    if third_party.available({"flash-attn": "flash_attn", "flash_attn_interface": "flash_attn_3",
                              "deep-gemm": "deep_gemm"}[package]) and third_party.cuda_available():
        pytest.skip("the backend is installed here")
    with pytest.raises(third_party.MissingPackageError, match=package):
        ops.require_backends(cfg)


def test_compile_runs_the_forward_on_cpu_and_refuses_invariant_mode():
    from miles_fn import prng
    from miles_fn.config import ModelConfig

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    params = model.init_params(cfg, prng.key(0), std=0.5)
    tok = torch.randint(0, 32, (2, 6), generator=G)
    pos, seg = torch.arange(6).expand(2, 6), torch.ones(2, 6, dtype=torch.int64)
    eager = model.sequence_logprobs(params, cfg, tok, pos, seg)
    compiled = model.sequence_logprobs(params, cfg, tok, pos, seg, ops_cfg=ops.OpsConfig(compile=True))
    assert torch.allclose(compiled, eager, atol=1e-5)
    with pytest.raises(ValueError, match="compile"):
        ops.OpsConfig(mode="invariant", compile=True)


@pytest.mark.parametrize("kv_block", [1, 4])
def test_invariant_attention_gradient_is_softmax_attentions(kv_block):
    """The custom backward against autograd through a float64 dense softmax attention."""
    from torch.func import grad

    mask = model.causal_segment_mask(torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 0, 0]]))
    q = torch.randn(2, 4, 8, 8, generator=G)
    k, v = torch.randn(2, 2, 8, 8, generator=G), torch.randn(2, 2, 8, 8, generator=G)
    w = torch.randn(2, 4, 8, 8, generator=G)
    inv = ops.OpsConfig(mode="invariant", kv_block=kv_block)
    ours = grad(lambda q, k, v: (ops.attention(q, k, v, mask, inv) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    ref = grad(lambda q, k, v: (_attention64(q, k, v, mask) * w.double()).sum(), argnums=(0, 1, 2))(
        q.double(), k.double(), v.double())
    for a, b in zip(ours, ref, strict=True):
        assert torch.allclose(a.double(), b, atol=1e-5)


def test_invariant_linear_gradient_is_the_linear_gradient():
    from torch.func import grad

    x, w = X[:37].reshape(37, 64), W
    g = torch.randn(37, 96, generator=G)
    ours = grad(lambda x, w: (ops.linear(x, w, None, INV) * g).sum(), argnums=(0, 1))(x, w)
    assert torch.allclose(ours[0], g @ w, atol=1e-5) and torch.allclose(ours[1], g.t() @ x, atol=1e-4)
