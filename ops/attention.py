"""Attention with an explicit boolean mask (GQA: fewer key/value heads than query heads).

reference: SDPA, or for small calls with several queries two batched matmuls (grouped_attention);
either's reduction order depends on the call's shapes (Tq = 1 decode vs prefill, padded width), so
a query's output depends on its batch.

invariant (kv_block > 1): each query reduces over *its own* allowed keys, taken in key order and laid
out by rank (the r-th allowed key goes to slot r), in fixed blocks of `kv_block` slots:

    s_r = sum_d q_d k_{r,d} / sqrt(D)        (one fixed-length row reduction per score)
    m   = max_r s_r                           (exact in any order)
    l   = (((sum_{r in B_0} e^{s_r - m}) + sum_{r in B_1} ...) + ...)
    o   = ((sum_{r in B_0} e^{s_r - m} v_r) + sum_{r in B_1} ...) / l

Slots past a query's own keys hold exact zeros, and whole blocks of them add +0, so
the result depends only on (q, the ordered list of allowed (k, v)): the same numbers for
prefill, single-token decode over a KV cache, left padding, right padding and packing.
With kv_block = 1 the keys are instead summed one at a time in column order (see
sequential_attention): no gather, and masked keys add exact zeros wherever they sit.

flash_attn / flash_attn_3: the mask is converted to FlashAttention's varlen layout
(one causal sequence per run of queries sharing a key range, bottom-right aligned).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ops.config import REFERENCE, OpsConfig


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, cfg: OpsConfig = REFERENCE
) -> torch.Tensor:
    """q: [B, H, Tq, D]; k, v: [B, Hkv, Tk, D]; mask: [B, Tq, Tk] bool (True = may attend).

    Every query row must allow at least one key (padding rows attend to themselves),
    so that no softmax runs over an empty set.
    """
    if cfg.attention_backend != "torch":
        return flash_varlen_attention(q, k, v, mask, cfg)
    if not cfg.invariant:
        b, h, tq, _ = q.shape
        if (tq > 1 or b * h >= _GROUPED_MIN_DECODE_ROWS) and b * h * tq * k.shape[2] <= _GROUPED_MAX_SCORES:
            return grouped_attention(q, k, v, mask)
        # enable_gqa maps query head h to key/value head h // groups inside the kernel, bit-identical
        # to repeating k and v per group, without copying the whole KV cache every decode step.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1),
                                              enable_gqa=q.shape[1] != k.shape[1])
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return _InvariantAttention.apply(q, k, v, mask, cfg.kv_block)


# Above this many scores (64 MiB of float32) the reference path keeps SDPA, which never makes them all.
_GROUPED_MAX_SCORES = 1 << 24
# A decode step (one query a row) uses grouped_attention from this many (row, head) pairs: on the 2-core
# machine SDPA is faster at batch 32 x 4 heads (0.24 ms against 0.31 at 12 keys), even at 64 x 4, and
# 1.6x slower at 512 x 4 (3.2 ms against 2.1), the RL rollout's batch.
_GROUPED_MIN_DECODE_ROWS = 256


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention by two batched matmuls, each key/value head's query group stacked as rows.

    For the many short rows of an RL batch (a few tokens each), SDPA's CPU kernel pays per (row, head)
    block, forward and backward; this pays per (row, key/value head) and differentiates as matmuls:
    half the time of SDPA's forward+backward at the default train step's shapes (512 rows, 3 queries,
    10 keys: 5.2 ms against 10.0 ms on the 2-core machine). It makes the [B, H, Tq, Tk] scores, so
    `attention` uses it for small calls with several queries, or with one query on many rows.
    """
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = h // hkv
    s = (q.reshape(b, hkv, g * tq, d) @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    s = s.view(b, hkv, g, tq, tk).masked_fill(~mask[:, None, None], float("-inf"))
    return (torch.softmax(s, -1).view(b, hkv, g * tq, tk) @ v).view(b, h, tq, d)


class _InvariantAttention(torch.autograd.Function):
    """Forward: the invariant kernel. Backward: the plain softmax-attention gradient, by matmuls.

    Only the forward's values must be batch-invariant (they are the log-probs the trainer
    compares with the engine's); the gradient is the exact one of softmax attention at these
    inputs, computed with fast kernels instead of differentiating the gathers and blocks:
        P = softmax(q k^T / sqrt(D)),  dv = P^T do,  dS = P * (do v^T - rowsum(P * do v^T)),
        dq = dS k / sqrt(D),  dk = dS^T q / sqrt(D).
    """

    @staticmethod
    def forward(q, k, v, mask, kv_block):
        if kv_block == 1:
            return sequential_attention(q, k, v, mask)
        return blocked_attention(q, k, v, mask, kv_block)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, _ = inputs
        ctx.save_for_backward(q, k, v, mask)

    @staticmethod
    def backward(ctx, do):
        q, k, v, mask = ctx.saved_tensors
        scale = 1.0 / math.sqrt(q.shape[-1])
        s = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask[:, None], float("-inf"))
        p = torch.softmax(s, -1)
        dv = p.transpose(-1, -2) @ do
        dp = do @ v.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv, None, None


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      kv_block: int) -> torch.Tensor:
    """The batch-invariant kernel (see the module docstring); k, v already have q's head count."""
    b, h, tq, d = q.shape
    n_keys = mask.sum(-1)  # [B, Tq]
    slots = math.ceil(mask.shape[-1] / kv_block) * kv_block  # static; surplus blocks add exact zeros
    # Column of each query's r-th allowed key: allowed columns first, in order (stable sort).
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)  # [B, Tq, Tk]
    if order.shape[-1] < slots:
        order = torch.cat([order, order[..., :1].expand(b, tq, slots - order.shape[-1])], -1)
    col = order[..., :slots]
    valid = torch.arange(slots, device=mask.device) < n_keys[..., None]  # [B, Tq, R]
    rows = torch.arange(b, device=mask.device)[:, None, None]
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, Tk, H, D]
    kg = kt[rows, col]  # [B, Tq, R, H, D]
    vg = vt[rows, col]
    qs = (q * (1.0 / math.sqrt(d))).transpose(1, 2)  # [B, Tq, H, D]
    scores = (qs[:, :, None] * kg).sum(-1)  # [B, Tq, R, H]: each a length-D row reduction
    scores = scores.masked_fill(~valid[..., None], float("-inf"))
    m = scores.amax(2, keepdim=True)
    p = torch.exp(scores - m)  # exact zeros on empty slots
    nb = slots // kv_block
    p = p.view(b, tq, nb, kv_block, h).permute(0, 1, 2, 4, 3).contiguous()  # [B, Tq, nb, H, blk]
    vb = vg.view(b, tq, nb, kv_block, h, d).permute(0, 1, 2, 4, 5, 3).contiguous()  # [.., H, D, blk]
    den_blocks = p.sum(-1)  # [B, Tq, nb, H]
    num_blocks = (p[..., None, :] * vb).sum(-1)  # [B, Tq, nb, H, D]
    den, num = den_blocks[:, :, 0], num_blocks[:, :, 0]
    for j in range(1, nb):  # blocks accumulate in key order, one add each
        den = den + den_blocks[:, :, j]
        num = num + num_blocks[:, :, j]
    return (num / den[..., None]).transpose(1, 2)


def sequential_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """kv_block = 1: keys accumulate one at a time in column order, no gather needed.

    A masked key adds an exact zero (x + 0 = x), so where the padding or the other
    segments sit cannot change any partial sum: the same invariance as the blocked
    kernel, at Tk small ops per call (cheap for short sequences, slow for long ones).
    """
    d = q.shape[-1]
    qs = q * (1.0 / math.sqrt(d))
    scores = (qs[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1)  # [B, H, Tq, Tk], length-D row reductions
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    den, num = p[..., 0], p[..., 0, None] * v[:, :, None, 0]
    for j in range(1, k.shape[2]):
        den = den + p[..., j]
        num = num + p[..., j, None] * v[:, :, None, j]
    return num / den[..., None]


def varlen_layout(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """FlashAttention's varlen form of a mask: (key_index, cu_seqlens_q, cu_seqlens_k, max_q, max_k).

    Queries are taken row-major ([B*Tq]); a new sequence starts where a query's allowed
    key range does not extend the previous query's by one. key_index selects the packed
    keys from k viewed as [B*Tk]. Raises ValueError when the mask is not causal-varlen.
    """
    b, tq, tk = mask.shape
    dev = mask.device
    lo = mask.to(torch.int8).argmax(-1).flatten()
    hi = (tk - 1 - mask.flip(-1).to(torch.int8).argmax(-1)).flatten()
    row = torch.arange(b, device=dev).repeat_interleave(tq)
    start = torch.ones(b * tq, dtype=torch.bool, device=dev)
    start[1:] = (row[1:] != row[:-1]) | (lo[1:] != lo[:-1]) | (hi[1:] != hi[:-1] + 1)
    first = torch.nonzero(start).flatten()
    last = torch.cat([first[1:] - 1, torch.tensor([b * tq - 1], device=dev)])
    q_len = last - first + 1
    k_lo, k_hi = lo[first], hi[last]
    k_len = k_hi - k_lo + 1
    seq = torch.cumsum(start.to(torch.int64), 0) - 1
    offset = torch.arange(b * tq, device=dev) - first[seq]
    expect = (k_len - q_len)[seq] + offset + 1  # bottom-right causal: keys visible to each query
    if not (bool((mask.sum(-1).flatten() == expect).all()) and bool((hi - lo + 1 == expect).all())):
        raise ValueError("attention mask is not a causal varlen layout (each query: a contiguous key run "
                         "ending one past its predecessor's); flash backends cannot express it")
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), torch.cumsum(q_len, 0).to(torch.int32)])
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), torch.cumsum(k_len, 0).to(torch.int32)])
    base = (row[first] * tk + k_lo).repeat_interleave(k_len)
    within = torch.arange(int(cu_k[-1]), device=dev) - cu_k[:-1].to(torch.int64).repeat_interleave(k_len)
    return base + within, cu_q, cu_k, int(q_len.max()), int(k_len.max())


def flash_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                           cfg: OpsConfig) -> torch.Tensor:
    """FlashAttention 2 (flash_attn) or 3 (flash_attn_interface) varlen, in bf16 for float32 inputs."""
    import third_party

    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    key_index, cu_q, cu_k, max_q, max_k = varlen_layout(mask)
    dt = torch.bfloat16 if q.dtype == torch.float32 else q.dtype
    qp = q.transpose(1, 2).reshape(b * tq, h, d).to(dt)
    kp = k.transpose(1, 2).reshape(b * tk, hkv, d)[key_index].to(dt)
    vp = v.transpose(1, 2).reshape(b * tk, hkv, d)[key_index].to(dt)
    if cfg.attention_backend == "flash_attn_3":
        fa3 = third_party.require("flash_attn_3", "--attention_backend=flash_attn_3")
        # num_splits=1: no split-KV, so a query's reduction order does not depend on the batch.
        out = fa3.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, max_q, max_k, causal=True, num_splits=1,
                                         deterministic=cfg.invariant)
    else:
        fa2 = third_party.require("flash_attn", "--attention_backend=flash_attn")
        out = fa2.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, max_q, max_k, causal=True,
                                         deterministic=cfg.invariant)
    out = out[0] if isinstance(out, tuple) else out
    return out.to(q.dtype).view(b, tq, h, d).transpose(1, 2)
