"""Attention with an explicit boolean mask (GQA: fewer key/value heads than query heads)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q: [B, H, Tq, D]; k, v: [B, Hkv, Tk, D]; mask: [B, Tq, Tk] bool (True = may attend).

    Every query row must allow at least one key (padding rows attend to themselves),
    so that no softmax runs over an empty set.
    """
    # enable_gqa maps query head h to key/value head h // groups inside the kernel, bit-identical
    # to repeating k and v per group, without copying the whole KV cache every decode step.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=q.shape[1] != k.shape[1])
