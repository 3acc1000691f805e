"""The reference ops against the textbook formulas, computed independently (float64 where rounding matters)."""

import torch

import ops


def test_rope_by_roll_is_rotate_half_exactly_and_matches_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, 16, generator=g)
    pos = torch.randint(0, 500, (3, 5), generator=g)
    cos, signed = ops.rope_tables(pos, 16, 10000.0)
    got = ops.apply_rope(x, cos, signed)
    c, s = ops.rope_cos_sin(pos, 16, 10000.0)  # [B, T, D]
    c, s = c[:, None], s[:, None]
    rotated = torch.cat([-x[..., 8:], x[..., :8]], -1)  # rotate_half, as transformers writes it
    assert torch.equal(got, x * c + rotated * s)  # a sign flip rounds nothing: the same bits
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    ang = pos.double()[..., None] * torch.cat([inv, inv])
    ref = x.double() * ang.cos()[:, None] + rotated.double() * ang.sin()[:, None]
    torch.testing.assert_close(got.double(), ref, atol=2e-4, rtol=0)  # float32 angles up to 500 rad


def test_reference_linear_and_rms_norm_match_float64():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(4, 7, 32, generator=g), torch.randn(24, 32, generator=g), torch.randn(24, generator=g)
    torch.testing.assert_close(ops.linear(x, w, b).double(), x.double() @ w.double().T + b.double(), atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(ops.linear(x, w).double(), x.double() @ w.double().T, atol=1e-5, rtol=1e-5)
    nw = torch.rand(32, generator=g) + 0.5
    ref = nw.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    for oc in (ops.REFERENCE, ops.INVARIANT):
        torch.testing.assert_close(ops.rms_norm(x, nw, 1e-6, oc).double(), ref, atol=1e-5, rtol=1e-5)


def _attention64(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), -1) @ v


def test_reference_attention_matches_float64_on_each_of_its_kernels():
    from ops.attention import _GROUPED_MIN_DECODE_ROWS

    g = torch.Generator().manual_seed(2)
    # (rows, queries, keys): grouped matmuls for several queries, and for one query on many rows; SDPA for
    # one query on few rows
    for b, tq, tk in ((6, 5, 9), (_GROUPED_MIN_DECODE_ROWS // 4, 1, 7), (3, 1, 7)):
        q = torch.randn(b, 4, tq, 16, generator=g, requires_grad=True)
        k = torch.randn(b, 2, tk, 16, generator=g, requires_grad=True)
        v = torch.randn(b, 2, tk, 16, generator=g, requires_grad=True)
        mask = torch.rand(b, tq, tk, generator=g) > 0.4
        mask[..., 0] = True  # every query allows a key
        out = ops.attention(q, k, v, mask)
        ref = _attention64(q, k, v, mask)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        grads = torch.autograd.grad((out.double() * w).sum(), (q, k, v))
        refs = torch.autograd.grad((ref * w).sum(), (q, k, v))
        for a, r in zip(grads, refs, strict=True):
            torch.testing.assert_close(a.double(), r.double(), atol=1e-5, rtol=1e-5)
